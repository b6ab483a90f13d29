"""The paired bootstrap: compare two trials item by item (the same item index is the same example for
every trial, ``items`` table), for the status and the report alike.

``scipy.stats.bootstrap(paired=True)`` resamples the items (the same indices for both trials) and
reads the percentile interval of the mean difference; a fixed seed makes the interval reproducible.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np

__all__ = ["paired_bootstrap", "paired_scores"]


def paired_bootstrap(a: Sequence[float], b: Sequence[float], *, confidence: float = 0.95, n_resamples: int = 2000,
                     seed: int = 0) -> tuple[float, float, float]:
    """Mean of ``a - b`` over items and its percentile bootstrap interval.

    Args:
        a: per-item scores of one trial, shape (n_items,).
        b: the other trial's scores on the same items, same order, shape (n_items,).
        confidence: confidence level of the interval.
        n_resamples: bootstrap resamples.
        seed: resampling seed.

    Returns:
        (mean difference, low, high). With one item, or identical differences, low == high == mean
        (no resample can differ; scipy would warn of a degenerate distribution).

    Raises:
        ValueError: different lengths, no items, or a confidence outside (0, 1).
    """
    from scipy.stats import bootstrap  # imported here: ``import lora_sweep.store.api`` stays light

    x, y = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    if x.shape != y.shape or x.ndim != 1 or x.size == 0:
        raise ValueError(f"need two equally long, non-empty lists of per-item values (got {x.shape} and {y.shape})")
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    diff = x - y  # (n_items,)
    mean = float(diff.mean())
    if x.size == 1 or bool(np.all(diff == diff[0])):
        return mean, mean, mean
    res = bootstrap((x, y), _mean_diff, paired=True, vectorized=True, n_resamples=n_resamples,
                    confidence_level=confidence, method="percentile", rng=np.random.default_rng(seed))
    return mean, float(res.confidence_interval.low), float(res.confidence_interval.high)


def _mean_diff(u: np.ndarray, v: np.ndarray, axis: int) -> np.ndarray:
    return np.mean(u - v, axis=axis)


def paired_scores(a: Mapping[int, float | None], b: Mapping[int, float | None]) -> tuple[list[float], list[float]]:
    """The scores of the items both trials have a finite score for, aligned by item index."""
    keys = sorted(k for k in a.keys() & b.keys() if _finite(a[k]) and _finite(b[k]))
    return [float(a[k]) for k in keys], [float(b[k]) for k in keys]  # type: ignore[arg-type]


def _finite(v: float | None) -> bool:
    return v is not None and math.isfinite(v)
