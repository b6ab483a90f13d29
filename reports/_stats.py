"""Paired bootstrap of a mean difference, in numpy (reports may not import ``evaluators``).

The same resampling as ``evaluators.stats.paired_bootstrap``'s numpy path: draw item indices with
replacement (the same indices for both trials, since item i is the same example for every trial),
take the mean of the per-item differences, and read the percentile interval. A fixed seed makes the
interval in the report reproducible.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

__all__ = ["paired_bootstrap", "paired_scores"]


def paired_bootstrap(a: Sequence[float], b: Sequence[float], *, confidence: float = 0.95, n_resamples: int = 2000,
                     seed: int = 0) -> tuple[float, float, float]:
    """Mean of ``a - b`` over items with its percentile bootstrap interval.

    Args:
        a: per-item scores of one trial.
        b: the other trial's scores on the same items, same order.
        confidence: confidence level of the interval.
        n_resamples: bootstrap resamples.
        seed: resampling seed.

    Returns:
        (mean difference, low, high); low == high == mean with one item or identical differences.

    Raises:
        ValueError: different lengths or no items.
    """
    x, y = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    if x.shape != y.shape or x.ndim != 1 or x.size == 0:
        raise ValueError(f"need two equally long, non-empty lists of per-item values (got {x.shape} and {y.shape})")
    diff = x - y  # (n_items,)
    mean = float(diff.mean())
    if x.size == 1 or bool(np.all(diff == diff[0])):
        return mean, mean, mean
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, diff.size, size=(n_resamples, diff.size))  # (n_resamples, n_items)
    means = diff[idx].mean(axis=1)  # (n_resamples,)
    tail = (1 - confidence) / 2 * 100
    low, high = np.percentile(means, [tail, 100 - tail])
    return mean, float(low), float(high)


def paired_scores(a: dict[int, float | None], b: dict[int, float | None]) -> tuple[list[float], list[float]]:
    """The scores of the items both trials have a finite score for, aligned by item index."""
    keys = sorted(k for k in a.keys() & b.keys() if _finite(a[k]) and _finite(b[k]))
    return [float(a[k]) for k in keys], [float(b[k]) for k in keys]  # type: ignore[arg-type]


def _finite(v: float | None) -> bool:
    return v is not None and math.isfinite(v)
