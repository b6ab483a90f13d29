"""The trial ledger: the one module that asks, tells, enqueues, requeues, reaps and heartbeats Optuna
trials, and keeps the results store in line with them.

The Optuna storage is the source of truth; the store is its queryable copy. Every attribute the
ledger writes is named in ``store.attrs`` (the one table of keys). Only public Optuna API is
used: the ``optuna.Study`` calls, the ``optuna.Trial`` one is given, and the ``BaseStorage`` methods
of the storage object this module opened itself (``open_study``) for what a study does not expose:
a trial's storage id (``get_trial_id_from_study_id_trial_number``) and its system attributes.

Heartbeats are a trial system attribute (``attrs.HEARTBEAT``, wall-clock seconds) rather than
Optuna's own heartbeat (``RDBStorage(heartbeat_interval=...)``, ``record_heartbeat``,
``optuna.storages.fail_stale_trials``): that one exists only for RDB storages (not the journal file
that ``sweep run --workers`` uses on one host), runs only inside ``Study.optimize``, and fails a
stale trial without the retry this ledger gives it (``requeue``: the same parameters, ``retry_of``,
its adapter removed, its store row marked).
"""

from __future__ import annotations

import json
import logging
import threading
import time
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import optuna
from optuna.storages import BaseStorage
from optuna.trial import FrozenTrial, TrialState

from lora_sweep.errors import UserError, first_line
from lora_sweep.packer.api import Packer
from lora_sweep.store.api import ResultsStore, StudyDir, attrs, redact_url
from lora_sweep.store.storage import (
    Sharing,
    check_directory,
    claim_directory,
    last_beat,
    normalize_url,
    open_storage,
    storage_lock,
    unopenable,
)
from lora_sweep.sweep.config.space import baseline_params, community_default
from lora_sweep.sweep.config.spec import StudySpec
from lora_sweep.sweep.sampling import make_sampler

__all__ = ["Ledger", "Heartbeat", "open_study", "recorded_trials", "storage_url", "ORPHAN_REASON", "FINISHED",
           "is_default", "orphans"]

logger = logging.getLogger(__name__)

ORPHAN_REASON = "orphaned: the run stopped while this trial trained; its parameters were enqueued again"
FINISHED = (TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL)
"""The states of a trial that counts against the budget (orphans excepted)."""


def is_default(trial: optuna.Trial | FrozenTrial) -> bool:
    """Whether the trial is the community default (or a retry of it)."""
    return bool(trial.user_attrs.get(attrs.DEFAULT))


def orphans(trials: Sequence[FrozenTrial]) -> set[int]:
    """Numbers of the trials that were retried (another trial's ``retry_of``): they no longer count."""
    return {t.user_attrs[attrs.RETRY_OF] for t in trials if attrs.RETRY_OF in t.user_attrs}


class Ledger:
    """The study's trials in Optuna and in the results store.

    Args:
        study: The Optuna study (``open_study``).
        storage: The storage object ``study`` was created or loaded with.
        store: The study directory's results store.
        adapters: Trial number -> its adapter directory (removed when the trial is retried).
        log: Where what the ledger did to other runs' trials is said.
    """

    def __init__(self, study: optuna.Study, storage: BaseStorage, store: ResultsStore,
                 adapters: Callable[[int], Path], log: Callable[[str], None] = print) -> None:
        self.study, self.storage, self.store, self.adapters, self.log = study, storage, store, adapters, log
        self._study_id = storage.get_study_id_from_name(study.study_name)
        self._ids: dict[int, int] = {}

    # -- asking and telling -------------------------------------------------------------------
    def ask(self, worker: int | None = None) -> optuna.Trial:
        """A new trial (an enqueued one first); ``worker``: a shared study's worker index, recorded on the
        trial with its first heartbeat, so another worker knows it is alive from the start."""
        trial = self.study.ask()
        folder = self.adapters(trial.number)
        if folder.exists():  # a trial number is new when asked: what is there belongs to another study's trial
            reason = f"{folder} already holds an adapter this study never recorded; it is left as it is"
            trial.set_user_attr(attrs.REASON, reason)
            self.study.tell(trial, state=TrialState.FAIL)
            raise UserError(f"run: trial {trial.number}: {reason} (does another study write to the same "
                            f"adapters or artifacts folder?)")
        if worker is not None:
            self.beat(trial.number)
            self.storage.set_trial_system_attr(self.trial_id(trial.number), attrs.WORKER, worker)
        return trial

    @staticmethod
    def plan(trial: optuna.Trial, tokens: int) -> None:
        """Record the tokens the trial trains if it runs all its steps (other workers count the budget by it)."""
        trial.set_user_attr(attrs.PLANNED_TOKENS, tokens)

    @staticmethod
    def set_adapter(trial: optuna.Trial, path: Path) -> None:
        """Record where the trial's adapter is: absolute, so report and export find it from any host."""
        trial.set_user_attr(attrs.ADAPTER_PATH, str(path.absolute()))

    def tell(self, trial: optuna.Trial, state: TrialState, values: list[float] | None = None, *,
             reason: str | None = None, tokens: int = 0) -> None:
        """Finish the trial in Optuna: its reason, its trained tokens, then its state (and values if COMPLETE).
        The caller records the store's row first: a kill in between leaves the trial RUNNING, retried on resume."""
        if reason is not None:
            trial.set_user_attr(attrs.REASON, reason)
        trial.set_user_attr(attrs.TOKENS, tokens)
        self.study.tell(trial, values=values if state == TrialState.COMPLETE else None, state=state)

    # -- retrying -----------------------------------------------------------------------------
    def requeue(self, trials: Iterable[FrozenTrial | optuna.Trial], reason: str = ORPHAN_REASON,
                log: Callable[[str], None] | None = None) -> None:
        """Fail RUNNING trials and enqueue each again with its parameters (``retry_of``: not counted)."""
        log = self.log if log is None else log
        for t in trials:
            if isinstance(t, optuna.Trial):
                t.set_user_attr(attrs.REASON, reason)
            self.study.tell(t.number, state=TrialState.FAIL)
            self.store.upsert_trial(t.number, state="FAIL", reason=reason)
            Packer.discard_adapter(self.adapters(t.number))  # saved but never told, or half written
            retry = {attrs.RETRY_OF: t.number, **{k: True for k in (attrs.DEFAULT, attrs.BASELINE)
                                                  if t.user_attrs.get(k)}}
            # Killed before or between its suggests, a trial has drawn some parameters or none: its retry
            # keeps those, draws the rest, and still takes its place in the budget.
            self.study.enqueue_trial(t.params, user_attrs=retry)
            log(f"trial {t.number} was left RUNNING by a stopped run: failed and enqueued again")

    def reap(self, grace: float) -> list[int]:
        """Fail and re-enqueue the RUNNING trials of dead workers (no heartbeat for ``grace`` seconds).
        The caller holds the storage lock, so two survivors never retry the same orphan."""
        now = time.time()
        stale = [t for t in self.running() if now - last_beat(t) > grace]
        self.requeue(stale)
        return [t.number for t in stale]

    def recover(self) -> None:
        """A single run's start: every RUNNING trial belongs to a run that died; retry them, then ``sync``."""
        self.requeue(self.running())
        self.sync()

    def sync(self) -> None:
        """Copy the finished trials other runs (or workers on other hosts) recorded only in Optuna."""
        recorded = {r.number: r for r in self.store.trials()}
        for t in self.study.get_trials(deepcopy=False, states=FINISHED):
            row = recorded.get(t.number)
            adapter = t.user_attrs.get(attrs.ADAPTER_PATH)
            if row is None or row.state != t.state.name or (row.adapter_path is None and adapter is not None):
                self.store.upsert_trial(t.number, state=t.state.name, params=t.params, objective_values=t.values,
                                        user_attrs=dict(t.user_attrs), adapter_path=adapter)

    # -- reading ------------------------------------------------------------------------------
    def running(self) -> list[FrozenTrial]:
        return self.study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))

    def trials(self) -> list[FrozenTrial]:
        return self.study.get_trials(deepcopy=False)

    # -- heartbeats ---------------------------------------------------------------------------
    def trial_id(self, number: int) -> int:
        """The storage id of trial ``number`` (the storage's public lookup, cached)."""
        if number not in self._ids:
            self._ids[number] = self.storage.get_trial_id_from_study_id_trial_number(self._study_id, number)
        return self._ids[number]

    def beat(self, number: int) -> None:
        """Stamp trial ``number``'s heartbeat with the current time."""
        self.storage.set_trial_system_attr(self.trial_id(number), attrs.HEARTBEAT, time.time())

    def heartbeat(self, numbers: Callable[[], Iterable[int]], interval: float) -> Heartbeat:
        """A thread beating the trials ``numbers()`` names every ``interval`` seconds (``with`` it)."""
        return Heartbeat(self.beat, numbers, interval, self.log)


class Heartbeat:
    """A daemon thread that calls ``beat(number)`` for every trial ``numbers()`` returns."""

    def __init__(self, beat: Callable[[int], None], numbers: Callable[[], Iterable[int]], interval: float,
                 log: Callable[[str], None]) -> None:
        self.beat, self.numbers, self.interval, self.log = beat, numbers, interval, log
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="sweep-heartbeat", daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            for number in list(self.numbers()):
                try:
                    self.beat(number)
                except Exception as err:  # a trial finished meanwhile, or the storage blinked: retry next beat
                    if "finished" not in str(err):
                        self.log(f"heartbeat of trial {number} failed: {first_line(err)}")

    def __enter__(self) -> Heartbeat:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


# ---------------------------------------------------------------- creating or loading the study


def open_study(spec: StudySpec, sdir: StudyDir, sharing: Sharing | None = None,
               recorded: Mapping[int, Mapping[str, Any] | None] | None = None,
               log: Callable[[str], None] | None = None) -> tuple[optuna.Study, BaseStorage]:
    """Create the Optuna study of ``spec`` (with its community-default trial enqueued), or load it.

    Args:
        recorded: The trials the study directory records (``recorded_trials``): the storage must know each,
            with the same parameters, or nothing is created.
        log: Where opening the storage says what it repaired (a torn journal; default stderr).

    Returns:
        (the study, the storage object it was opened with).

    Raises:
        UserError: the storage cannot be opened, holds a study of this name with another search space
            or other objective directions, or does not know a trial the directory records.
    """
    url = storage_url(spec, sdir, sharing)
    alone = sharing is None and spec.storage is not None  # a run without workers over a storage outside its directory
    with ExitStack() as stack:  # one worker (or run) at a time creates the tables, the study and its default
        try:
            if sharing is not None or alone:
                stack.enter_context(storage_lock(url, spec.name))
            storage = open_storage(url, log)
        except Exception as err:  # SQLAlchemy raises many types for an unreachable or malformed URL
            raise unopenable(url, err) from err
        if alone:
            check_directory(storage, url, spec.name, sdir.root)
        worker = sharing.worker if sharing is not None else None
        study = _create(spec, storage, url, worker, sdir, recorded or {})
        if alone:
            claim_directory(study, sdir.root)
        return study, storage


def storage_url(spec: StudySpec, sdir: StudyDir, sharing: Sharing | None = None) -> str:
    """The Optuna storage of a run: the workers' shared one, the study's ``storage:`` (a plain ``*.log`` path is a
    journal file) or the study directory's own (``StudyDir.optuna_url``)."""
    return sharing.url if sharing is not None else normalize_url(spec.storage or sdir.optuna_url)


def space_fingerprint(spec: StudySpec) -> str:
    """The search space as a string: a resumed study must search the same one."""
    return json.dumps([[p.name, p.kind, p.low, p.high, p.log, p.step, [str(c) for c in p.choices]]
                       for p in spec.search.params], sort_keys=True)


def recorded_trials(store: ResultsStore, adapters: Path) -> dict[int, dict[str, Any] | None]:
    """Trial number -> parameters (None when only its adapter directory shows it) of every trial the
    study directory records: results.db's rows and the ``trial-<n>`` folders under ``adapters``."""
    out: dict[int, dict[str, Any] | None] = {r.number: r.params for r in store.trials()}
    for folder in adapters.glob("trial-*") if adapters.is_dir() else ():
        number = folder.name.removeprefix("trial-")
        if number.isdigit() and folder.is_dir():
            out.setdefault(int(number), None)
    return out


def _check_agreement(recorded: Mapping[int, Mapping[str, Any] | None], known: Mapping[int, FrozenTrial],
                     url: str, name: str, sdir: StudyDir) -> None:
    """Refuse a storage that does not know the trials the study directory records: a new study there would
    number its trials from 0 again and write their adapters over the recorded ones."""
    if not recorded:
        return
    unknown = sorted(set(recorded) - set(known))
    where = f"{sdir.root}: results.db and adapters/ record"
    fix = ("restore that storage, or start the study in another --out (its trials would overwrite the recorded "
           "adapters)")
    if len(unknown) == len(recorded):
        raise UserError(f"run: {where} {len(recorded)} trial(s) (#{min(recorded)}..#{max(recorded)}) but "
                        f"{redact_url(url)} holds {'them in no study' if not known else 'none of them'} named "
                        f"{name!r} (deleted, or storage:/name point elsewhere); {fix}")
    if unknown:
        raise UserError(f"run: {where} trial(s) #{', #'.join(map(str, unknown[:5]))} that study {name!r} in "
                        f"{redact_url(url)} does not know; {fix}")
    for number, params in recorded.items():
        theirs = known[number].params
        if params and theirs and any(k in theirs and theirs[k] != v for k, v in params.items()):
            raise UserError(f"run: {where} trial #{number} with other parameters than study {name!r} in "
                            f"{redact_url(url)} (another study of that name?); {fix}")


def _never_asked(storage: BaseStorage, name: str) -> bool:
    """Whether study ``name`` holds no trial beyond the WAITING ones it was created with."""
    study = optuna.load_study(study_name=name, storage=storage)
    return all(t.state == TrialState.WAITING for t in study.get_trials(deepcopy=False))


def _create(spec: StudySpec, storage: BaseStorage, url: str, worker: int | None, sdir: StudyDir,
            recorded: Mapping[int, Mapping[str, Any] | None]) -> optuna.Study:
    try:
        existing = [s.study_name for s in optuna.get_all_study_summaries(storage)]
    except Exception as err:  # SQLAlchemy raises many types for an unreachable or malformed URL
        raise unopenable(url, err) from err
    n_trials = 0
    if spec.name not in existing:
        _check_agreement(recorded, {}, url, spec.name, sdir)
    if spec.name in existing and worker is None and not recorded and _never_asked(storage, spec.name):
        # a run that failed before its first trial (a data error) leaves the study and its enqueued default:
        # the corrected rerun starts it anew, with its own search space (a shared study is left to its workers)
        optuna.delete_study(study_name=spec.name, storage=storage)
        existing.remove(spec.name)
    if spec.name in existing:
        old = optuna.load_study(study_name=spec.name, storage=storage)
        _check_agreement(recorded, {t.number: t for t in old.get_trials(deepcopy=False)}, url, spec.name, sdir)
        if old.user_attrs.get(attrs.SEARCH_SPACE) not in (None, space_fingerprint(spec)):
            raise UserError(f"study {spec.name!r} already exists in {redact_url(url)} with a different search space; "
                            f"give the study another name or output directory")
        if old.directions != [optuna.study.StudyDirection[d.upper()] for d in spec.directions]:
            raise UserError(f"study {spec.name!r} already exists in {redact_url(url)} with other objective directions")
        n_trials = len(old.trials)
    # Seeding by the trial count keeps a resumed random or TPE sampler from replaying its first proposals;
    # by the worker index, workers started together from proposing the same ones.
    sampler = make_sampler(spec.sampler, spec.seed + n_trials + 100_003 * (worker or 0), spec.search)
    study = optuna.create_study(study_name=spec.name, storage=storage, sampler=sampler,
                                directions=spec.directions, load_if_exists=True)
    if n_trials == 0:
        study.set_user_attr(attrs.SEARCH_SPACE, space_fingerprint(spec))
        with warnings.catch_warnings():  # "experimental since 3.2": it names the axes in optuna-dashboard
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            study.set_metric_names([o.metric for o in spec.objectives])
        default, no_default = community_default(spec.search, spec.train)
        if default is None:  # the report then measures the best against the config baseline, if there is one
            logger.warning("%s: no community-default trial: %s", spec.name, no_default)
        baseline, why = baseline_params(spec.search, spec.baseline) if spec.baseline else (None, "")
        if baseline is not None and baseline != default:  # the config's own hyperparameters, first
            study.enqueue_trial(baseline, user_attrs={attrs.BASELINE: True})
        if default is not None:  # the community default, so the report can show the gain over it
            same = {attrs.BASELINE: True} if baseline == default else {}
            study.enqueue_trial(default, user_attrs={attrs.DEFAULT: True, **same})
        if spec.baseline and baseline is None:
            logger.warning("%s: no baseline trial of the config's own hyperparameters: %s", spec.name, why)
    return study
