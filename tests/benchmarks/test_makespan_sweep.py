"""W3's fixed sweep: the configurations span the grid, the sample is evenly spaced, and the estimate of an
unmeasured configuration comes from the measured ones most like it."""

from __future__ import annotations

from lora_sweep.benchmarks.makespan_sweep import (
    LR_RANGE,
    MICRO_BATCHES,
    RANKS,
    SweepConfig,
    extrapolate,
    sample_indices,
    sweep_configs,
)

N = 6


def test_sweep_is_fixed_and_spans_the_grid() -> None:
    configs = sweep_configs(24)
    assert configs == sweep_configs(24)
    assert {(c.rank, c.micro_batch) for c in configs} == {(r, m) for r in RANKS for m in MICRO_BATCHES}
    assert len({c.lr for c in configs}) == 24
    assert all(LR_RANGE[0] <= c.lr <= LR_RANGE[1] for c in configs)
    assert all(c.spec(5).alpha == 2 * c.rank and c.spec(5).dropout == 0.0 and len(c.spec(5).targets) == 7
               for c in configs)
    small = sweep_configs(N)
    assert {c.micro_batch for c in small} == set(MICRO_BATCHES) and {c.rank for c in small} == set(RANKS)
    assert [c.lr for c in small] == [configs[i].lr for i in sample_indices(24, N)]


def test_sample_indices_are_evenly_spaced() -> None:
    assert sample_indices(24, 8) == [0, 3, 6, 9, 12, 15, 18, 21]
    assert sample_indices(6, 0) == sample_indices(6, 9) == list(range(6))


def test_extrapolate_prefers_the_same_cell_then_the_same_micro_batch() -> None:
    configs = [SweepConfig(0, 8, 1, 1e-4), SweepConfig(1, 8, 1, 2e-4), SweepConfig(2, 16, 1, 1e-4),
               SweepConfig(3, 16, 2, 1e-4), SweepConfig(4, 32, 2, 1e-4)]
    seconds, how = extrapolate(configs[:3], {0: 2.0, 2: 4.0})
    assert seconds == {0: 2.0, 1: 2.0, 2: 4.0}
    assert how == {"measured": 2, "cell": 1, "micro_batch": 0, "all": 0}
    seconds, how = extrapolate(configs, {0: 2.0, 2: 4.0, 3: 10.0})
    assert seconds == {0: 2.0, 1: 2.0, 2: 4.0, 3: 10.0, 4: 10.0}
    assert how == {"measured": 3, "cell": 1, "micro_batch": 1, "all": 0}
    seconds, how = extrapolate(configs[3:], {3: 6.0})
    assert seconds[4] == 6.0 and how["cell"] == 0 and how["micro_batch"] == 1
    _, how = extrapolate(configs[:4], {0: 1.0})
    assert how == {"measured": 1, "cell": 1, "micro_batch": 1, "all": 1}
