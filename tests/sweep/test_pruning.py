"""Cohort successive halving is deterministic and keeps the best 1/eta of everything seen at a rung."""

from __future__ import annotations

import itertools
import math

from lora_sweep.sweep.pruning import CohortSHA


def test_first_pack_keeps_best_third() -> None:
    sha = CohortSHA((10,), 3, "minimize")
    values = {0: 0.5, 1: 0.2, 2: 0.9, 3: 0.1, 4: 0.7, 5: 0.3, 6: 0.8, 7: 0.4}
    decisions = sha.decide(10, values)
    assert [d.trial for d in decisions if d.keep] == [1, 3, 5]  # ceil(8/3) = 3 best
    assert all(d.cohort_size == 8 and d.kept == 3 for d in decisions)
    assert "pruned at step 10: rank 8 of 8" in next(d.reason for d in decisions if d.trial == 2)


def test_decision_does_not_depend_on_arrival_order_within_a_step() -> None:
    values = {3: 1.0, 1: 2.0, 7: 0.5, 4: 2.0, 9: float("nan")}
    results = set()
    for perm in itertools.permutations(values.items()):
        sha = CohortSHA((5,), 2, "minimize")
        results.add(tuple((d.trial, d.keep, d.rank) for d in sha.decide(5, dict(perm))))
    assert len(results) == 1
    (only,) = results
    assert dict((t, k) for t, k, _ in only) == {7: True, 3: True, 1: True, 4: False, 9: False}  # NaN last, tie -> lower


def test_late_arrival_ranked_against_history_and_maximize() -> None:
    sha = CohortSHA((4, 8), 2, "maximize", history={4: {0: 0.9, 1: 0.1}})
    (late,) = sha.decide(4, {2: 0.5})
    assert late.keep and late.rank == 1 and late.kept == 2
    (worse,) = sha.decide(4, {3: 0.05})
    assert not worse.keep and worse.cohort_size == 4
    assert sha.seen[8] == {}
    assert not math.isnan(worse.value)
