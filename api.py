"""The Python API: what the ``sweep`` commands do, callable from a notebook or a script (the CLI is this module
plus argument parsing and printing); docs/reference/api.md shows it in use."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lora_sweep.store.api import ResultsStore, StudyDir, TrialRecord
from lora_sweep.store.feasibility import best_trials

if TYPE_CHECKING:
    from lora_sweep.sweep.config.spec import StudySpec
    from lora_sweep.sweep.export import Export
    from lora_sweep.sweep.study import Progress, RunSummary
    from lora_sweep.sweep.trackers.process import Tracking

__all__ = ["load_study", "run", "open_results", "Results", "export", "write_report", "examples", "copy_example",
           "LOGGER", "engine_threads"]

LOGGER = "lora_sweep"
"""The name of the logger ``run`` writes its lines to (at INFO) when no ``log`` is given."""

STUDIES = Path(__file__).resolve().parent / "studies"
"""The example studies and their data: the checkout's studies/, or the installed package's lora_sweep/studies/."""


def load_study(path: str | Path, overrides: Sequence[str] = (), *, out: str | Path | None = None) -> StudySpec:
    """Read and validate a study file (lora-sweep, Axolotl or torchtune YAML) with dotted ``key=value`` overrides.

    ``out`` replaces the study directory (the file's ``output``). Raises ``ConfigError`` naming file:line and key.
    """
    from lora_sweep.sweep.config.loader import load_study as _load

    spec = _load(path, list(overrides))
    return dataclasses.replace(spec, output=Path(out)) if out is not None else spec


def run(study: StudySpec | str | Path, overrides: Sequence[str] = (), *, out: str | Path | None = None,
        progress: Callable[[Progress], None] | None = None, log: Callable[[str], None] | None = None,
        allow_changes: bool = False, gpus: int | None = None, trackers: Tracking | None = None,
        allow_data_change: bool = False) -> RunSummary:
    """Run the study (a spec from ``load_study``, or a study file with ``overrides``) until its budget ends.

    A study directory that already holds the study resumes it; one whose budget is already spent trains and writes
    nothing, and the summary says so (``already_spent``, ``ended``). ``progress`` is called after each packed step,
    ``log`` with each one-line message the CLI prints (trials started and finished, progress of the start, how the
    run ended); without it they go to the ``lora_sweep`` logger at INFO, printed to stderr unless the application
    configured logging itself (``logging.getLogger("lora_sweep").setLevel(logging.WARNING)`` silences them, as
    ``optuna.logging.set_verbosity`` does Optuna's). ``allow_changes``: resume even if a fixed setting
    (e.g. ``train.max_steps``) differs from the one the study started with; ``allow_data_change``: even if a data
    file's contents differ (``sweep.resume.record_data``; recorded). ``gpus``: the ranks of a sharded
    pack (``pack.shard: fsdp``; default 1), this process rank 0 (``sweep.ranks.run_ranks``). The study's
    ``trackers:`` log it from a process of their own (``sweep.trackers``), started here once the study is loaded
    or, given ``trackers``, started before it loaded (``sweep.trackers.process.ahead``, as ``sweep run`` does so
    that the trackers' packages import while torch does); with them, the HTML report is written at the end for
    their parent runs (``summary.report``). The run's CPU threads are the CLI's (``engine_threads``).

    Raises:
        UserError: ``gpus`` without ``pack.shard: fsdp``, or more than the visible devices.
    """
    from lora_sweep.errors import UserError
    from lora_sweep.sweep.trackers.process import start as start_tracking

    try:
        if isinstance(study, str | Path):
            spec = load_study(study, overrides, out=out)
        else:
            spec = study if out is None else dataclasses.replace(study, output=Path(out))
        if spec.pack.shard != "fsdp" and gpus is not None:
            raise UserError(f"--gpus {gpus} (gpus={gpus} in the API): needs pack.shard: fsdp (one pack over N "
                            f"GPUs); sweep run --workers N runs a pack per GPU")
    except BaseException:
        if trackers is not None:  # started for a study that is not run
            trackers.abandon()
        raise
    say = log or _logger().info
    tracking = start_tracking(spec, say, started=trackers)
    finished = False
    try:
        with engine_threads():
            summary = _run(spec, gpus, progress, say, allow_changes, allow_data_change)
        finished = not summary.already_spent and summary.end_reason not in ("interrupt", "sigterm", "error")
    finally:
        if tracking is not None:
            report = tracking.finish(finished, report=lambda: write_report(spec.out_dir))
    if tracking is not None:
        summary.report = report
    return summary


def _run(spec: StudySpec, gpus: int | None, progress: Callable[[Progress], None] | None, say: Callable[[str], None],
         allow_changes: bool, allow_data_change: bool) -> RunSummary:
    """The study run in this process, or over ``gpus`` ranks of a sharded pack."""
    from lora_sweep.sweep.study import run_study

    if spec.pack.shard != "fsdp":
        return run_study(spec, progress=progress, log=say, allow_changes=allow_changes,
                         allow_data_change=allow_data_change)
    from lora_sweep.sweep.ranks import run_ranks

    return run_ranks(spec, gpus or 1, lambda channel: run_study(
        spec, progress=progress, log=say, allow_changes=allow_changes, ranks=channel,
        allow_data_change=allow_data_change))


@contextlib.contextmanager
def engine_threads() -> Iterator[None]:
    """The CPU threads of the engine's work inside the block: the CLI's, whatever the calling process did first.

    ``import lora_sweep`` before torch sets ``OMP_WAIT_POLICY=PASSIVE`` (unless the environment chose a policy),
    as the ``sweep`` command does: torch's OpenMP threads then sleep, not spin, while they wait. When torch was
    imported first with no policy in the environment, its OpenMP runtime already spins, for good: on a CPU that
    another process also uses, every small product then waits on a descheduled spinning thread (several times slower
    than one thread: BENCHMARKS.md, "Planning"; docs/reference/api.md, "Threads"). The block then runs torch on one
    intra-op thread (``torch.set_num_threads(1)``, which has no sibling to wait on), says so in one warning of the
    ``lora_sweep`` logger, and gives the caller's thread count back at its end.
    """
    import lora_sweep

    if not lora_sweep.TORCH_FIRST or "OMP_WAIT_POLICY" in os.environ:
        yield
        return
    import torch

    before = torch.get_num_threads()
    if before > 1:
        logging.getLogger(__name__).warning(
            "torch was imported before lora_sweep with no OMP_WAIT_POLICY: its threads spin while they wait, so the "
            "run uses 1 CPU thread instead of %d (import lora_sweep first, or set OMP_WAIT_POLICY=PASSIVE before "
            "Python starts, to use them all)", before)
        torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _logger() -> logging.Logger:
    """The ``lora_sweep`` logger, given a stderr handler of its own (``HH:MM:SS message``, the CLI's lines) and level
    INFO when neither it nor the root logger has a handler: an application that configured logging gets the
    records through its own handlers instead."""
    logger = logging.getLogger(LOGGER)
    if not logger.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(message)s", datefmt="%H:%M:%S"))
        logger.addHandler(handler)
        logger.propagate = False
    if logger.level == logging.NOTSET:
        logger.setLevel(logging.INFO)
    return logger


@dataclasses.dataclass(frozen=True)
class Results:
    """A study directory's results, read from its ``results.db`` (the CLI's ``sweep status`` reads the same)."""

    root: Path

    def _store(self) -> ResultsStore:
        return ResultsStore(StudyDir(self.root).results_db, create=False)

    def meta(self) -> dict[str, Any]:
        """The study's name, objectives (``objectives``, ``directions``), constraints, storage and spec."""
        with self._store() as store:
            return store.meta()

    def trials(self, state: str | None = None) -> list[TrialRecord]:
        """Every trial (or those in ``state``: COMPLETE, PRUNED, FAIL, RUNNING), by trial number."""
        with self._store() as store:
            return store.trials(state)

    def best_trials(self, *, feasible: bool = True) -> list[TrialRecord]:
        """The complete trials on the Pareto front of the study's objectives (one trial, or ties, for one
        objective), as Optuna's ``study.best_trials``; with ``feasible``, among those meeting the study's
        constraints when any does (Optuna's rule for constrained studies)."""
        meta = self.meta()
        return best_trials(self.trials("COMPLETE"), meta.get("directions", []), list(meta.get("constraints") or []),
                           feasible)

    def status(self) -> dict[str, Any]:
        """What ``sweep status --json`` prints: counts by state, best trials, the Pareto front, packs."""
        from lora_sweep.sweep.status import study_status

        return study_status(self.root)


def _require_study(study_dir: str | Path, command: str = "") -> Path:
    """``study_dir`` as a Path; ``UserError`` (prefixed with ``command: ``) if it holds no study."""
    from lora_sweep.errors import UserError

    if not StudyDir(study_dir).is_study():
        raise UserError(f"{command + ': ' if command else ''}{study_dir}: not a study directory (no results.db and "
                        f"study.yaml)")
    return Path(study_dir)


def open_results(study_dir: str | Path) -> Results:
    """The results of the study in ``study_dir``; raises ``UserError`` if it holds no study."""
    return Results(_require_study(study_dir))


def export(study_dir: str | Path, out: str | Path, *, trial: int | None = None, best: bool = False,
           objective: str | None = None, vllm: bool = True, merge: bool = False,
           allow_infeasible: bool = False) -> Export:
    """Write one complete trial as a PEFT adapter directory (vLLM-ready unless ``vllm=False``), or with ``merge``
    the base model with the adapter merged in; ``best`` picks the best trial (by ``objective`` when several)."""
    from lora_sweep.sweep.export import export_trial

    return export_trial(study_dir, out, trial=trial, best=best, objective=objective, vllm=vllm, merge=merge,
                        allow_infeasible=allow_infeasible)


def write_report(study_dir: str | Path, out: str | Path | None = None) -> Path:
    """Write the study's self-contained HTML report (default ``<study_dir>/report.html``); returns its path."""
    from lora_sweep.reports.html import write_report as _write

    return _write(_require_study(study_dir, "report"), Path(out) if out is not None else None)


def examples() -> list[str]:
    """The names of the shipped example studies (``studies/NAME.yaml``)."""
    return sorted(p.stem for p in STUDIES.glob("*.yaml"))


def copy_example(name: str, out: str | Path) -> Path:
    """Copy the shipped example study ``name`` with its data into the directory ``out`` (created; it must not
    exist or be empty); returns the copied study file.

    The copy is self-contained: ``data/`` sits beside it, and its model path (``../models/X`` in the checkout,
    the checkout's models/ folder) becomes ``./models/X`` inside ``out``, where ``sweep model``/``sweep tiny-model``
    put the model.
    """
    import shutil

    from lora_sweep.errors import UserError

    if name not in examples():
        raise UserError(f"example: no example study {name!r} (one of: {', '.join(examples())})")
    dest = Path(out)
    if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        raise UserError(f"example: {dest} exists and is not an empty directory")
    try:
        dest.mkdir(parents=True, exist_ok=True)
        shutil.copytree(STUDIES / "data", dest / "data", dirs_exist_ok=True)
        text = (STUDIES / f"{name}.yaml").read_text(encoding="utf-8").replace("../models/", "./models/")
        (dest / f"{name}.yaml").write_text(text, encoding="utf-8")
    except OSError as err:
        raise UserError(f"example: cannot write {dest}: {err.strerror or err}") from None
    return dest / f"{name}.yaml"
