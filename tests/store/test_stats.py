"""store/stats.py: the one paired bootstrap (status and report), against intervals computed by hand."""

from __future__ import annotations

import numpy as np
import pytest

from lora_sweep.store.stats import paired_bootstrap, paired_scores


def test_interval_of_a_hand_computed_resampling_distribution() -> None:
    # Differences [0, 0, 3]: a resample of 3 items holds k copies of the 3, k ~ Binomial(3, 1/3), so its
    # mean is k with P = 8/27, 12/27, 6/27, 1/27 for k = 0..3. Cumulative: 0.296, 0.741, 0.963, 1.
    # 95% interval: the 2.5th percentile is 0 and the 97.5th is 3 (0.963 < 0.975);
    # 90% interval: the 95th percentile is already 2 (0.963 > 0.95).
    a, b = [1.0, 2.0, 5.0], [1.0, 2.0, 2.0]
    assert paired_bootstrap(a, b, n_resamples=20_000, seed=0) == pytest.approx((1.0, 0.0, 3.0))
    assert paired_bootstrap(a, b, confidence=0.9, n_resamples=20_000, seed=0) == pytest.approx((1.0, 0.0, 2.0))


def test_pairing_cancels_what_both_trials_share() -> None:
    # b varies a lot from item to item; a is b plus 0.5 everywhere: paired, the difference is exactly 0.5
    # (an unpaired interval would be as wide as b's spread)
    b = np.random.default_rng(0).normal(scale=10.0, size=50)
    assert paired_bootstrap(b + 0.5, b) == pytest.approx((0.5, 0.5, 0.5))
    # one item has no spread to resample either
    assert paired_bootstrap([1.0], [0.25]) == (0.75, 0.75, 0.75)


def test_fixed_seed_reproduces_and_the_interval_covers_the_mean() -> None:
    rng = np.random.default_rng(0)
    b = rng.integers(0, 2, 200).astype(float)
    a = np.where(rng.random(200) < 0.2, 1.0, b)  # a = b, plus ~20% extra items right
    mean, low, high = paired_bootstrap(a, b, seed=1)
    assert mean == pytest.approx((a - b).mean())
    assert 0 < low < mean < high
    assert paired_bootstrap(a, b, seed=1) == (mean, low, high)


def test_bad_inputs_are_refused() -> None:
    with pytest.raises(ValueError, match="equally long"):
        paired_bootstrap([1.0, 0.0], [1.0])
    with pytest.raises(ValueError, match="equally long"):
        paired_bootstrap([], [])
    with pytest.raises(ValueError, match="confidence"):
        paired_bootstrap([1.0, 0.0], [0.0, 0.0], confidence=1.0)


def test_paired_scores_keeps_the_items_both_scored_finitely() -> None:
    a = {0: 1.0, 1: None, 2: 3.0, 3: float("nan"), 5: 6.0}
    b = {0: 0.5, 1: 2.0, 2: 1.0, 3: 1.0, 4: 9.0}
    assert paired_scores(a, b) == ([1.0, 3.0], [0.5, 1.0])
