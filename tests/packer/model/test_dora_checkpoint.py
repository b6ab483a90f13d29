"""A DoRA slot saves as a PEFT DoRA adapter (``use_dora``, each layer's ``lora_magnitude_vector``): PEFT loads it onto
the base and gives the packed adapter's logits (the per-batch path's DoRA term, ``kernels.reference.dora_loop``);
``merge_adapter`` folds the magnitudes in as PEFT merges DoRA, so the merged base gives them too."""

from __future__ import annotations

import pytest

from lora_sweep.packer.plan import AdapterSpec
from tests.helpers import assert_peft_and_merge_reproduce, train_and_save

SPECS = {
    "llama": [AdapterSpec(rank=4, alpha=8, targets=("q_proj", "down_proj"), lr=1e-2, max_steps=6, seed=1, dora=True),
              AdapterSpec(rank=2, alpha=16, rslora=True, targets=("all-linear",), lr=1e-2, max_steps=6, seed=2,
                          dora=True, lr_ratio=4.0),
              AdapterSpec(rank=4, alpha=8, targets=("v_proj",), lr=1e-2, max_steps=6, seed=3)],
    "gpt2": [AdapterSpec(rank=4, alpha=8, targets=("c_attn", "c_fc"), lr=1e-2, max_steps=6, seed=1, dora=True),
             AdapterSpec(rank=4, alpha=8, targets=("c_proj",), lr=1e-2, max_steps=6, seed=2)],
}


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_a_dora_slot_exports_as_a_peft_dora_adapter_and_merges(tiny_dirs, tmp_path, family: str) -> None:
    model_dir = tiny_dirs(family)
    saved, logits = train_and_save(model_dir, SPECS[family], tmp_path)
    for key, adapter_dir in saved.items():
        spec = SPECS[family][key]
        config, tensors = assert_peft_and_merge_reproduce(model_dir, adapter_dir, logits[key])
        magnitudes = [k for k in tensors if k.endswith(".lora_magnitude_vector")]
        assert config["use_dora"] is spec.dora and (len(magnitudes) > 0) is spec.dora
