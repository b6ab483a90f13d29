"""A calibration is measured once per model, device and shape, announced, cached, and its own phase of a run."""

from __future__ import annotations

import io
import json

from lora_sweep.packer.api import open_base
from lora_sweep.sweep.config.loader import load_study
from lora_sweep.sweep.live import PlainLog
from lora_sweep.sweep.planning import plan_pack
from lora_sweep.sweep.study import run_study
from tests.conftest import write_study
from tests.helpers import refuse_model_loads


def test_a_second_plan_reads_the_calibration_back(tiny_dirs, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("LORA_SWEEP_CACHE", str(tmp_path / "cache"))
    spec = load_study(write_study(tmp_path, tiny_dirs("llama"), "cached"))
    pm = open_base(str(tiny_dirs("llama")))
    said: list[str] = []
    first = plan_pack(spec, pm, log=said.append)
    assert len(said) == 1 and said[0].startswith("calibrating the memory model on cpu: 1 x 4 probe packs")
    assert first.calibration.startswith("measured in ")
    (entry,) = (tmp_path / "cache" / "calibration").iterdir()
    assert json.loads(entry.read_text())["key"]["seq_len"] == 48
    second = plan_pack(spec, pm, log=said.append)
    assert len(said) == 1 and second.calibration == f"cached ({entry})"  # nothing measured, nothing announced
    assert second.memory == first.memory and second.slots == first.slots
    longer = load_study(write_study(tmp_path, tiny_dirs("llama"), "cached"), ["data.max_length=64"])
    assert plan_pack(longer, pm, log=said.append).calibration.startswith("measured in ")  # another shape
    assert len(said) == 2 and len(list((tmp_path / "cache" / "calibration").iterdir())) == 2


def test_packing_auto_calibrates_in_its_own_phase_once(tiny_dirs, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("LORA_SWEEP_CACHE", str(tmp_path / "cache"))
    splits, logs = [], []
    for name in ("auto-a", "auto-b"):  # two studies of one model and shape: the second reads the first's
        spec = load_study(write_study(tmp_path, tiny_dirs("llama"), name, pack={"max_slots": "auto"},
                                      budget={"trials": 1}, train={"max_steps": 2, "micro_batch": 4},
                                      pruning={"kind": "none"}))
        out = io.StringIO()
        log = PlainLog(out)
        splits.append(run_study(spec, progress=log.update, log=log.line).split)
        logs.append([line[9:] for line in out.getvalue().splitlines()])
    assert any(line.startswith("calibrating the memory model on cpu") for line in logs[0])
    assert any(line.startswith("pack: auto -> ") and "(calibration measured in " in line for line in logs[0])
    assert not any(line.startswith("calibrating") for line in logs[1])
    assert any(line.startswith("pack: auto -> ") and "(calibration cached (" in line for line in logs[1])
    first, second = (s["phases"]["calibrate"] for s in splits)
    assert first > 0 and second < first and splits[0]["calls"]["calibrate"] == 1


def test_a_cached_plan_loads_no_weights_nor_tokenizer_and_prints_the_same(tiny_dirs, tmp_path, monkeypatch) -> None:
    """The cache keeps the base's shape and the rows' token lengths beside the calibration, and the sized pack's timed
    step (``sweep.pack_step``): a second ``sweep plan`` plans from them (the table as the first printed it) without
    the base's weights or its tokenizer."""
    from click.testing import CliRunner

    from lora_sweep.cli import cli

    monkeypatch.setenv("LORA_SWEEP_CACHE", str(tmp_path / "cache"))
    path = write_study(tmp_path, tiny_dirs("llama"), "shaped", budget={"trials": 4})
    first = CliRunner().invoke(cli, ["plan", str(path)])
    assert first.exit_code == 0, first.output

    refuse_model_loads(monkeypatch)
    second = CliRunner().invoke(cli, ["plan", str(path)])
    assert second.exit_code == 0, second.output
    differ = [(a, b) for a, b in zip(first.stdout.splitlines(), second.stdout.splitlines(), strict=True) if a != b]
    assert [a.split()[0] for a, _ in differ if not a.startswith("memory available")] == ["calibration", "sized"], \
        differ
    assert "timing the sized pack on cpu: 1 + " in first.stderr and "timing" not in second.stderr
    sized = next(line for line in second.stdout.splitlines() if line.startswith("sized pack's step"))
    assert "cached (" in second.output and sized.split()[-1].startswith("(") and "pack_step" in sized
    # a target set the cached shape lacks goes to the model, whose check names the projections it has
    bad = CliRunner().invoke(cli, ["plan", str(path), "search.targets.attn=[q_proj, w_proj]"])
    assert bad.exit_code != 0 and "a cached plan loads neither" in str(bad.exception), bad.output
