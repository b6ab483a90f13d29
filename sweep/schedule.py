"""The expected schedule of one pack under cohort successive halving: what ``sweep plan`` times.

A pack trains ``slots`` trials in lock step; a slot freed by a trial that finishes or is pruned takes the next asked
trial at the next step (backfill) until the trial budget is asked, and the pack ends when its last trial ends. At a
rung every trial reaching it is ranked by ``sweep.pruning.CohortSHA`` against every trial that reached it before, and
only the best ``ceil(n / reduction_factor)`` go on. How many trials reach each rung, and so how many pack steps the
budget takes, depends on the order of arrivals and on the cumulative cohorts, which no closed form follows: the
schedule is played out with the real ``CohortSHA`` on random proxy values (each trial equally likely to be any rank,
as before the sampler has learned anything), ``runs`` times with fixed seeds, and averaged. The community default and
the config baseline (the first ``spared`` trials) are ranked but never pruned, as in ``sweep.study``.

``eval_seconds`` times the evaluations such a schedule runs (``sweep plan``'s evaluation row).
"""

from __future__ import annotations

import math
import random
import statistics
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from lora_sweep.evaluators.registry import EvalCost, curve_entry, plan_cost
from lora_sweep.sweep.pruning import CohortSHA

if TYPE_CHECKING:
    from lora_sweep.packer.api import MemoryModel
    from lora_sweep.sweep.config.spec import StudySpec

__all__ = ["Schedule", "expected_schedule", "eval_rows", "eval_seconds"]


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
    reached = {r: statistics.fmean(p[1][i] for p in played) for i, r in enumerate(live_rungs)}

    def mean(key: str) -> float:
        return statistics.fmean(p[0][key] for p in played)

    return Schedule(pack_steps=mean("pack_steps"), reached=tuple(reached.get(r, 0.0) for r in rungs),
                    finished=mean("finished"), rung_events=mean("rung_events"), final_events=mean("final_events"),
                    trial_steps=mean("trial_steps"), curve_events=mean("curve_events"),
                    curve_evals=mean("curve_evals"))


def _play(trials: int, slots: int, max_steps: int, rungs: tuple[int, ...], eta: int, spared: int,
          every: int | None, rng: random.Random) -> tuple[Counter[str], list[int]]:
    """One pack, event to event (all live trials advance together to the nearest rung, eval_every step or end among
    them): its tallies by ``Schedule`` field, and the trials reaching each rung."""
    sha = CohortSHA(rungs, eta, "minimize")
    run: Counter[str] = Counter()
    reached = [0] * len(rungs)
    live: dict[int, int] = {}  # trial -> its steps so far
    asked = 0
    while True:
        while len(live) < slots and asked < trials:  # backfill the free slots at this step
            live[asked] = 0
            asked += 1
        if not live:
            return run, reached
        dt = min(_next_stop(s, rungs, max_steps, every) - s for s in live.values())
        run["pack_steps"] += dt
        run["trial_steps"] += dt * len(live)
        for t in live:
            live[t] += dt
        curve = sum(1 for s in live.values() if every and s % every == 0)
        run["curve_events"] += curve > 0
        run["curve_evals"] += curve
        done = [t for t, s in live.items() if s >= max_steps]
        arrivals = {t: s for t, s in live.items() if s in rungs}
        if done:
            run["final_events"] += 1
            run["finished"] += len(done)
            for t in done:
                del live[t]
        if arrivals:
            run["rung_events"] += 1
            for i, rung in enumerate(rungs):
                values = {t: rng.random() for t, s in arrivals.items() if s == rung}
                reached[i] += len(values)
                for d in sha.decide(rung, values) if values else ():
                    if not d.keep and d.trial >= spared:
                        del live[d.trial]


def _next_stop(steps: int, rungs: tuple[int, ...], max_steps: int, every: int | None) -> int:
    """The next step after ``steps`` at which a trial is scored or ends: a rung, a multiple of ``every``, its end."""
    stops = [r for r in rungs if r > steps] + [max_steps]
    if every:
        stops.append((steps // every + 1) * every)
    return min(stops)


def eval_rows(spec: StudySpec) -> int:
    """Rows of the held-out file (0 without one)."""
    if spec.data.eval is None:
        return 0
    with open(spec.data.eval, encoding="utf-8-sig") as f:
        return sum(1 for line in f if line.strip())


def eval_seconds(spec: StudySpec, mm: MemoryModel, forward_s: float, schedule: Schedule, rows: int,
                 row_len: float, measured: Mapping[str, float] | None = None,
                 measured_slots: int = 0, once: Mapping[str, float] | None = None) -> tuple[float, str]:
    """Seconds the evaluators take over the pack's ``schedule``, and what they count (a line for the plan).

    Each entry's evaluator declares what it costs (``Evaluator.cost``: rows of a slot per batch, forwards per batch,
    tokens a row grows by; ``evaluators.registry.plan_cost``); one that declares nothing is named, not timed. The
    trials that finish at one step are scored together, as are those reaching a rung at one step and those at a
    ``train.eval_every`` step, both on the cost of the entry that scores the learning curve (``curve_entry``: a
    held-out loss). A forward of n tokens costs ``forward_s`` (the base's forward of one short row: launches, Python)
    plus a third of ``mm``'s per-token step time for n (no backward). ``measured``: per evaluator, the seconds one
    batch of its rows took for ``measured_slots`` slots of the sized pack (``sweep.pack_step``): that evaluator's
    estimate is scaled by the measured batch over the same batch as estimated (its fixed and per-token parts alike).
    ``once``: per evaluator, the seconds its first call adds (measured there too): added once for each that runs.
    """
    if not rows:
        return 0.0, "no held-out data"
    per_token = mm.seconds_per_token / 3

    def passes(events: float, scored: float, cost: EvalCost, batches: int | None = None) -> float:
        """``events`` evaluations of ``scored`` slots in all, each ``cost`` per batch of a slot's rows."""
        batches = math.ceil(rows / cost.batch_size) if batches is None else batches
        return batches * (events * cost.forwards * forward_s
                          + scored * cost.batch_size * (row_len + cost.new_tokens) * per_token)

    scales: dict[str, float] = {}

    firsts: dict[str, float] = {}

    def scaled(name: str, cost: EvalCost, seconds: float) -> float:
        """``seconds`` of evaluator ``name`` through its measured batch, where one was measured (and its first
        call's extra, once)."""
        if not measured or name not in measured or measured_slots < 1 or seconds <= 0:
            return seconds
        scales[name] = measured[name] / max(passes(1, measured_slots, cost, batches=1), 1e-9)
        first = 0.0 if name in firsts else (once or {}).get(name, 0.0)
        firsts[name] = firsts.get(name, 0.0) + first
        return seconds * scales[name] + first

    total, parts, untimed = 0.0, [], []
    for e in spec.evaluators:
        cost = plan_cost(e.name, e.options)
        if cost is None:
            untimed.append(e.name)
            continue
        total += scaled(e.name, cost, passes(schedule.final_events, schedule.finished, cost))
        parts.append(cost.what.format(rows=rows))
    (curve_name, curve_options), _ = curve_entry((e.name, e.options) for e in spec.evaluators)
    curve_cost = plan_cost(curve_name, curve_options)
    rung_evals = sum(schedule.reached)
    if curve_cost is not None:
        total += scaled(curve_name, curve_cost, passes(schedule.rung_events + schedule.curve_events,
                                                       rung_evals + schedule.curve_evals, curve_cost))
    text = (f"{total:.0f} s: {', '.join(parts) or 'nothing timed'} for each of {schedule.finished:.0f} finished "
            f"trials")
    text += f", {rung_evals:.0f} rung evaluations" if rung_evals else ""
    text += f", {schedule.curve_evals:.0f} eval_every evaluations" if schedule.curve_evals else ""
    if scales:
        text += "; scaled by a batch of each scored on the sized pack (" + ", ".join(
            f"{name} x{x:.2f}" + (f" and {firsts[name]:.1f} s once" if firsts.get(name) else "")
            for name, x in scales.items()) + ")"
    return total, text + (f"; not timed: {', '.join(untimed)}" if untimed else "")
