"""The expected schedule of one pack under cohort successive halving: what ``sweep plan`` times.

A pack trains ``slots`` trials in lock step; a slot freed by a trial that finishes or is pruned takes the next asked
trial at the next step (backfill) until the trial budget is asked, and the pack ends when its last trial ends. At a
rung every trial reaching it is ranked by ``sweep.pruning.CohortSHA`` against every trial that reached it before, and
only the best ``ceil(n / reduction_factor)`` go on. How many trials reach each rung, and so how many pack steps the
budget takes, depends on the order of arrivals and on the cumulative cohorts, which no closed form follows: the
schedule is played out with the real ``CohortSHA`` on random proxy values (each trial equally likely to be any rank,
as before the sampler has learned anything), ``runs`` times with fixed seeds, and averaged. The community default and
the config baseline (the first ``spared`` trials) are ranked but never pruned, as in ``sweep.study``.
"""

from __future__ import annotations

import random
import statistics
from dataclasses import dataclass, field

from lora_sweep.sweep.pruning import CohortSHA

__all__ = ["Schedule", "expected_schedule"]


@dataclass(frozen=True)
class Schedule:
    """The mean over the played-out runs; steps are optimizer steps (times the accumulation: micro-steps)."""

    pack_steps: float
    """Steps from the pack's first to its last trial's end."""
    reached: tuple[float, ...]
    """Trials reaching each rung (those below ``max_steps``), in rung order."""
    finished: float
    """Trials training to their last step (scored by every evaluator)."""
    rung_events: float
    """Rung evaluations: steps at which at least one trial reaches a rung (its arrivals are scored together)."""
    final_events: float
    """Final evaluations: steps at which at least one trial finishes (those finishing together are scored together)."""
    trial_steps: float = 0.0
    """Steps trained, summed over the trials."""
    curve_events: float = 0.0
    """``train.eval_every`` evaluations: steps at which at least one trial's step is a multiple of it."""
    curve_evals: float = 0.0
    """Trials scored at those steps, summed."""


@dataclass
class _Run:
    pack_steps: int = 0
    reached: list[int] = field(default_factory=list)
    finished: int = 0
    rung_events: int = 0
    final_events: int = 0
    trial_steps: int = 0
    curve_events: int = 0
    curve_evals: int = 0


def expected_schedule(trials: int, slots: int, max_steps: int, rungs: tuple[int, ...] = (), reduction_factor: int = 3,
                      *, spared: int = 0, eval_every: int | None = None, runs: int = 32,
                      seed: int = 0) -> Schedule:
    """Play the pack out ``runs`` times (seeds ``seed``, ``seed + 1``, ...) and average.

    Args:
        trials: the trial budget (every trial is asked; none fails).
        slots: slots of the pack.
        max_steps: optimizer steps of a trial that is never pruned.
        rungs: cohort SHA's rung steps; () for no pruning (then the result is exact, not a mean).
        reduction_factor: cohort SHA keeps ``ceil(n / reduction_factor)`` of ``n``.
        spared: the first trials, ranked but never pruned (the community default, the config baseline).
        eval_every: ``train.eval_every`` (a held-out loss every that many steps of a trial), or None.
    """
    live_rungs = tuple(r for r in rungs if r < max_steps)  # a rung at the last step is never evaluated
    if not live_rungs:
        runs = 1  # nothing random
    played = [_play(trials, slots, max_steps, live_rungs, reduction_factor, spared, eval_every,
                    random.Random(seed + i)) for i in range(runs)]
    reached = {r: statistics.fmean(p.reached[i] for p in played) for i, r in enumerate(live_rungs)}
    return Schedule(pack_steps=statistics.fmean(p.pack_steps for p in played),
                    reached=tuple(reached.get(r, 0.0) for r in rungs),
                    finished=statistics.fmean(p.finished for p in played),
                    rung_events=statistics.fmean(p.rung_events for p in played),
                    final_events=statistics.fmean(p.final_events for p in played),
                    trial_steps=statistics.fmean(p.trial_steps for p in played),
                    curve_events=statistics.fmean(p.curve_events for p in played),
                    curve_evals=statistics.fmean(p.curve_evals for p in played))


def _play(trials: int, slots: int, max_steps: int, rungs: tuple[int, ...], eta: int, spared: int,
          every: int | None, rng: random.Random) -> _Run:
    """One pack, event to event: all live trials advance together to the nearest rung or end among them."""
    sha = CohortSHA(rungs, eta, "minimize")
    run = _Run(reached=[0] * len(rungs))
    live: dict[int, int] = {}  # trial -> its steps so far
    asked = 0
    while True:
        while len(live) < slots and asked < trials:  # backfill the free slots at this step
            live[asked] = 0
            asked += 1
        if not live:
            return run
        dt = min(_next_stop(s, rungs, max_steps, every) - s for s in live.values())
        run.pack_steps += dt
        run.trial_steps += dt * len(live)
        for t in live:
            live[t] += dt
        curve = sum(1 for s in live.values() if every and s % every == 0)
        run.curve_events += curve > 0
        run.curve_evals += curve
        done = [t for t, s in live.items() if s >= max_steps]
        arrivals = {t: s for t, s in live.items() if s in rungs}
        if done:
            run.final_events += 1
            run.finished += len(done)
            for t in done:
                del live[t]
        if arrivals:
            run.rung_events += 1
            for i, rung in enumerate(rungs):
                values = {t: rng.random() for t, s in arrivals.items() if s == rung}
                run.reached[i] += len(values)
                for d in sha.decide(rung, values) if values else ():
                    if not d.keep and d.trial >= spared:
                        del live[d.trial]


def _next_stop(steps: int, rungs: tuple[int, ...], max_steps: int, every: int | None) -> int:
    """The next step after ``steps`` at which a trial is scored or ends: a rung, a multiple of ``every``, its end."""
    stops = [r for r in rungs if r > steps] + [max_steps]
    if every:
        stops.append((steps // every + 1) * every)
    return min(stops)
