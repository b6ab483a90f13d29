"""The time a run has left, from its steps: what the live progress shows as ETA from the first packed step.

A sweep's trials rarely finish before its end (a pack trains them side by side), so a pace of finished trials says
nothing for most of a run. Steps do: the budget's trials each train ``max_steps`` optimizer steps, fewer where
cohort successive halving stops them at a rung, and the pack trains ``capacity`` of them per packed step. The
packed steps left, at the run's seconds per packed step so far (evaluations and saves included), is the ETA.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["expected_steps", "steps_left", "pack_steps_left"]


def _segments(max_steps: int, rungs: Sequence[int]) -> list[tuple[int, int]]:
    """(start, end) step spans between the rungs below ``max_steps``, the last ending at ``max_steps``."""
    cuts = [r for r in sorted(rungs) if 0 < r < max_steps]
    bounds = [0, *cuts, max_steps]
    return list(zip(bounds, bounds[1:], strict=False))


def steps_left(done: int, max_steps: int, rungs: Sequence[int] = (), reduction_factor: int = 1) -> float:
    """The expected optimizer steps a trial at step ``done`` still trains: to its next rung surely, past each later
    rung with the chance ``1 / reduction_factor`` that the rung keeps it (cohort SHA keeps 1 of every
    ``reduction_factor`` trials of its cohort). ``rungs`` empty or ``reduction_factor`` 1: ``max_steps - done``."""
    left, keep = 0.0, 1.0
    for start, end in _segments(max_steps, rungs):
        if end <= done:
            continue
        left += keep * (end - max(start, done))
        keep /= max(1, reduction_factor)
    return left


def expected_steps(max_steps: int, rungs: Sequence[int] = (), reduction_factor: int = 1) -> float:
    """The expected optimizer steps of one trial not yet started (``steps_left`` from step 0)."""
    return steps_left(0, max_steps, rungs, reduction_factor)


def pack_steps_left(live_left: Sequence[float], waiting: int, per_trial: float, capacity: int) -> float:
    """The packed steps left: the live trials' expected steps plus ``waiting`` trials of ``per_trial`` steps each,
    ``capacity`` trained per packed step, and never fewer than the longest live trial still needs."""
    total = sum(live_left) + max(0, waiting) * per_trial
    return max(total / max(1, capacity), max(live_left, default=0.0))
