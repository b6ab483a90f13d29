"""Paired statistics: every adapter is scored on the same items, so compare them item by item.

``paired_bootstrap`` resamples items (the same indices for both adapters) and returns the mean difference
with a percentile confidence interval; ``scipy.stats.bootstrap(paired=True)`` when scipy is installed, the
same resampling in numpy otherwise. A fixed seed makes the interval reproducible.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["paired_bootstrap"]


def paired_bootstrap(a: Sequence[float], b: Sequence[float], *, confidence: float = 0.95, n_resamples: int = 2000,
                     seed: int = 0) -> tuple[float, float, float]:
    """Mean of ``a - b`` over items and its bootstrap confidence interval.

    Args:
        a: per-item values of one trial (``EvalResult.per_item[slot][metric]``).
        b: the other trial's values on the same items, same order (the best or the default trial).
        confidence: confidence level of the interval.
        n_resamples: bootstrap resamples.
        seed: resampling seed.

    Returns:
        (mean difference, low, high). With one item, or identical differences, low == high == mean.

    Raises:
        ValueError: different lengths, no items, or a confidence outside (0, 1).
    """
    x, y = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    if x.shape != y.shape or x.ndim != 1 or x.size == 0:
        raise ValueError(f"need two equally long, non-empty lists of per-item values (got {x.shape} and {y.shape})")
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    diff = x - y
    mean = float(diff.mean())
    if x.size == 1 or np.all(diff == diff[0]):
        return mean, mean, mean
    try:
        from scipy.stats import bootstrap
    except ImportError:
        return (mean, *_numpy_interval(diff, confidence, n_resamples, seed))
    kwargs = dict(paired=True, vectorized=True, n_resamples=n_resamples, confidence_level=confidence,
                  method="percentile")
    try:
        res = bootstrap((x, y), _mean_diff, rng=np.random.default_rng(seed), **kwargs)
    except TypeError:  # scipy < 1.15 names the generator random_state
        res = bootstrap((x, y), _mean_diff, random_state=np.random.default_rng(seed), **kwargs)
    return mean, float(res.confidence_interval.low), float(res.confidence_interval.high)


def _mean_diff(u: np.ndarray, v: np.ndarray, axis: int) -> np.ndarray:
    return np.mean(u - v, axis=axis)


def _numpy_interval(diff: np.ndarray, confidence: float, n_resamples: int, seed: int) -> tuple[float, float]:
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, diff.size, size=(n_resamples, diff.size))  # (n_resamples, n_items)
    means = diff[idx].mean(axis=1)
    tail = (1 - confidence) / 2 * 100
    low, high = np.percentile(means, [tail, 100 - tail])
    return float(low), float(high)
