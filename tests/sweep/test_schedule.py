"""The pack's expected schedule under cohort SHA (``sweep.schedule``): what ``sweep plan`` counts its steps from."""

from __future__ import annotations

import math

import pytest

from lora_sweep.sweep.schedule import expected_schedule


def test_without_pruning_the_pack_trains_in_waves_and_its_last_wave_may_be_partial() -> None:
    s = expected_schedule(10, 4, 5)  # 4 + 4 + 2 trials: three waves of 5 steps, the last with two slots idle
    assert (s.pack_steps, s.finished, s.final_events, s.trial_steps, s.rung_events) == (15, 10, 3, 50, 0)
    assert s.reached == ()
    assert s.pack_steps > math.ceil(10 * 5 / 4), "the trial-steps over the slots (13) miss the partial last wave"


def test_one_full_cohort_keeps_ceil_n_over_the_reduction_factor_and_nothing_backfills() -> None:
    s = expected_schedule(9, 9, 30, (10,), 3)  # one wave: 9 reach step 10 together, 3 go on, no trial left to ask
    assert (s.reached, s.finished, s.pack_steps) == ((9,), 3, 30)
    assert s.trial_steps == 9 * 10 + 3 * 20
    assert (s.rung_events, s.final_events) == (1, 1)


def test_a_pruned_slot_takes_the_next_trial_at_once() -> None:
    # 4 slots, 8 trials, rung at 5 keeping 1/2: at step 5 two of the first four stop and two new trials start; at 10
    # the survivors finish and the newcomers meet the rung, ranked against all six seen there (keep 3 of 6).
    s = expected_schedule(8, 4, 10, (5,), 2, runs=64)
    assert s.reached == (8,), "every trial meets the rung below its last step"
    assert s.pack_steps < 8 * 10 / 4, "pruning shortens the budget"
    # each trial finishes or stops at the rung: (finished) x 10 + (8 - finished) x 5 steps
    assert s.trial_steps == pytest.approx(10 * s.finished + 5 * (8 - s.finished))
    # cohorts are cumulative: at least ceil(n/2) of the first four (2), at most all the rest, survive
    assert 2 + 1 <= s.finished <= 2 + 4 and s.finished < 8


def test_the_community_default_and_the_baseline_are_never_pruned() -> None:
    spared = expected_schedule(4, 4, 10, (5,), 2, spared=4)
    assert (spared.finished, spared.reached, spared.rung_events) == (4, (4,), 1)
    assert expected_schedule(4, 4, 10, (5,), 2, spared=0).finished == 2


def test_a_rung_at_or_past_the_last_step_is_never_evaluated() -> None:
    import dataclasses

    late = expected_schedule(6, 3, 10, (10, 12), 3)
    assert late.reached == (0, 0)
    assert dataclasses.replace(late, reached=()) == expected_schedule(6, 3, 10)


def test_later_rungs_see_fewer_trials_and_the_mean_is_reproducible() -> None:
    s = expected_schedule(40, 8, 120, (30, 60), 3, spared=1)
    assert s.reached[0] == 40 and s.reached[1] < s.reached[0] / 2 and s.finished < s.reached[1]
    assert s == expected_schedule(40, 8, 120, (30, 60), 3, spared=1), "seeded: the same plan twice"
    assert s.pack_steps < expected_schedule(40, 8, 120).pack_steps


def test_eval_every_counts_each_trials_multiples_and_the_steps_they_share() -> None:
    s = expected_schedule(4, 2, 8, eval_every=4)  # two waves of two trials: steps 4 and 8 of each
    assert (s.curve_evals, s.curve_events) == (8, 4)
