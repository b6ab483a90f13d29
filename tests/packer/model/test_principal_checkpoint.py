"""A PiSSA / OLoRA slot saves as PEFT converts such an adapter (``path_initial_model_for_weight_conversion``): a plain
LoRA of rank 2r against the original base, ``A' = [A; A0]``, ``B' = [B, -B0]``, alpha scaled to keep the scale. PEFT
loads it onto the unmodified base and gives the packed adapter's logits; merged into the base, so does the base."""

from __future__ import annotations

import json

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from lora_sweep.kernels.ops import PackLayout
from lora_sweep.packer.data.rows import SlotStream
from lora_sweep.packer.model.checkpoint import read_adapter, save_adapters
from lora_sweep.packer.model.packed import PackedModel, load_base
from lora_sweep.packer.plan import AdapterSpec
from lora_sweep.packer.step.train import SlotJob, train
from lora_sweep.sweep.export import merge_adapter
from tests.conftest import random_examples

SPECS = {
    "llama": [AdapterSpec(rank=4, alpha=8, targets=("q_proj", "down_proj"), lr=1e-2, max_steps=6, seed=1,
                          init="pissa"),
              AdapterSpec(rank=2, alpha=16, rslora=True, targets=("all-linear",), lr=1e-2, max_steps=6, seed=2,
                          init="olora")],
    "gpt2": [AdapterSpec(rank=4, alpha=8, targets=("c_attn", "c_fc"), lr=1e-2, max_steps=6, seed=1, init="pissa"),
             AdapterSpec(rank=4, alpha=8, targets=("c_proj",), lr=1e-2, max_steps=6, seed=2),
             AdapterSpec(rank=2, alpha=4, targets=("c_attn",), lr=1e-2, max_steps=6, seed=3, init="pissa",
                         dora=True)],  # DoRA over PiSSA: the converted rank-2r adapter with its magnitudes
}
IDS = torch.randint(3, 300, (2, 12), generator=torch.Generator().manual_seed(0))


def _train_and_save(model_dir, specs, out_root):  # noqa: ANN001, ANN202
    """Each slot's saved directory and its packed logits on IDS, taken as it ends (its frozen rows still live)."""
    model, _ = load_base(str(model_dir))
    pm = PackedModel(model)
    queue = [SlotJob(s, SlotStream(random_examples(20, i), 2, seed=i), key=i) for i, s in enumerate(specs)]
    saved, logits = {}, {}

    def on_end(ends):  # noqa: ANN001, ANN202
        dirs = save_adapters(pm, [(e.slot, out_root / f"trial-{e.job.key}", None) for e in ends],
                             base_model_name_or_path=str(model_dir))
        for e, d in zip(ends, dirs, strict=True):
            saved[e.job.key] = d
            with torch.no_grad():
                layout = PackLayout((e.slot,), (0,), (2,), (12,), (0.0,), (0,))
                logits[e.job.key] = pm.forward(IDS, torch.ones_like(IDS), layout)

    train(pm, len(specs), lambda s: queue.pop(0) if queue else None, pad_id=0, on_end=on_end)
    return saved, logits


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_a_principal_slot_exports_as_a_plain_lora_peft_loads_and_merge_reproduces(tiny_dirs, tmp_path,
                                                                                  family: str) -> None:
    model_dir = tiny_dirs(family)
    saved, logits = _train_and_save(model_dir, SPECS[family], tmp_path)
    for key, adapter_dir in saved.items():
        spec = SPECS[family][key]
        config, _ = assert_peft_and_merge_reproduce(model_dir, adapter_dir, logits[key])
        assert config["r"] == spec.rows == (2 if spec.principal else 1) * spec.rank
        assert config["init_lora_weights"] is True  # a plain LoRA: PEFT must not decompose the base again


def assert_peft_and_merge_reproduce(model_dir, adapter_dir, packed: torch.Tensor):  # noqa: ANN001, ANN201
    """PEFT's model of the saved adapter on the original base, and the base with it merged (``merge_adapter``), give
    the packed adapter's logits on IDS; returns the adapter's (config, tensors)."""
    config, tensors = read_adapter(adapter_dir)
    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(model_dir)), str(adapter_dir))
    peft_model.eval()
    with torch.no_grad():
        theirs = peft_model(input_ids=IDS, attention_mask=torch.ones_like(IDS)).logits
        base = AutoModelForCausalLM.from_pretrained(str(model_dir)).eval()
        plain = base(input_ids=IDS).logits
        merge_adapter(base, config, tensors)
        merged = base(input_ids=IDS).logits
    assert (packed - plain).abs().max() > 1e-4, "the adapter must change the logits for the check to mean it"
    torch.testing.assert_close(packed, theirs, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(merged, theirs, rtol=1e-4, atol=1e-4)  # the merge in fp32, then the forward
    return config, tensors


def test_the_saved_scale_is_the_trained_one(tiny_dirs, tmp_path) -> None:
    saved, _ = _train_and_save(tiny_dirs("llama"), SPECS["llama"], tmp_path)
    for key, adapter_dir in saved.items():
        spec, cfg = SPECS["llama"][key], json.loads((adapter_dir / "adapter_config.json").read_text())
        scale = cfg["lora_alpha"] / (cfg["r"] ** 0.5 if cfg["use_rslora"] else cfg["r"])
        assert scale == pytest.approx(spec.scale, rel=1e-12)
