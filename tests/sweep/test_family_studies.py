"""Every tiny family through the product: a small all-linear study, ``sweep export``, and the export in PEFT.

Per family (``packer.tiny.models.FAMILIES``): two all-linear trials packed together train a few steps, score held-out
loss and exact-match (greedy decoding with the KV cache) on the fixed shapes a CUDA study evaluates on, and the
best exports (vLLM-padded). PEFT must load the export onto the base with no missing or unexpected keys, adapt the
modules PEFT's own ``all-linear`` picks, and give the engine's logits for the trial's saved slot (fp32); the merged
export gives them too.

Run: python -m pytest tests/sweep/test_family_studies.py -q
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM
from transformers.pytorch_utils import Conv1D

from lora_sweep.errors import ConfigError
from lora_sweep.kernels.ops import PackLayout
from lora_sweep.packer.model.checkpoint import read_adapter
from lora_sweep.packer.model.load import load_base
from lora_sweep.packer.model.packed import PackedModel
from lora_sweep.packer.plan import AdapterSpec
from lora_sweep.packer.tiny.data import arithmetic_rows, write_jsonl
from lora_sweep.packer.tiny.models import FAMILIES
from lora_sweep.store.api import ResultsStore
from lora_sweep.sweep.config.loader import load_study
from lora_sweep.sweep.export import export_trial
from lora_sweep.sweep.study import run_study
from tests.conftest import load_adapter, write_study

IDS = torch.randint(3, 260, (2, 12), generator=torch.Generator().manual_seed(0))
MASK = torch.ones_like(IDS)


def _study(tmp_path: Path, model_dir: Path, family: str) -> Path:
    rows = arithmetic_rows(48, seed=1, fmt="prompt_completion")
    write_jsonl(tmp_path / "train.jsonl", rows[:40])
    write_jsonl(tmp_path / "eval.jsonl", rows[40:])  # 8 held-out rows: eval stays a fraction of a second
    data = {"train": str(tmp_path / "train.jsonl"), "eval": str(tmp_path / "eval.jsonl"),
            "format": "prompt_completion", "max_length": 32}
    path = write_study(tmp_path, model_dir, family, data=data, budget={"trials": 2},
                       train={"max_steps": 4, "micro_batch": 2},
                       search={"rank": [4, 8], "lr": {"low": 1e-2, "high": 3e-2, "log": True},
                               "targets": {"all": "all-linear"}},
                       objectives=[{"metric": "eval_loss", "direction": "minimize"}], pruning={"kind": "none"},
                       pack={"max_slots": 2},
                       # the fixed shapes a CUDA study evaluates on (batched's auto is per adapter on the CPU)
                       evaluators=[{"name": "heldout_loss", "options": {"batched": True}},
                                   {"name": "generation", "options": {"max_new_tokens": 2, "batched": True}}])
    spec = load_study(path)
    summary = run_study(spec, log=lambda m: None)
    assert summary.complete == 2, f"{family}: {summary}"
    return spec.out_dir


def _peft_all_linear(model_dir: Path) -> set[str]:
    """Module paths PEFT's own ``target_modules="all-linear"`` adapts."""
    base = AutoModelForCausalLM.from_pretrained(str(model_dir))
    conv1d = any(isinstance(m, Conv1D) for m in base.modules())  # GPT-2 stores W as (D_in, D_out)
    model = get_peft_model(base, LoraConfig(r=2, target_modules="all-linear", fan_in_fan_out=conv1d))
    return {n.removeprefix("base_model.model.").removesuffix(".lora_A.default.weight")
            for n, _ in model.named_parameters() if n.endswith(".lora_A.default.weight")}


@pytest.mark.parametrize("family", FAMILIES)
def test_all_linear_study_exports_an_adapter_peft_loads(tiny_dirs, tmp_path: Path, family: str) -> None:
    model_dir = tiny_dirs(family)
    out_dir = _study(tmp_path, model_dir, family)
    with ResultsStore(out_dir / "results.db", create=False) as store:
        trials = store.trials("COMPLETE")
    assert all(t.metrics and "exact_match" in t.metrics and torch.isfinite(torch.tensor(t.metrics["eval_loss"]))
               for t in trials)
    export = export_trial(out_dir, tmp_path / "export", best=True)
    config = json.loads((export.out / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(model_dir)

    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(model_dir)), str(export.out))
    keys = peft_model.load_adapter(str(export.out), adapter_name="check")
    assert keys.missing_keys == [] and keys.unexpected_keys == []
    adapted = {n.removeprefix("base_model.model.").removesuffix(".lora_A.default.weight")
               for n, _ in peft_model.named_parameters() if n.endswith(".lora_A.default.weight")}
    assert adapted == _peft_all_linear(model_dir), "export's target_modules must round-trip to PEFT's all-linear"
    peft_model.set_adapter("default")
    peft_model.eval()

    source = out_dir / "adapters" / f"trial-{export.trial}"
    cfg, _ = read_adapter(source)
    pm = PackedModel(load_base(str(model_dir))[0])
    pm.add_slot(0, AdapterSpec(rank=cfg["r"], alpha=cfg["lora_alpha"], rslora=cfg["use_rslora"],
                               targets=tuple(cfg["target_modules"])))
    assert set(pm.slot_paths[0]) == adapted
    load_adapter(pm, 0, source)
    with torch.no_grad():
        ours = pm.forward(IDS, MASK, PackLayout((0,), (0,), (2,), (12,), (0.0,), (0,)))
        base = pm.forward(IDS, MASK, None)
        theirs = peft_model(input_ids=IDS, attention_mask=MASK).logits
    assert (ours - base).abs().max() > 1e-4, "the trained adapter must move the logits for the check to mean much"
    torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-5)

    merged = export_trial(out_dir, tmp_path / "merged", trial=export.trial, merge=True)
    with torch.no_grad():
        folded = AutoModelForCausalLM.from_pretrained(str(merged.out))(input_ids=IDS, attention_mask=MASK).logits
    torch.testing.assert_close(folded, ours, rtol=1e-4, atol=1e-4)  # W + s·B·A rounded once to fp32


def test_cli_offers_every_family(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from lora_sweep.cli import cli

    result = CliRunner().invoke(cli, ["tiny-model", "--family", "phi3", "--out", str(tmp_path / "phi3")])
    assert result.exit_code == 0, result.output
    assert AutoModelForCausalLM.from_pretrained(str(tmp_path / "phi3")).config.model_type == "phi3"


@pytest.mark.parametrize("family", ["gemma2", "granite", "cohere"])
def test_chunked_loss_refuses_post_processed_logits(tiny_dirs, tmp_path: Path, family: str) -> None:
    """Their logits are not the head's output (soft-capping, scaling): the chunked loss would train them wrong."""
    path = write_study(tmp_path, tiny_dirs(family), family, budget={"trials": 1}, pruning={"kind": "none"},
                       pack={"max_slots": 1, "chunked_ce": True}, evaluators=[{"name": "heldout_loss"}])
    with pytest.raises(ConfigError, match=r"^chunked_ce: the model post-processes its logits \(\w+=[\d.]+\); "
                                          r"train it with chunked_ce off$"):
        run_study(load_study(path), log=lambda m: None)
