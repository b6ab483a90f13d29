"""W3's fixed sweep (``benchmarks.gpu_makespan``): its configurations, the evenly spaced sample of them a mode may
time, and the estimate of the others from the measured ones most like them. Pure Python: no GPU, no model."""

from __future__ import annotations

import math
import random
import statistics
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from lora_sweep.benchmarks.shapes import PROJ
from lora_sweep.packer.plan import AdapterSpec

__all__ = ["RANKS", "MICRO_BATCHES", "LR_RANGE", "SweepConfig", "sweep_configs", "sample_indices", "extrapolate"]

RANKS = (8, 16, 32, 64)
MICRO_BATCHES = (1, 2)
LR_RANGE = (2e-5, 4e-4)


@dataclass(frozen=True)
class SweepConfig:
    """One configuration of the sweep; ``index`` seeds its adapter init and its data."""

    index: int
    rank: int
    micro_batch: int
    lr: float

    def spec(self, steps: int) -> AdapterSpec:
        return AdapterSpec(rank=self.rank, alpha=2.0 * self.rank, dropout=0.0, targets=PROJ, lr=self.lr,
                           micro_batch=self.micro_batch, max_steps=steps, seed=self.index)

    def token_ids(self, seq: int, vocab: int) -> torch.Tensor:
        """(micro_batch, seq) random token ids, the same in every process (a generator of its own)."""
        gen = torch.Generator().manual_seed(10_000 + self.index)
        return torch.randint(0, vocab, (self.micro_batch, seq), generator=gen)


def sweep_configs(n: int = 24, seed: int = 0) -> list[SweepConfig]:
    """The fixed sweep: ``n`` configurations evenly spaced over ranks x micro-batches x learning rates.

    The grid has ``max(3, ceil(n / 8))`` learning rates per (rank, micro-batch) cell, drawn log-uniform
    from a ``random.Random(seed)``, so ``n = 24`` is the whole 4 x 2 x 3 grid and a smaller ``n``
    still spans every rank and both micro-batches.
    """
    rng = random.Random(seed)
    per_cell = max(3, math.ceil(n / (len(RANKS) * len(MICRO_BATCHES))))
    lo, hi = (math.log(x) for x in LR_RANGE)
    grid = [(r, mb, math.exp(rng.uniform(lo, hi))) for r in RANKS for mb in MICRO_BATCHES for _ in range(per_cell)]
    return [SweepConfig(i, *grid[j]) for i, j in enumerate(sample_indices(len(grid), n))]


def sample_indices(n: int, k: int) -> list[int]:
    """``k`` evenly spaced indices of ``range(n)`` starting at 0 (all of them when ``k`` is 0 or >= n)."""
    if k <= 0 or k >= n:
        return list(range(n))
    return [i * n // k for i in range(k)]


def extrapolate(configs: Sequence[SweepConfig], measured: dict[int, float]) -> tuple[dict[int, float], dict[str, int]]:
    """Seconds of every configuration: measured, else the mean of the measured ones most like it.

    Args:
        configs: the whole sweep.
        measured: config index -> measured seconds (at least one).

    Returns:
        Config index -> seconds, and how many were ``measured`` or estimated from the same ``cell``
        (rank, micro-batch), the same ``micro_batch``, or ``all`` measured configurations.
    """
    def keys(c: SweepConfig) -> tuple[tuple, ...]:  # most alike first
        return ("cell", c.rank, c.micro_batch), ("micro_batch", c.micro_batch), ("all",)

    groups: dict[tuple, list[float]] = defaultdict(list)
    for c in configs:
        for key in keys(c) if c.index in measured else ():
            groups[key].append(measured[c.index])
    seconds, how = {}, {"measured": 0, "cell": 0, "micro_batch": 0, "all": 0}
    for c in configs:
        key = ("measured",) if c.index in measured else next(k for k in keys(c) if k in groups)
        seconds[c.index] = measured[c.index] if c.index in measured else statistics.mean(groups[key])
        how[key[0]] += 1
    return seconds, how
