"""What a run's storage spends on its trials, measured for ``sweep plan``: the ``storage`` phase of a run's split.

Each trial a run trains is asked of the study's sampler (Optuna's ``ask`` and the space's suggestions: TPE's cost
grows with the trials told before it), its row and slot span written to the results store (one commit), and told
with its values (its row, its span's end, Optuna's ``tell``). ``bookkeeping_seconds`` does that for the trial budget
on a scratch study directory made as a run makes its own (``ledger.open_study``: the study's sampler and objectives,
its community default enqueued; the directory's own journal storage), with random objective values, and times it
from the study's opening to its store's close. A budget above ``BOOKKEEPING_TRIALS`` is timed on that many, the
rest at the mean of the last half of them (the sampler's cost per trial as it stands then). The measurement is
cached beside the calibration (``sweep.calibration.cached_bookkeeping``), keyed by the space, the objectives, the
sampler, the trial count and Optuna's version.
"""

from __future__ import annotations

import dataclasses
import logging
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lora_sweep.sweep.calibration import cache_bookkeeping, cached_bookkeeping

if TYPE_CHECKING:
    from lora_sweep.sweep.config.spec import StudySpec

__all__ = ["BOOKKEEPING_TRIALS", "bookkeeping_seconds", "storage_seconds"]

BOOKKEEPING_TRIALS = 60
"""Trials asked and told at most on the scratch study; a larger budget's others at the last half's mean."""


def bookkeeping_seconds(spec: StudySpec, trials: int, slots: int) -> tuple[float, str]:
    """Seconds the run's storage spends on ``trials`` trials trained ``slots`` at a time (module docstring), and
    where they are kept (the cache's file: a second plan reads them back and prints the same)."""
    import optuna

    asked = min(trials, BOOKKEEPING_TRIALS)
    key = {"version": 1, "space": _described(spec), "trials": asked, "slots": slots, "optuna": optuna.__version__}
    hit = cached_bookkeeping(key)
    if hit is not None:
        each, path = [float(s) for s in hit[0]["each"]], hit[1]
    else:
        each = _measure(spec, asked, slots)
        path = cache_bookkeeping(key, {"each": each})
    total = sum(each) + (trials - asked) * statistics.fmean(each[len(each) // 2:])
    return total, f"cached in {path}"


def storage_seconds(spec: StudySpec, trials: int, slots: int) -> tuple[float, str]:
    """``bookkeeping_seconds`` and the plan's line saying what they count."""
    seconds, how = bookkeeping_seconds(spec, trials, slots)
    return seconds, (f"{seconds:.1f} s: {trials} trials asked of the study's sampler, their rows written and told "
                     f"({slots} in flight) on a scratch study; {how}")


def _described(spec: StudySpec) -> dict[str, Any]:
    """What a trial's bookkeeping costs depend on: the space, the objectives, the sampler, the baselines."""
    return {"search": repr(spec.search), "objectives": repr(spec.objectives), "sampler": repr(spec.sampler),
            "baseline": repr(spec.baseline), "seed": spec.seed}


def _measure(spec: StudySpec, trials: int, slots: int) -> list[float]:
    """Seconds of each of ``trials`` trials' ask, rows and tell on a scratch study, ``slots`` of them in flight as
    in a pack (the sampler asked while they run, as a run's backfill asks it); the first also the study's opening,
    the last also the store's close. Optuna's and the ledger's log lines are held back meanwhile."""
    import optuna

    from lora_sweep.store.api import ResultsStore, StudyDir
    from lora_sweep.sweep.ledger import Ledger, open_study

    rng = random.Random(spec.seed)
    each: list[float] = []
    quiet = optuna.logging.get_verbosity()
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    ledger_log = logging.getLogger("lora_sweep.sweep.ledger")
    ledger_log.disabled, was = True, ledger_log.disabled
    try:
        with tempfile.TemporaryDirectory(prefix="lora-sweep-plan-") as scratch:
            sdir = StudyDir(Path(scratch) / spec.name)
            t0 = time.perf_counter()
            sdir.root.mkdir(parents=True)
            store = ResultsStore(sdir.results_db)
            study, storage = open_study(dataclasses.replace(spec, storage=None), sdir, log=lambda m: None)
            ledger = Ledger(study, storage, store, lambda n: sdir.adapters / str(n), lambda m: None)
            pack = store.start_pack(slots=slots)
            live: list[tuple[int, optuna.Trial]] = []
            for i in range(trials):
                live.append((i % slots, _asked(spec, ledger, store, pack, i % slots)))
                if len(live) == slots or i == trials - 1:  # the oldest ends; its slot takes the next trial
                    for slot, trial in live[:1] if i < trials - 1 else live:
                        _told(ledger, store, pack, slot, trial, [rng.random() for _ in spec.objectives])
                    live = live[1:] if i < trials - 1 else []
                if i == trials - 1:
                    store.close()
                now = time.perf_counter()
                each.append(now - t0)
                t0 = now
    finally:
        optuna.logging.set_verbosity(quiet)
        ledger_log.disabled = was
    return each


def _asked(spec: StudySpec, ledger: Any, store: Any, pack: int, slot: int) -> Any:
    """A trial asked and its row and span written, as a run's backfill does (``sweep.study``'s ``next_job``)."""
    from lora_sweep.sweep.sampling import suggest

    trial = ledger.ask()
    params = suggest(trial, spec.search)
    with store.transaction():
        store.upsert_trial(trial.number, state="RUNNING", params=params, pack_id=pack, slot=slot,
                           started=time.time(), user_attrs=dict(trial.user_attrs))
        store.open_span(pack, slot, trial.number, start_step=0)
    return trial


def _told(ledger: Any, store: Any, pack: int, slot: int, trial: Any, values: list[float]) -> None:
    """A trial's row and span closed, then told COMPLETE with ``values``, as a run's ``_tell`` does."""
    from optuna.trial import TrialState

    with store.transaction():
        store.upsert_trial(trial.number, state="COMPLETE", objective_values=values, steps_done=1, finished=time.time())
        store.close_span(pack, slot, trial.number, end_step=1, end_reason="complete")
    ledger.tell(trial, TrialState.COMPLETE, values)
