"""Step lengths: the padded lengths a pack's training step may take, chosen from the data, at most a few.

A step's tokens are C slots x ``rows`` rows x one padded length L, and every distinct (rows, L) is one shape: its
own staging buffers and, on CUDA, its own captured graph with its own share of the graphs' memory pool. Padding
each step to a multiple of 16 keeps the padding small, but a dataset whose rows spread up to ``max_length`` tokens
then gives up to ``max_length / 16`` shapes (32 at 512 tokens, 128 at 2,048), each a graph whose activations the
pool holds. ``length_buckets`` bounds that number by design: at most ``max_buckets`` lengths, placed where the
steps' longest rows fall, so that the extra padding they cost is the least any such choice costs.

The choice is made once per pack from the training rows, before the first step: a step's longest row is the
longest of ``rows`` rows drawn from the data, so its distribution is simulated (a fixed seed: the same data gives
the same lengths) and the lengths that minimise the mean padded length of a step over that sample are found by
dynamic programming over the candidate multiples of ``multiple``. The longest row of the data always fits the
last length, so no step needs a shape outside the set.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["MAX_BUCKETS", "SAMPLES", "length_buckets", "padded_length"]

MAX_BUCKETS = 8
"""At most this many step lengths per pack (issue "The sizes users sweep": graphs bounded by design)."""
SAMPLES = 512
"""Simulated steps whose longest row the lengths are fitted to."""


def padded_length(longest: int, multiple: int, lengths: Sequence[int] | None = None) -> int:
    """The length a step whose longest row has ``longest`` tokens is padded to: the smallest of ``lengths``
    (ascending) that holds it, or ``longest`` rounded up to a multiple of ``multiple`` (no ``lengths``, or a row
    longer than the last of them)."""
    if lengths:
        i = int(np.searchsorted(np.asarray(lengths), longest))
        if i < len(lengths):
            return int(lengths[i])
    return -(-longest // multiple) * multiple


def length_buckets(row_lengths: Sequence[int], rows_per_step: int, *, multiple: int = 16,
                   max_buckets: int = MAX_BUCKETS, seed: int = 0) -> tuple[int, ...]:
    """At most ``max_buckets`` padded step lengths (ascending multiples of ``multiple``) for a pack whose steps
    hold ``rows_per_step`` rows drawn from rows of ``row_lengths`` tokens, the last holding the longest row.

    Chosen to minimise the mean padded length of a step (the positions it computes per row) over ``SAMPLES``
    simulated steps: each step's longest of ``rows_per_step`` rows drawn with replacement, rounded up to
    ``multiple``; then an exact dynamic programme over those rounded values picks the lengths.
    """
    if not row_lengths:
        raise ValueError("length_buckets: no rows")
    if rows_per_step < 1 or max_buckets < 1 or multiple < 1:
        raise ValueError("length_buckets: rows_per_step, max_buckets and multiple must be >= 1")
    lengths = np.asarray(row_lengths, dtype=np.int64)
    top = padded_length(int(lengths.max()), multiple)
    draws = np.random.default_rng(seed).integers(0, len(lengths), size=(SAMPLES, rows_per_step))
    longest = -(-lengths[draws].max(axis=1) // multiple) * multiple  # (SAMPLES,) each step's rounded longest row
    values, counts = np.unique(np.append(longest, top), return_counts=True)
    counts[-1] -= 1  # ``top`` is a candidate that must be chosen, not a sampled step
    if len(values) <= max_buckets:
        return tuple(int(v) for v in values)
    return tuple(int(values[j]) for j in _fewest_positions(values, counts, max_buckets))


def _fewest_positions(values: np.ndarray, counts: np.ndarray, k: int) -> list[int]:
    """Indices of at most ``k`` of ``values`` (ascending, the last always among them) that minimise
    sum_i counts[i] * (the smallest chosen value >= values[i]): a step pads to the next chosen length.

    dp[b][j]: the least cost of covering values[0..j] with b lengths, the highest at j. O(k n^2), n <= a few
    hundred (max_length / multiple)."""
    n = len(values)
    cum = np.concatenate(([0], np.cumsum(counts)))  # cum[j + 1] = steps at values[0..j]
    inf = float("inf")
    dp = np.full((k + 1, n), inf)
    back = np.zeros((k + 1, n), dtype=np.int64)
    dp[1] = cum[1:] * values  # one length at j covers everything up to j
    back[1] = -1
    for b in range(2, k + 1):
        for j in range(n):
            # the previous length at i < j; values (i, j] pad to values[j]
            if j == 0:
                continue
            i = np.arange(j)
            cost = dp[b - 1, :j] + (cum[j + 1] - cum[i + 1]) * values[j]
            best = int(np.argmin(cost))
            dp[b, j], back[b, j] = cost[best], best
    b = int(np.argmin(dp[1:, n - 1])) + 1  # fewer lengths when more would not pad less
    chosen, j = [], n - 1
    while j >= 0 and b >= 1:
        chosen.append(j)
        j, b = int(back[b, j]), b - 1
    return sorted(chosen)
