"""A study with ``model.quantize: nf4`` runs; its adapters stay PEFT adapters for the plain base; ``export --merge``
dequantizes the NF4 base first and says so in one line."""

from __future__ import annotations

import json
import subprocess
import sys

import torch
from optuna.trial import TrialState
from transformers import AutoModelForCausalLM

from lora_sweep.kernels.ops import PackLayout
from lora_sweep.packer.model.checkpoint import read_adapter
from lora_sweep.packer.model.load import load_base
from lora_sweep.packer.model.packed import PackedModel
from lora_sweep.packer.plan import AdapterSpec
from lora_sweep.store.api import ResultsStore
from lora_sweep.sweep.config.loader import load_study
from lora_sweep.sweep.study import run_study
from tests.conftest import load_adapter, need_module, write_study

need_module("torchao", "qlora")

ROOT = __import__("pathlib").Path(__file__).resolve().parents[2]
IDS = torch.randint(3, 300, (2, 14), generator=torch.Generator().manual_seed(0))


def test_a_qlora_study_runs_and_its_merge_is_the_nf4_model(tiny_dirs, tmp_path) -> None:
    model_dir = tiny_dirs("llama")
    path = write_study(tmp_path, model_dir, "qlora", model={"path": str(model_dir), "device": "cpu", "quantize": "nf4"},
                       train={"max_steps": 6, "micro_batch": 2}, budget={"trials": 3}, pruning={"kind": "none"},
                       evaluators=[{"name": "heldout_loss"}])
    spec = load_study(path)
    assert spec.model.quantize == "nf4"
    run_study(spec, log=lambda m: None)
    with ResultsStore(spec.out_dir / "results.db", create=False) as store:
        trials = store.trials()
        assert store.meta()["spec"]["model"]["quantize"] == "nf4"
    assert len(trials) == 3 and all(t.state == TrialState.COMPLETE.name for t in trials)
    rec = trials[0]
    cfg, _ = read_adapter(spec.out_dir / rec.adapter_path)
    assert cfg["base_model_name_or_path"] == str(model_dir)  # a PEFT adapter for the plain base

    out = tmp_path / "merged"
    result = subprocess.run([sys.executable, "-m", "lora_sweep", "export", str(spec.out_dir), "--trial",
                             str(rec.number), "--merge", "--out", str(out)], capture_output=True, text=True,
                            timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.strip().splitlines()
    assert len(lines) == 2 and lines[0].startswith("merge: the study trained over a NF4 base"), result.stdout
    assert "dequantized from NF4 before merging" in lines[0]

    merged = AutoModelForCausalLM.from_pretrained(str(out)).eval()
    mask = torch.ones_like(IDS)

    def engine(quantize: str | None) -> torch.Tensor:  # the trial's adapter in a fresh slot over the base
        model, _ = load_base(str(model_dir), quantize=quantize)
        pm = PackedModel(model)
        pm.add_slot(0, AdapterSpec(rank=cfg["r"], alpha=cfg["lora_alpha"], rslora=cfg["use_rslora"],
                                   targets=tuple(cfg["target_modules"])))
        load_adapter(pm, 0, spec.out_dir / rec.adapter_path)
        with torch.no_grad():
            return pm.forward(IDS, mask, PackLayout((0,), (0,), (2,), (14,), (0.0,), (0,)))

    with torch.no_grad():
        got = merged(input_ids=IDS, attention_mask=mask).logits
    torch.testing.assert_close(got, engine("nf4"), rtol=1e-4, atol=1e-4)
    assert (got - engine(None)).abs().max() > 1e-3  # merged into the dequantized weights, not the plain ones
    assert json.loads((out / "config.json").read_text()).get("quantization_config") is None
    assert "trained over the base quantised to NF4 (QLoRA" in (out / "README.md").read_text()


def test_plan_of_a_qlora_study_measures_the_nf4_base(tiny_dirs, tmp_path) -> None:
    from click.testing import CliRunner

    from lora_sweep.cli import cli
    from lora_sweep.packer.api import Packer
    from lora_sweep.sweep.planning import plan_pack

    model_dir = tiny_dirs("llama")
    static = {}
    for quantize in (None, "nf4"):
        path = write_study(tmp_path, model_dir, f"plan-{quantize}", budget={"trials": 3},
                           model={"path": str(model_dir), "device": "cpu", "quantize": quantize})
        result = CliRunner().invoke(cli, ["plan", str(path)])
        assert result.exit_code == 0, result.output
        line = next(x for x in result.output.splitlines() if x.startswith("frozen (base model"))
        assert ("nf4 projections" in line) == (quantize == "nf4"), line
        model, _ = load_base(str(model_dir), quantize=quantize)
        static[quantize] = plan_pack(load_study(path), Packer(PackedModel(model))).memory.base_bytes
    assert static["nf4"] < static[None]
