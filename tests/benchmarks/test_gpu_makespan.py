"""W3 makespan benchmark, end to end on the CPU with a tiny model: every mode trains and saves what it
claims, counts the tokens it really trains and labels its extrapolations."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lora_sweep.benchmarks.gpu_makespan import makespan
from lora_sweep.benchmarks.makespan_sweep import sample_indices, sweep_configs
from lora_sweep.benchmarks.timing import check_row

ROOT = Path(__file__).resolve().parents[2]
N, STEPS, SEQ, PROCS = 6, 3, 32, 2


@pytest.fixture(scope="module")
def w3(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, dict]]:
    """One tiny W3 run of every mode: 6 configs x 3 steps, 3 of 6 sequential, 2 processes on 2 of 6."""
    work = tmp_path_factory.mktemp("w3")
    printed: list[dict] = []
    lines = makespan(n_configs=N, steps=STEPS, seq=SEQ, procs=PROCS, sequential_sample=3, procs_sample=2,
                     device="cpu", tiny=True, workdir=work, emit=printed.append)
    assert printed == lines
    return work, {line["mode"]: line for line in lines}


def test_every_mode_emits_its_line_with_the_tokens_it_trains(w3: tuple[Path, dict[str, dict]]) -> None:
    _, lines = w3
    assert list(lines) == ["packed", "packed-warm", "peft-sequential", "peft-4proc"]
    expected = sum(STEPS * c.micro_batch * (SEQ - 1) for c in sweep_configs(N))
    for mode, line in lines.items():
        assert line["workload"] == "W3" and line["configs"] == N and line["steps"] == STEPS and line["seq"] == SEQ
        assert line["makespan_s"] > 0 and line["tokens"] == expected, mode
        assert line["tok_s"] == pytest.approx(expected / line["makespan_s"], rel=1e-2)  # both rounded
        check_row(line, mode)
    assert "ratio_vs_packed" not in lines["packed"] and "ratio_vs_packed" not in lines["packed-warm"]
    packed = lines["packed"]  # its phases add up to no more than its makespan
    phases = [packed[k] for k in ("load_s", "first_step_s", "later_steps_s", "save_s")]
    assert all(p >= 0 for p in phases) and sum(phases) <= packed["makespan_s"] + 0.05, packed
    for mode in ("peft-sequential", "peft-4proc"):
        for ref in ("packed", "packed-warm"):
            assert lines[mode]["ratio_vs_" + ref.replace("-", "_")] == pytest.approx(
                lines[mode]["makespan_s"] / lines[ref]["makespan_s"], abs=0.01)


def test_extrapolation_is_labelled_and_only_the_sample_trains(w3: tuple[Path, dict[str, dict]]) -> None:
    work, lines = w3
    seq, procs = lines["peft-sequential"], lines["peft-4proc"]
    assert seq["makespan_basis"] == "extrapolated from 3 of 6"
    assert procs["makespan_basis"] == "extrapolated from 2 of 6" and procs["procs"] == PROCS
    assert sum(seq["estimated_by"].values()) == sum(procs["estimated_by"].values()) == N
    assert seq["estimated_by"]["measured"] == 3 and procs["estimated_by"]["measured"] == 2
    assert sorted(p.name for p in (work / "adapters" / "peft-sequential").iterdir()) == [
        f"config-{i}" for i in sample_indices(N, 3)]
    # Two processes deal the configs round-robin and each trains the first of its share.
    assert sorted(p.name for p in (work / "adapters" / "peft-4proc").iterdir()) == ["config-0", "config-1"]


def test_packed_adapters_load_with_peft_and_were_trained(w3: tuple[Path, dict[str, dict]]) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    work, _ = w3
    for c in sweep_configs(N):
        adapter = work / "adapters" / "packed" / f"config-{c.index}"
        model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(work / "base"), adapter)
        assert model.peft_config["default"].r == c.rank
        b = [p for n, p in model.named_parameters() if "lora_B" in n]
        assert len(b) == 7 * 2 and all(p.shape[1] == c.rank for p in b)  # 7 projections x 2 layers
        assert all(torch.count_nonzero(p) > 0 for p in b)  # B starts at zero: nonzero means it trained


def test_module_imports_without_the_sweep_dependencies() -> None:
    """The GPU image has no optuna, sqlite-utils or plotly: the benchmark must not need them."""
    code = "import json, sys; import lora_sweep.benchmarks.gpu_makespan; print(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    loaded = {m.split(".")[1] if m.startswith("lora_sweep.") else m.split(".")[0] for m in json.loads(out.stdout)}
    assert not loaded & {"optuna", "sqlite_utils", "plotly", "sweep", "peft"}
