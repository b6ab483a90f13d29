"""The trackers' process: what results.db holds, copied to each tracker, off the training process.

``sweep.trackers.process`` starts one process (``python -m lora_sweep.sweep.trackers.sync``, ``main``) for the
study's ``trackers:``, which imports only what it needs (no torch: ``_tensorboard`` writes TensorBoard's own
events), and imports it at once (``_prepare_ahead``, ``Syncer.prepare``), while the run imports torch and loads its
model. Told the study (its first line on stdin), every ``interval`` seconds it
reads results.db (read-only, its own connection; only when the run committed since: ``data_version``) and hands each
tracker what it has not yet logged: new trials (a child run each), their training steps and intermediate metrics,
and the end of each finished trial. The training loop is not touched: it writes results.db as it always does (steps
every few pack steps, rungs and ends at once).
A process, not a thread: the trackers' Python (importing MLflow and W&B, opening runs, their clients) would hold the
interpreter's lock that the training thread takes back after every op, and on the 2-core demo a thread doing it
cost 11-19% of the wall for 9 CPU seconds (BENCHMARKS.md, "The demo with MLflow, W&B and TensorBoard tracking it").

What each tracker has logged is kept in ``<study dir>/trackers.json`` (written atomically after each pass): its
parent run id, and per trial its child run id, the last step logged and whether its end was logged. A resumed
study reads it back (a torn or malformed file: one warning), and each tracker reads back what it holds by the ids it
sets itself (``Tracker.find``), which wins: no run is made twice, a deleted store is made again, and the runs carry
on after what they hold (results.db being the source, the steps a killed run had stored but not yet logged are
logged then). Nothing is logged by a run that another live process's lock kept out of the study directory, and a
study's run is opened only once a trial is to be logged. The process ends with the run's process, killed or not
(its stdin closes). A tracker that raises (server down, disk full, an import error), or whose call to a server
takes over ``_guards.CALL_S`` (``END_S`` in all once the run has ended), is named in one warning line and dropped for
the rest of the run; the sweep goes on. What this process prints passes through ``redact_url``: no tracking URI's
password reaches the run's output. At the end one line says what the trackers cost: their passes, the CPU seconds of
their process (those spent preparing, and after the run's end) and of its child processes (W&B's core)
(``benchmarks/trackers_overhead.sh`` reads it); the run waits for that line, not for the process's exit.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import resource
import select
import signal
import sys
import time
from collections.abc import Callable, Collection, Mapping
from pathlib import Path
from typing import Any

from lora_sweep.errors import first_line
from lora_sweep.store.api import (
    EvalRow,
    ResultsStore,
    StepRow,
    StudyDir,
    TrialRecord,
    atomic_write_text,
    redact_record,
    redact_url,
)
from lora_sweep.store.feasibility import best_trials
from lora_sweep.sweep.config.tracking import TrackerSpec
from lora_sweep.sweep.trackers._guards import END_S, Bounded, Redacted, checked, lock_holder
from lora_sweep.sweep.trackers.base import Point, StudyInfo, Tracker, study_uid

__all__ = ["Syncer", "main", "STATE_FILE"]

STATE_FILE = "trackers.json"
"""In the study directory: each tracker's run ids and how far it has logged."""
_ENDED = ("COMPLETE", "PRUNED", "FAIL")
NICE = 19
"""The trackers' process's niceness where Linux's ``SCHED_IDLE`` is not to be had (``_lowest_priority``)."""
_STEP_KEYS = (("loss", "train/loss"), ("lr", "train/lr"), ("grad_norm", "train/grad_norm"), ("tokens", "train/tokens"))
_EVAL_PREFIX = {"rung": "rung/", "curve": "eval/"}


def _make(entry: TrackerSpec, root: Path, name: str) -> Tracker:
    """The tracker of ``entry``, its package imported here (in the trackers' process)."""
    if entry.name == "mlflow":
        from lora_sweep.sweep.trackers._mlflow import MlflowTracker

        return MlflowTracker(entry.options, root, name)
    if entry.name == "wandb":
        from lora_sweep.sweep.trackers._wandb import WandbTracker

        return WandbTracker(entry.options, root, name)
    from lora_sweep.sweep.trackers._tensorboard import TensorBoardTracker

    return TensorBoardTracker(entry.options, root, name)


def _prepare(name: str, options: Mapping[str, Any]) -> None:
    """Import the tracker's package and ready what it needs that no study directory holds (``Syncer.prepare``)."""
    if name == "mlflow":
        from lora_sweep.sweep.trackers._mlflow import prepare as prepare_mlflow

        prepare_mlflow(options)
    elif name == "wandb":
        from lora_sweep.sweep.trackers._wandb import prepare as prepare_wandb

        prepare_wandb(options)
    else:  # TensorBoard's events writer: its import is all it needs
        importlib.import_module("lora_sweep.sweep.trackers._tensorboard")


def main(argv: list[str] | None = None) -> None:
    """The trackers' process: on idle cycles (``_lowest_priority``), the trackers its argument names prepared, then
    once the run has told the study, a pass every ``interval`` seconds until the run says it ended (then a last
    pass, the study's end, every run closed, the cost said) or its process is gone (EOF on stdin, at any time: a
    killed run, or a study that did not load; stop where it is, the runs left open for a resumed run to reopen)."""
    config = json.loads((argv or sys.argv[1:])[0])
    _lowest_priority()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a SIGINT sent to it (its group's) is the run's to handle too
    said = Redacted(os.fdopen(os.dup(1), "w", buffering=1))  # this process's lines for the run; what the
    os.dup2(2, 1)  # trackers' packages print goes to stderr, never into them
    # before any package is imported (their loggers keep the stream they found): nothing this process prints,
    # a traceback or a library's message echoing a tracking URI, shows a password
    sys.stdout, sys.stderr = Redacted(sys.stdout), Redacted(sys.stderr)
    run = _Lines(sys.stdin.fileno())
    ready = _prepare_ahead(config["prepare"])
    study = run.next(None)
    if not study:
        os._exit(0)
    told = json.loads(study)
    trackers = [TrackerSpec(name, options) for name, options in told["trackers"]]
    syncer = Syncer(Path(told["out_dir"]), told["name"], trackers, lambda line: print(line, file=said))
    syncer.prepare(ready)
    prepared = _cpu_s()
    wait = 0.0  # the first pass at once: the study's runs open while the run may still be loading its model
    while (line := run.next(wait)) is None:
        wait = config["interval"]
        syncer.sync()
    if not line:
        os._exit(0)
    end = json.loads(line)
    syncer.ending()
    ran = _cpu_s()
    syncer.sync()
    syncer.end(end["finished"], None if end["report"] is None else Path(end["report"]))
    total = _cpu_s()
    print(f"trackers: {syncer.passes} passes; CPU {total:.2f} s in their process ({prepared:.2f} s preparing, "
          f"{total - ran:.2f} s after the run), {_children_cpu_s():.2f} s in its child processes", file=said)
    said.close()  # the run's wait ends here (Tracking.finish), before this process's exit


class _Lines:
    """The run's lines on a file descriptor, read unbuffered: a buffered reader could hold the next line where
    ``select`` no longer sees it."""

    def __init__(self, fd: int) -> None:
        self.fd, self.held, self.eof = fd, b"", False

    def next(self, timeout: float | None) -> str | None:
        """The next line; "" at EOF; None when none came within ``timeout`` seconds (None: wait for it)."""
        while b"\n" not in self.held:
            if self.eof:
                return ""
            if not select.select([self.fd], [], [], timeout)[0]:
                return None
            chunk = os.read(self.fd, 65536)
            self.held += chunk
            self.eof = not chunk
        line, _, self.held = self.held.partition(b"\n")
        return line.decode()


def _wandb_first(names: list[str]) -> list[str]:
    """W&B first: its pydantic models read their fields' docstrings from source through inspect.getmodule, which
    scans every loaded module; before MLflow's (and pandas') thousands load, that costs 0.25 CPU s less."""
    return sorted(names, key=lambda name: name != "wandb")


def _prepare_ahead(named: list[list[Any]]) -> set[str]:
    """The trackers ``sweep run`` started the process with (``process.ahead``) prepared before it tells the study;
    the names of those that were. One that failed is left for ``Syncer.prepare`` to try again
    and say, if the study names it."""
    options = {name: opts for name, opts in named}
    ready = set()
    for name in _wandb_first(list(options)):
        with contextlib.suppress(Exception):  # any failure: said, if it matters, by Syncer.prepare
            _prepare(name, options[name])
            ready.add(name)
    return ready


def _cpu_s() -> float:
    """User + system CPU seconds of this process so far."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _lowest_priority() -> None:
    """Run this process (and the processes it starts: W&B's core) on the cycles training leaves idle: Linux's
    ``SCHED_IDLE`` policy, which runs a task only when no other wants the core and gives the core back at once when
    one does; elsewhere the lowest niceness (``NICE``), which a busy core still shares about 1/70 of its time with.
    What training never leaves idle waits for the end of the run, the last pass."""
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):
        with contextlib.suppress(OSError, AttributeError):
            os.nice(NICE)


class Syncer:
    """The trackers' process's work: passes over results.db, and the study's end."""

    def __init__(self, out_dir: Path, name: str, trackers: list[TrackerSpec], log: Callable[[str], None]) -> None:
        self.name, self.entries, self.log = name, trackers, log
        self.sdir = StudyDir(out_dir)
        self.state_path = self.sdir.root / STATE_FILE
        self.trackers: dict[str, Tracker] = {}
        self.failed: set[str] = set()
        self.state: dict[str, Any] = {}
        self.store: ResultsStore | None = None
        self.passes = 0
        self.mine = False  # the run that started this process was seen holding the study directory
        self.foreign = False  # another live process was seen holding it first: this run was refused it
        self.opened: set[str] = set()  # trackers whose study run this process opened
        self.end_by: float | None = None  # when the time of servers' trackers ends (``ending``)
        self._saved = ""
        self._read: int | None = None  # results.db's data_version the last whole pass read

    def prepare(self, ready: Collection[str] = ()) -> None:
        """Ready every tracker not in ``ready`` before the run has trials (``_prepare``, writing nothing in the
        study directory, which the run may not have made yet): importing their packages (about 2 CPU seconds for
        the three) then runs beside the run's own start, which loads the model, rather than in its training."""
        entries = {entry.name: entry for entry in self.entries}
        for name in _wandb_first([n for n in entries if n not in ready and n not in self.failed]):
            self._guarded(entries[name], lambda e=entries[name]: _prepare(e.name, e.options))

    def _ours(self) -> bool:
        """Whether this run may log the study: the directory's lock was seen the run's (the process that started
        this one), or it is free and was never seen held by another live process (a run refused the directory logs
        nothing, not even once the other has ended)."""
        if not self.mine:
            holder = lock_holder(self.sdir.lock)
            self.mine = holder == os.getppid()
            self.foreign = self.foreign or (holder is not None and not self.mine)
        return self.mine or not self.foreign

    def ending(self) -> None:
        """The run has ended: a tracker that talks to a server has ``END_S`` left for its last pass and its end."""
        self.end_by = time.monotonic() + END_S
        for tracker in self.trackers.values():
            if isinstance(tracker, Bounded):
                tracker.end()

    def sync(self) -> None:
        """One pass: every tracker is given what results.db holds beyond what it logged."""
        self.passes += 1
        if not self._ours():
            return
        if self.store is None:
            if not self.sdir.results_db.is_file():
                return  # the run has not opened the study yet
            self.store = ResultsStore(self.sdir.results_db, create=False)
            self.state = self._load()
        version = self.store.data_version()
        if version == self._read:
            return  # nothing committed since the last pass: most passes while a pack step runs
        meta = self.store.meta()
        if "spec" not in meta:
            return  # the spec is recorded once the session is open
        trials = self.store.trials()
        rows: dict[int, tuple[list[StepRow], list[EvalRow]]] = {}  # read once a pass, whatever the trackers
        for entry in self.entries:
            if entry.name not in self.failed:
                self._guarded(entry, lambda e=entry: self._pass(e, meta, trials, rows))
        self._save()
        self._read = version

    def _load(self) -> dict[str, Any]:
        """``trackers.json`` as the last pass wrote it; a torn or malformed one is said in one warning and left
        for the trackers to rebuild from their own runs (``Tracker.find``)."""
        try:
            text = self.state_path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return {}
        try:
            state = checked(json.loads(text))
        except ValueError as err:
            self.log(f"warning: {self.state_path}: {first_line(err)}; the trackers read their runs back instead")
            return {}
        for mine in state.values():  # this process has opened none of them yet
            for cursor in mine.get("trials", {}).values():
                cursor["open"] = False
        return state

    def _save(self) -> None:
        """``trackers.json``, written (atomically) only when it changed: most passes log nothing."""
        text = json.dumps(self.state, indent=1, sort_keys=True)
        if text != self._saved:
            atomic_write_text(self.state_path, text)
            self._saved = text

    def _guarded(self, entry: TrackerSpec, fn: Callable[[], None]) -> None:
        """``fn()``; an exception drops the tracker with one warning line."""
        try:
            fn()
        except Exception as err:  # noqa: BLE001  (any tracker failure costs the tracker, never the sweep)
            self.failed.add(entry.name)
            tracker = self.trackers.pop(entry.name, None)
            self.log(redact_url(f"warning: tracker {entry.name} stopped ({first_line(err)}); the sweep goes on "
                                f"without it"))  # an HTTP client's error names the URL it was given
            if tracker is not None:
                with contextlib.suppress(Exception):
                    tracker.close(False)

    def _tracker(self, entry: TrackerSpec, info: StudyInfo, trials: list[TrialRecord]) -> Tracker:
        """The tracker of ``entry``, made at its first pass, its cursors reconciled with what it holds itself: a
        run trackers.json names that the tracker no longer has (a deleted store) is made again, one it has that
        trackers.json lost (a kill between a run's creation and the file's write, a torn file) is reopened."""
        mine = self.state.setdefault(entry.name, {"trials": {}})
        made = _make(entry, self.sdir.root, self.name)
        if made.remote:
            made = Bounded(made)  # type: ignore[assignment]
            if self.end_by is not None:  # made in the last pass: its time is what is left of END_S
                made.end_by = self.end_by  # type: ignore[attr-defined]
        tracker = self.trackers[entry.name] = made
        hints = {int(n): c["run"] for n, c in mine["trials"].items() if c.get("run")}
        found = tracker.find(info, mine.get("parent"), hints)
        if found is None:  # it cannot read its runs back: trackers.json's ids are reopened by id
            return tracker
        mine["parent"], held = found[0], found[1]
        cursors = mine["trials"]
        for number in {t.number for t in trials} | {int(n) for n in cursors}:
            got, cursor = held.get(number), cursors.get(str(number))
            if got is None:
                cursors[str(number)] = {"run": None, "step": -1, "ended": False}
            elif cursor is None or cursor["run"] != got.run or cursor["ended"] != got.ended:
                cursors[str(number)] = {"run": got.run, "step": -1, "ended": got.ended}
        return tracker

    def _pass(self, entry: TrackerSpec, meta: Mapping[str, Any], trials: list[TrialRecord],
              rows: dict[int, tuple[list[StepRow], list[EvalRow]]]) -> None:
        """Hand one tracker what it has not logged; ``rows``: each trial's steps and evaluations, read on first need
        and shared by the pass's trackers. The study's run is opened once a trial is to be logged: a run with
        nothing to log (a finished study run again) touches no run."""
        info = _info(self.name, self.sdir.root, meta)
        tracker = self.trackers.get(entry.name) or self._tracker(entry, info, trials)
        mine = self.state[entry.name]
        assert self.store is not None
        for trial in trials:
            cursor = mine["trials"].setdefault(str(trial.number), {"run": None, "step": -1, "ended": False})
            if cursor["ended"] or trial.state not in (*_ENDED, "RUNNING"):
                continue
            if entry.name not in self.opened:
                mine["parent"] = tracker.study_started(info, mine.get("parent"))
                self.opened.add(entry.name)
            if not cursor.get("open"):
                cursor["run"], cursor["step"] = tracker.trial_started(trial, cursor["run"], cursor["step"])
                cursor["open"] = True
            ended = trial.state in _ENDED
            if trial.number not in rows:
                rows[trial.number] = (self.store.curves([trial.number]).get(trial.number, []),
                                      self.store.evals(trial.number))
            steps, evals = rows[trial.number]
            points = _points(steps, evals, cursor["step"], ended)
            if points:
                tracker.log(trial.number, points)
                cursor["step"] = points[-1].step
            if ended:
                final = {e.metric: e.value for e in evals if e.kind == "final" and e.value is not None}
                tracker.trial_finished(trial, final)
                cursor["ended"], cursor["open"] = True, False

    def end(self, finished: bool, path: Path | None) -> None:
        """After the last pass: with ``finished``, the report at ``path`` and the Pareto table on the parent runs
        opened; every run closed, the state written."""
        pareto = self._pareto() if finished and self.trackers else []
        for entry in self.entries:
            tracker = self.trackers.get(entry.name)
            if tracker is not None:
                if finished and entry.name in self.opened:
                    self._guarded(entry, lambda t=tracker: t.study_finished(path, pareto))
                self._guarded(entry, lambda t=tracker: t.close(finished))
        if self.store is not None:
            with contextlib.suppress(OSError):
                self._save()
            self.store.close()

    def _pareto(self) -> list[dict[str, Any]]:
        if self.store is None:
            return []
        meta = self.store.meta()
        objectives = list(meta.get("objectives") or [])
        front = best_trials(self.store.trials("COMPLETE"), list(meta.get("directions") or []),
                            list(meta.get("constraints") or []))
        return [{"trial": t.number, **dict(zip(objectives, t.objective_values or [], strict=False)),
                 **{f"param.{k}": v for k, v in (t.params or {}).items()}} for t in front]


def _children_cpu_s() -> float:
    """User + system CPU seconds of this process's child processes: those ended and waited for, and (with psutil,
    which W&B requires) those still running, such as W&B's core until the process exits."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    total = usage.ru_utime + usage.ru_stime
    try:
        import psutil
    except ImportError:
        return total
    with contextlib.suppress(psutil.Error):
        for child in psutil.Process().children(recursive=True):
            with contextlib.suppress(psutil.Error):
                times = child.cpu_times()
                total += times.user + times.system
    return total


def _info(name: str, root: Path, meta: Mapping[str, Any]) -> StudyInfo:
    spec = redact_record(meta.get("spec") or {})  # recorded so already; a study recorded before, masked here
    tags = {"lora_sweep.study": name, "lora_sweep.objectives": ", ".join(
        f"{d} {o}" for o, d in zip(meta.get("objectives") or [], meta.get("directions") or [], strict=False)),
        "lora_sweep.model": str((spec.get("model") or {}).get("path", "")),
        "lora_sweep.version": str(meta.get("lora_sweep_version", ""))}
    return StudyInfo(name, root, spec, tags, study_uid(str(meta.get("name", name)), meta.get("created")))


def _points(steps: list[StepRow], evals: list[EvalRow], after: int, ended: bool) -> list[Point]:
    """The trial's points past step ``after``: its training steps, and its intermediate metrics at steps its
    training steps have reached (all of them once the trial ended), merged by step, in step order."""
    points: dict[int, dict[str, float]] = {}
    for row in steps:
        if row.step > after:
            points[row.step] = {name: float(v) for key, name in _STEP_KEYS if (v := getattr(row, key)) is not None}
    reached = max(points, default=after) if not ended else float("inf")
    for e in evals:
        if e.kind in _EVAL_PREFIX and after < e.step <= reached and e.value is not None:
            points.setdefault(e.step, {})[_EVAL_PREFIX[e.kind] + e.metric] = float(e.value)
    return [Point(step, points[step]) for step in sorted(points)]


if __name__ == "__main__":
    main()
