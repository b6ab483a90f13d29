"""The steps a run has left (``sweep.eta``): cohort SHA's expected steps, and the packed steps they make."""

from __future__ import annotations

import pytest

from lora_sweep.sweep.eta import expected_steps, pack_steps_left, steps_left


def test_a_trial_trains_to_its_first_rung_and_past_each_rung_with_the_chance_it_is_kept() -> None:
    assert expected_steps(120) == 120  # no pruning: every step
    assert expected_steps(120, [60], 3) == pytest.approx(60 + 60 / 3)  # the demo: 1 in 3 goes on past step 60
    assert expected_steps(100, [20, 50], 2) == pytest.approx(20 + 30 / 2 + 50 / 4)
    assert expected_steps(50, [50, 80], 3) == 50  # a rung at or past max_steps prunes nothing
    assert steps_left(30, 120, [60], 3) == pytest.approx(30 + 60 / 3)  # still before the rung
    assert steps_left(70, 120, [60], 3) == 50  # kept at the rung: it trains to its end
    assert steps_left(120, 120, [60], 3) == 0


def test_packed_steps_left_share_the_trials_steps_over_the_slots_but_wait_for_the_longest() -> None:
    assert pack_steps_left([10, 20], 4, 30, capacity=2) == pytest.approx((10 + 20 + 4 * 30) / 2)
    assert pack_steps_left([50, 1], 0, 30, capacity=8) == 50  # the tail: one long trial left
    assert pack_steps_left([], 0, 30, capacity=8) == 0
