"""Cost metrics from the trainer's numbers."""

from __future__ import annotations

import pytest

from lora_sweep.evaluators.cost import adapter_params, cost_metrics, device_seconds, memory_share, slot_adapter_params
from lora_sweep.packer.model.load import load_base
from lora_sweep.packer.model.packed import PackedModel
from lora_sweep.packer.plan import AdapterSpec


def test_adapter_params_from_shapes_equals_the_slot(tiny_dirs) -> None:
    pm = PackedModel(load_base(str(tiny_dirs("llama")))[0])
    pm.add_slot(0, AdapterSpec(rank=4, targets=("q_proj", "k_proj", "down_proj")))
    shapes = [(layer.in_features, layer.out_features) for p, layer in pm.layers.items() if p in pm.slot_paths[0]]
    # llama tiny: q 64->64, k 64->32 (GQA), down 128->64, two layers
    assert adapter_params(shapes, 4) == 2 * 4 * ((64 + 64) + (64 + 32) + (128 + 64)) == slot_adapter_params(pm, 0)


def test_time_and_memory_are_shared_by_tokens() -> None:
    assert device_seconds(100.0, 250, 1000) == 25.0
    assert device_seconds(100.0, 0, 0) == 0.0
    assert memory_share(1000.0, 1, 4) == 250.0
    assert memory_share(1000.0, 1, 4, n_trials=2, base_bytes=600.0) == 300.0 + 100.0
    with pytest.raises(ValueError):
        device_seconds(1.0, 5, 4)
    m = cost_metrics(adapter_params=1024, trial_tokens=300, pack_tokens=1200, pack_seconds=8.0, peak_bytes=2**30,
                     n_trials=4)
    assert m == {"adapter_params": 1024.0, "train_tokens": 300.0, "device_seconds": 2.0, "peak_memory_mb": 256.0}
    assert "peak_memory_mb" not in cost_metrics(adapter_params=1, trial_tokens=1, pack_tokens=1, pack_seconds=1.0)

