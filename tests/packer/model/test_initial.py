"""A slot's initial A by ``AdapterSpec.init``: PEFT's default (Kaiming-uniform) and ``gaussian`` (N(0, 1/r^2)),
drawn from the slot's own generator, B zero either way."""

from __future__ import annotations

import math

import pytest
import torch

from lora_sweep.packer.model.load import load_base
from lora_sweep.packer.model.packed import PackedModel
from lora_sweep.packer.plan import AdapterSpec
from lora_sweep.packer.variants.initial import init_a


@pytest.mark.parametrize("rank", [1, 4, 16])
def test_gaussian_a_is_normal_with_std_one_over_r(rank: int) -> None:
    a = torch.empty(rank, 4096)
    init_a(a, AdapterSpec(rank=rank, init="gaussian"), torch.Generator().manual_seed(0))
    want = torch.empty(rank, 4096).normal_(std=1 / rank, generator=torch.Generator().manual_seed(0))
    assert torch.equal(a, want)
    assert abs(a.std().item() * rank - 1) < 0.05 and abs(a.mean().item()) < 3 / (rank * math.sqrt(a.numel()))


def test_kaiming_a_is_pefts_default_bound() -> None:
    a = torch.empty(8, 300)
    init_a(a, AdapterSpec(rank=8), torch.Generator().manual_seed(0))
    bound = 1 / math.sqrt(300)  # kaiming_uniform_(a=sqrt(5)): gain sqrt(2 / 6), bound gain * sqrt(3 / fan_in)
    assert a.abs().max() <= bound and a.abs().max() > 0.9 * bound


def test_a_slot_starts_from_its_init_with_b_zero(tiny_dirs) -> None:
    model, _ = load_base(str(tiny_dirs("llama")), attn_implementation="eager")
    pm = PackedModel(model)
    pm.add_slot(0, AdapterSpec(rank=4, seed=5, init="gaussian"))
    pm.add_slot(1, AdapterSpec(rank=4, seed=5))
    gauss, kaiming = pm.slot_weights(0), pm.slot_weights(1)
    gen = torch.Generator().manual_seed(5)
    for path, (a, b) in gauss.items():
        assert torch.equal(a, torch.empty_like(a).normal_(std=1 / 4, generator=gen)), path
        assert b.count_nonzero() == 0 and kaiming[path][1].count_nonzero() == 0
        assert not torch.equal(a, kaiming[path][0])
