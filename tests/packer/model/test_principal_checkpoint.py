"""A PiSSA / OLoRA slot saves as PEFT converts such an adapter (``path_initial_model_for_weight_conversion``): a plain
LoRA of rank 2r against the original base, ``A' = [A; A0]``, ``B' = [B, -B0]``, alpha scaled to keep the scale. PEFT
loads it onto the unmodified base and gives the packed adapter's logits; merged into the base, so does the base."""

from __future__ import annotations

import json

import pytest

from lora_sweep.packer.plan import AdapterSpec
from tests.helpers import assert_peft_and_merge_reproduce, train_and_save

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


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_a_principal_slot_exports_as_a_plain_lora_peft_loads_and_merge_reproduces(tiny_dirs, tmp_path,
                                                                                  family: str) -> None:
    model_dir = tiny_dirs(family)
    saved, logits = train_and_save(model_dir, SPECS[family], tmp_path)
    for key, adapter_dir in saved.items():
        spec = SPECS[family][key]
        config, _ = assert_peft_and_merge_reproduce(model_dir, adapter_dir, logits[key])
        assert config["r"] == spec.rows == (2 if spec.principal else 1) * spec.rank
        assert config["init_lora_weights"] is True  # a plain LoRA: PEFT must not decompose the base again


def test_the_saved_scale_is_the_trained_one(tiny_dirs, tmp_path) -> None:
    saved, _ = train_and_save(tiny_dirs("llama"), SPECS["llama"], tmp_path)
    for key, adapter_dir in saved.items():
        spec, cfg = SPECS["llama"][key], json.loads((adapter_dir / "adapter_config.json").read_text())
        scale = cfg["lora_alpha"] / (cfg["r"] ** 0.5 if cfg["use_rslora"] else cfg["r"])
        assert scale == pytest.approx(spec.scale, rel=1e-12)
