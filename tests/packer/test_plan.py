"""``packer.plan``'s memory arithmetic for a space: how many slots of the widest kind fit, and their step's peak,
asked of a calibrated ``MemoryModel`` and the base's ``BaseShape`` (no model, no torch)."""

from __future__ import annotations

import pytest

from lora_sweep.packer.plan import AdapterSpec, BaseShape, MemoryModel, adapter_param_count

BASE = BaseShape((("q_proj", 64, 64), ("v_proj", 64, 32), ("down_proj", 128, 64)), 100_000,
                 shard_peak={2: 70_000}, shard_load={2: 60_000})
MODEL = MemoryModel(base_bytes=100_000, bytes_per_token=40.0, bytes_per_token_rank=2.0, bytes_per_param=16.0)


def test_the_peak_of_a_pack_counts_every_slots_tokens_rows_and_parameters() -> None:
    rows, tokens = 8, 4 * 32
    params = adapter_param_count([(64, 64), (64, 32), (128, 64)], rows)
    expected = 100_000 + (40.0 + 2.0 * rows) * 3 * tokens + 16.0 * 3 * params  # a token meets its own slot's rows
    assert MODEL.pack_peak(BASE, 3, rows, tokens) == int(expected)


@pytest.mark.parametrize("rows", [2, 16, 2 * 16])
def test_the_slots_that_fit_are_the_most_whose_peak_is_within_the_budget(rows: int) -> None:
    budget = 1_500_000
    n = MODEL.slots_for(BASE, rows, 128, budget)
    assert 0 < n < 256
    assert MODEL.pack_peak(BASE, n, rows, 128) <= budget < MODEL.pack_peak(BASE, n + 1, rows, 128)
    assert MODEL.slots_for(BASE, rows, 128, budget, limit=2) == min(n, 2)
    assert MODEL.slots_for(BASE, rows, 128, MODEL.base_bytes) == 0


def test_a_principal_slot_is_planned_at_twice_its_rank() -> None:
    pissa = AdapterSpec(rank=8, init="pissa", dropout=0.0)
    assert pissa.rows == 16 and AdapterSpec(rank=8).rows == 8
    assert MODEL.pack_peak(BASE, 2, pissa.rows, 64) > MODEL.pack_peak(BASE, 2, 8, 64)


def test_a_sharded_base_counts_one_ranks_share_beyond_the_whole_base() -> None:
    assert BASE.shard_extra(2) == 70_000 - 100_000 and BASE.shard_extra(1) == 0
    with pytest.raises(KeyError):
        BASE.shard_extra(4)  # no share computed for 4 GPUs: a sharded plan refuses it first


def test_a_sharded_pack_is_planned_per_gpu_with_its_share_of_the_base() -> None:
    """Over 2 GPUs one rank holds 70 000 base bytes in place of 100 000, beside slots replicated as on one GPU: the
    peak is 30 000 less, and a budget a sixth slot just misses on one GPU fits it on each of two."""
    rows, tokens = 8, 128
    assert MODEL.pack_peak(BASE, 3, rows, tokens, gpus=2) == MODEL.pack_peak(BASE, 3, rows, tokens) - 30_000
    assert MODEL.base_on(BASE, 2) == 70_000 and MODEL.base_on(BASE) == 100_000
    budget = MODEL.pack_peak(BASE, 6, rows, tokens) - 1
    assert MODEL.slots_for(BASE, rows, tokens, budget) == 5 and MODEL.slots_for(BASE, rows, tokens, budget, gpus=2) == 6
    assert MODEL.pack_peak(BASE, 6, rows, tokens, gpus=2) <= budget < MODEL.pack_peak(BASE, 7, rows, tokens, gpus=2)
