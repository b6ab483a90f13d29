"""What a run's storage and its report spend on its trials, measured for ``sweep plan``: the ``storage`` and
``report`` phases of a run's split.

Each trial a run trains is asked of the study's sampler (Optuna's ``ask`` and the space's suggestions: TPE's cost
grows with the trials told before it), its row and slot span written to the results store (one commit), and told
with its values (its row, its span's end, Optuna's ``tell``); every 10 pack steps the live trials' learning curves
are written (one insert); at its end the run writes the study's HTML report. ``bookkeeping_seconds`` does that for
the trial budget on a scratch study directory made as a run makes its own (``ledger.open_study``: the study's
sampler and objectives, its community default enqueued; the directory's own journal storage), with random
objective values and curves, and times the trials from the study's opening to its store's close, the curves, and
the report (where the caller hands over its writer: ``reports`` is not the sweep's to import; written twice, the
second timed, as a run's report comes after the lazy imports its ``sweep run`` preloads while the pack trains, and
the first's extra time kept as those imports, which on a CPU host take their seconds from the training). A
budget above ``BOOKKEEPING_TRIALS`` is timed on that many, the rest at the mean of the last half of them (the
sampler's cost per trial as it stands then; the report is of those). The measurement is cached beside the
calibration (``sweep.calibration.cached_bookkeeping``), keyed by the space, the objectives, the sampler, the trial
count, the pack steps and Optuna's version.
"""

from __future__ import annotations

import dataclasses
import logging
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lora_sweep.sweep.calibration import cache_bookkeeping, cached_bookkeeping

if TYPE_CHECKING:
    from lora_sweep.sweep.config.spec import StudySpec

__all__ = ["BOOKKEEPING_TRIALS", "CURVE_EVERY", "Bookkeeping", "bookkeeping_seconds", "storage_seconds"]

BOOKKEEPING_TRIALS = 60
"""Trials asked and told at most on the scratch study; a larger budget's others at the last half's mean."""
CURVE_EVERY = 10
"""Pack steps between a run's writes of its live trials' learning curves (``sweep.study``'s ``on_step``)."""
ReportWriter = Callable[[Path], object]
"""Writes the HTML report of the study directory it is handed (``reports.html.write_report``)."""


@dataclass(frozen=True)
class Bookkeeping:
    """A trial budget's storage and report, timed (``bookkeeping_seconds``)."""

    trials_s: float
    """Seconds of the trials' asks, rows and tells (the study's opening and its store's close too)."""
    curves_s: float
    """Seconds of the learning curves' writes, every ``CURVE_EVERY`` pack steps, and the pack's record."""
    report_s: float | None
    """Seconds of the HTML report's write; None: not measured (no writer handed over, or it failed)."""
    where: str
    """The cache's file that keeps them."""
    imports_s: float = 0.0
    """Seconds of the report's lazy imports (its first write's beyond the second): a ``sweep run`` loads them on a
    thread while its pack trains (``reports.html.preload``), which on a CPU host takes them from the training."""


def bookkeeping_seconds(spec: StudySpec, trials: int, slots: int, *, steps: int = 0,
                        report: ReportWriter | None = None) -> Bookkeeping:
    """The run's storage for ``trials`` trials trained ``slots`` at a time over ``steps`` pack steps, and its report
    written by ``report`` (module docstring); where they are kept (the cache's file: a second plan reads them back
    and prints the same)."""
    import optuna

    asked = min(trials, BOOKKEEPING_TRIALS)
    key = {"version": 3, "space": _described(spec), "trials": asked, "slots": slots, "steps": steps,
           "report": report is not None, "optuna": optuna.__version__}
    hit = cached_bookkeeping(key)
    if hit is not None:
        record, path = hit
    else:
        record = _measure(spec, asked, slots, steps, report)
        path = cache_bookkeeping(key, record)
    each = [float(s) for s in record["each"]]
    total = sum(each) + (trials - asked) * statistics.fmean(each[len(each) // 2:])
    report_s = record.get("report_s")
    return Bookkeeping(total, float(record["curves_s"]), None if report_s is None else float(report_s), str(path),
                       float(record["imports_s"]))


def storage_seconds(spec: StudySpec, trials: int, slots: int, *, steps: int = 0,
                    report: ReportWriter | None = None, device: str = "cpu") -> tuple[float, str]:
    """``bookkeeping_seconds`` in all, and the plan's line saying what they count: on a CPU ``device`` with the
    report's imports, which the run loads beside its training (on a GPU host while the step loop waits on the GPU)."""
    kept = bookkeeping_seconds(spec, trials, slots, steps=steps, report=report)
    cpu = device.startswith("cpu")
    seconds = kept.trials_s + kept.curves_s + (kept.report_s or 0.0) + (kept.imports_s if cpu else 0.0)
    if report is None or kept.report_s is None:
        written = "not counted (no report writer)" if report is None else "not counted (it failed on the scratch study)"
    else:
        written = f"{kept.report_s:.1f} s" + (f" and its imports {kept.imports_s:.1f} s (loaded while the pack trains, "
                                              f"beside it on a CPU)" if cpu else "")
    return seconds, (f"{seconds:.1f} s: {trials} trials asked of the study's sampler, their rows written and told "
                     f"({slots} in flight) on a scratch study {kept.trials_s:.1f} s, their curves every "
                     f"{CURVE_EVERY} of {steps} pack steps {kept.curves_s:.1f} s, its HTML report {written}; "
                     f"cached in {kept.where}")


def _described(spec: StudySpec) -> dict[str, Any]:
    """What a trial's bookkeeping costs depend on: the space, the objectives, the sampler, the baselines."""
    return {"search": repr(spec.search), "objectives": repr(spec.objectives), "sampler": repr(spec.sampler),
            "baseline": repr(spec.baseline), "seed": spec.seed}


def _measure(spec: StudySpec, trials: int, slots: int, steps: int, report: ReportWriter | None) -> dict[str, Any]:
    """The record ``bookkeeping_seconds`` keeps: ``each``, the seconds of each of ``trials`` trials' ask, rows and
    tell on a scratch study, ``slots`` of them in flight as in a pack (the sampler asked while they run, as a run's
    backfill asks it; the first also the study's opening, the last also the store's close); ``curves_s``, the
    curves of ``steps`` pack steps and the pack's record; ``report_s``, the report (None: not measured). Optuna's
    and the ledger's log lines are held back meanwhile."""
    import optuna

    from lora_sweep.store.api import ResultsStore, StudyDir
    from lora_sweep.sweep.ledger import Ledger, open_study

    rng = random.Random(spec.seed)
    each: list[float] = []
    curves_s, report_s = 0.0, None
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
                    curves_s = _curves(store, pack, trials, slots, steps, rng)
                    t0 += curves_s  # not the last trial's
                    store.close()
                now = time.perf_counter()
                each.append(now - t0)
                t0 = now
            report_s, imports_s = (None, 0.0) if report is None else _report_seconds(report, sdir.root)
    finally:
        optuna.logging.set_verbosity(quiet)
        ledger_log.disabled = was
    return {"each": each, "curves_s": curves_s, "report_s": report_s, "imports_s": imports_s}


def _curves(store: Any, pack: int, trials: int, slots: int, steps: int, rng: random.Random) -> float:
    """Seconds of a run's curve writes over ``steps`` pack steps (every ``CURVE_EVERY``, each live slot's trial
    its rows since the last; the trials in turn) and of its pack's record closed."""
    t0 = time.perf_counter()
    for flush in range(-(-steps // CURVE_EVERY)):
        first = flush * CURVE_EVERY
        store.add_curves({(flush * slots + s) % trials: [
            {"step": step, "loss": rng.random(), "tokens": 100 * step, "lr": 1e-4, "grad_norm": rng.random(),
             "time": time.time()} for step in range(first, min(steps, first + CURVE_EVERY))] for s in range(slots)})
    store.finish_pack(pack, steps=steps, tokens=0)
    return time.perf_counter() - t0


def _report_seconds(report: ReportWriter, root: Path) -> tuple[float | None, float]:
    """(seconds of the second of two reports of the study at ``root``, what the first took beyond it: the writer's
    imports); (None, 0) where it fails (the run's own report says why)."""
    try:
        t0 = time.perf_counter()
        report(root)
        t1 = time.perf_counter()
        report(root)
        t2 = time.perf_counter()
    except Exception:  # noqa: BLE001  (the plan leaves the report out; the run writes it or says why)
        return None, 0.0
    return t2 - t1, max(0.0, (t1 - t0) - (t2 - t1))


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
