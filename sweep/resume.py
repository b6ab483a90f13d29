"""Open a study directory: create it, or resume it after a stop or a crash.

The Optuna storage is the source of truth. Trials it still holds as RUNNING belong to a run that
died (a kill loses at most the in-flight work): they are told FAIL, marked ``orphaned`` in the
results store and their parameters enqueued again, so the constant-liar sampler does not avoid
their region forever and the budget counts stay exact (an orphan does not count, its retry does).

Shared by several workers (``sweep.storage.Sharing``), a RUNNING trial may belong to a live worker:
only trials whose heartbeat is older than the grace period are orphans (``reap_stale``), and the
budget is counted in the shared storage rather than by this process (``shared_budget``): each trial
records its planned tokens when asked and its trained tokens when told, and the wall time runs on
the study's own clock (``sweep.storage.resume_clock``).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
import warnings
from collections.abc import Callable, Collection, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import optuna
import yaml
from optuna.trial import TrialState

from packer.checkpoint import discard_adapter
from packer.data import Example, SlotStream
from packer.errors import UserError
from packer.gguf import gguf_source
from packer.model import PackedModel, load_base, resolve_base
from packer.train import target_tokens
from sweep.space import GridSearch, default_params, make_sampler
from sweep.spec import StudySpec
from sweep.storage import Sharing, last_beat, open_storage, resume_clock, storage_lock, study_elapsed
from sweep.store import (
    DirectoryInUse,
    DirectoryLock,
    ResultsStore,
    StudyDir,
    pareto_front,
    redact_url,
    strip_password,
)

__all__ = ["Session", "open_session", "budget_state", "shared_budget", "BudgetState", "ORPHAN_REASON",
           "own_directory", "reap_stale", "requeue", "spec_changes", "spec_record", "resolve_device", "TokenPlan",
           "TOKENS_ATTR", "PLANNED_ATTR"]

ORPHAN_REASON = "orphaned: the run stopped while this trial trained; its parameters were enqueued again"
TOKENS_ATTR = "tokens"
"""Trial user attr: the target tokens the trial trained (set when it is told)."""
PLANNED_ATTR = "planned_tokens"
"""Trial user attr: the target tokens the trial trains if it runs all its steps (set when it is asked)."""
_FINISHED = (TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL)


@dataclass
class Session:
    """Everything one ``sweep run`` works with."""

    spec: StudySpec
    sdir: StudyDir
    store: ResultsStore
    study: optuna.Study
    pm: PackedModel
    tokenizer: Any
    capacity: int
    pad_id: int
    base: str
    """What the base model was loaded from and adapters name as ``base_model_name_or_path``: ``model.path``, or
    a GGUF source's cached checkpoint directory."""
    finished: int = 0
    """Trials that count against the budget (finished, orphans excluded)."""
    tokens: int = 0
    """Tokens trained by the trials told so far (earlier runs' and this run's)."""
    elapsed: float = 0.0
    """Wall seconds of earlier runs."""
    completed: list[tuple[int, list[float]]] = field(default_factory=list)
    sharing: Sharing | None = None
    """Set when other workers share the study: the budget is then counted in the storage."""
    lock: DirectoryLock | None = None
    """The study directory's lock, held until ``close`` (None for a worker of a shared study)."""

    def adapter_dir(self, number: int) -> Path:
        """``trial_adapter_dir`` of this session's study."""
        return trial_adapter_dir(self.spec, self.sdir, number)

    def rung_history(self, metric: str) -> dict[int, dict[int, float]]:
        """{rung: {trial: value}} of ``metric`` from earlier runs, so pruning continues where it was."""
        out: dict[int, dict[int, float]] = {}
        for row in self.store.evals(kind="rung"):
            if row.metric == metric:
                out.setdefault(row.step, {})[row.trial] = math.nan if row.value is None else row.value
        return out

    def finished_count(self) -> int:
        return self.finished

    def best_text(self) -> str:
        if not self.completed:
            return "-"
        objectives = self.spec.objectives
        if len(objectives) == 1:
            sign = 1 if objectives[0].direction == "minimize" else -1
            number, values = min(self.completed, key=lambda c: sign * c[1][0])
            return f"#{number} {objectives[0].metric}={values[0]:.4g}"
        return f"{len(pareto_front(self.completed, [o.direction for o in objectives]))} on the Pareto front"

    def record(self, number: int, state: TrialState, values: list[float] | None, tokens: int = 0) -> None:
        """Count a trial this run told: against the trial budget, and its trained tokens against the token budget."""
        self.finished += 1
        self.tokens += tokens
        if state == TrialState.COMPLETE and values is not None:
            self.completed.append((number, values))

    def add_elapsed(self, seconds: float) -> None:
        self.store.set_meta(elapsed=self.elapsed + seconds)

    def close(self) -> None:
        self.store.close()
        if self.lock is not None:
            self.lock.release()


@dataclass(frozen=True)
class BudgetState:
    exhausted: bool
    reason: str = ""
    key: str = ""
    """The spent budget's study key (``budget.trials``); '' for a spent grid, which no key extends."""


def budget_state(spec: StudySpec, s: Session, *, live: int, elapsed: float, live_tokens: int,
                 mine: Collection[int] = ()) -> BudgetState:
    """Whether another trial may start: whichever budget ends first.

    Each budget stops the asking once reached: a trial starts while the trials counted (finished and
    training), the tokens trained (by finished trials and so far by training ones) and the wall seconds
    are all below their budgets; the trials already training then finish. Shared with other workers,
    the counts come from the storage (``shared_budget``).

    Args:
        live: Trials training in this run.
        elapsed: Wall seconds of this run.
        live_tokens: Tokens this run's training trials trained so far.
        mine: Numbers of this run's training trials (shared studies: their ``live_tokens`` replace
            their planned tokens).
    """
    if s.sharing is not None:
        return shared_budget(spec, s.study, mine=mine, live_tokens=live_tokens)
    return _grid_spent(spec, s.study) or _against(spec, s.finished + live, s.tokens + live_tokens, s.elapsed + elapsed)


def _grid_spent(spec: StudySpec, study: optuna.Study) -> BudgetState | None:
    """A grid study ends with its grid, whatever its budget says (``GridSearch.left``)."""
    if spec.sampler.name != "grid":
        return None
    grid = GridSearch(spec.search.grid())
    return BudgetState(True, f"the grid's {grid.size} points") if grid.left(study) == 0 else None


def _against(spec: StudySpec, trials: int, tokens: int, elapsed: float) -> BudgetState:
    b = spec.budget
    if b.trials is not None and trials >= b.trials:
        return BudgetState(True, f"{b.trials} trials", "budget.trials")
    if b.tokens is not None and tokens >= b.tokens:
        return BudgetState(True, f"{b.tokens} tokens", "budget.tokens")
    if b.wall_time is not None and elapsed >= b.wall_time:
        return BudgetState(True, f"{b.wall_time:.0f} s of wall time", "budget.wall_time")
    return BudgetState(False)


def shared_budget(spec: StudySpec, study: optuna.Study, *, mine: Collection[int] = (),
                  live_tokens: int = 0) -> BudgetState:
    """``budget_state`` of a study workers share, counted in its storage (the caller holds its lock).

    Trials count when finished or RUNNING, orphans (trials with a retry) excepted. A finished trial
    counts the tokens it trained; a RUNNING trial of another worker counts its planned tokens, the
    most it can train, since its progress reaches the storage only when it is told: so no worker
    starts a trial once the tokens trained by all workers reach the budget, and the overshoot stays
    what one worker's pack allows alone. This worker's own training trials (``mine``) count
    ``live_tokens``, their tokens so far, as in a single run. The wall time is the study's clock
    (``sweep.storage.study_elapsed``).
    """
    trials = _counted(study)
    tokens = live_tokens + sum(_tokens_of(t) for t in trials if t.number not in mine)
    elapsed = study_elapsed(study) if spec.budget.wall_time is not None else 0.0
    return _grid_spent(spec, study) or _against(spec, len(trials), tokens, elapsed)


def _tokens_of(trial: optuna.trial.FrozenTrial) -> int:
    # A trial asked or told by an older version has no attr: it counts nothing, as it did then.
    attr = PLANNED_ATTR if trial.state == TrialState.RUNNING else TOKENS_ATTR
    return int(trial.user_attrs.get(attr, 0))


def _counted(study: optuna.Study) -> list[optuna.trial.FrozenTrial]:
    """Trials of the shared storage that count against the budget: finished or RUNNING, orphans excluded."""
    trials = study.get_trials(deepcopy=False)
    orphans = _orphans(trials)
    return [t for t in trials if t.state in (*_FINISHED, TrialState.RUNNING) and t.number not in orphans]


def _orphans(trials: Sequence[optuna.trial.FrozenTrial]) -> set[int]:
    """Numbers of the trials that were retried (another trial's ``retry_of``): they no longer count."""
    return {t.user_attrs["retry_of"] for t in trials if "retry_of" in t.user_attrs}


class TokenPlan:
    """Planned tokens: the target tokens a trial trains when it runs all its steps.

    Every trial draws its micro-batches from the same seeded order (``SlotStream``), so a full trial's
    tokens are known when it is asked: the loss tokens (labels after the causal shift, as the training
    loop counts them) of its first ``max_steps`` micro-batches. A pruned or failed trial trains fewer.
    """

    def __init__(self, examples: Sequence[Example], seed: int) -> None:
        self.examples, self.seed = examples, seed
        self._per_example: dict[int, int] = {}
        self._planned: dict[tuple[int, int], int] = {}

    def __call__(self, micro_batch: int, max_steps: int) -> int:
        key = (micro_batch, max_steps)
        if key not in self._planned:
            stream = SlotStream(self.examples, micro_batch, seed=self.seed)
            self._planned[key] = sum(self._targets(e) for _ in range(max_steps) for e in stream.next_batch())
        return self._planned[key]

    def _targets(self, example: Example) -> int:
        # Counted once per example drawn (not over the whole data set), keyed by identity: the stream
        # hands out the very objects of ``examples``, which stay alive as long as it does.
        n = self._per_example.get(id(example))
        if n is None:
            n = self._per_example[id(example)] = target_tokens(example)
        return n


def _space_fingerprint(spec: StudySpec) -> str:
    return json.dumps([[p.name, p.kind, p.low, p.high, p.log, p.step, [str(c) for c in p.choices]]
                       for p in spec.search.params], sort_keys=True)


def _optuna_study(spec: StudySpec, sdir: StudyDir, sharing: Sharing | None = None) -> optuna.Study:
    if sharing is None:
        return _create(spec, spec.storage or sdir.optuna_url, spec.storage or sdir.optuna_url, 0)
    with ExitStack() as stack:  # one worker at a time creates the tables, the study and its default trial
        try:
            stack.enter_context(storage_lock(sharing.url, spec.name))
            storage = open_storage(sharing.url)
        except Exception as err:  # SQLAlchemy raises many types for an unreachable or malformed URL
            raise _unopenable(sharing.url, err) from err
        return _create(spec, storage, sharing.url, sharing.worker)


def _unopenable(url: str, err: Exception) -> UserError:
    """The one-line error for a storage that cannot be opened: its URL and the first line of the cause
    (its type when it has no message)."""
    text = str(err).strip()
    cause = text.splitlines()[0] if text else type(err).__name__
    password = make_url_password(url)
    if password:  # a driver may quote the DSN back
        cause = cause.replace(password, "***")
    return UserError(f"storage: cannot open {redact_url(url)!r}: {cause}")


def make_url_password(url: str) -> str | None:
    """The password in an RDB URL, if any (None for journal paths and URLs without one)."""
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    try:
        return make_url(url).password  # type: ignore[return-value]
    except ArgumentError:
        return None


def _create(spec: StudySpec, storage: Any, url: str, worker: int) -> optuna.Study:
    try:
        existing = [s.study_name for s in optuna.get_all_study_summaries(storage)]
    except Exception as err:  # SQLAlchemy raises many types for an unreachable or malformed URL
        raise _unopenable(url, err) from err
    n_trials = 0
    if spec.name in existing:
        old = optuna.load_study(study_name=spec.name, storage=storage)
        if old.user_attrs.get("search_space") not in (None, _space_fingerprint(spec)):
            raise UserError(f"study {spec.name!r} already exists in {redact_url(url)} with a different search space; "
                            f"give the study another name or output directory")
        if old.directions != [optuna.study.StudyDirection[d.upper()] for d in spec.directions]:
            raise UserError(f"study {spec.name!r} already exists in {redact_url(url)} with other objective directions")
        n_trials = len(old.trials)
    # Seeding by the trial count keeps a resumed random or TPE sampler from replaying its first proposals;
    # by the worker index, workers started together from proposing the same ones.
    sampler = make_sampler(spec.sampler, spec.seed + n_trials + 100_003 * worker, spec.search)
    study = optuna.create_study(study_name=spec.name, storage=storage, sampler=sampler,
                                directions=spec.directions, load_if_exists=True)
    if n_trials == 0:
        study.set_user_attr("search_space", _space_fingerprint(spec))
        with warnings.catch_warnings():  # "experimental since 3.2": it names the axes in optuna-dashboard
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            study.set_metric_names([o.metric for o in spec.objectives])
        default = default_params(spec.search)
        if default is not None:  # the community default, so the report can show the gain over it
            study.enqueue_trial(default, user_attrs={"default": True})
    return study


def trial_adapter_dir(spec: StudySpec, sdir: StudyDir, number: int) -> Path:
    """Where trial ``number``'s adapter goes: ``artifacts/trial-<n>``, or the study directory's."""
    if spec.artifacts is not None:
        return (spec.artifacts / f"trial-{number}").absolute()
    return sdir.adapter_dir(number)


def requeue(study: optuna.Study, store: ResultsStore, orphans: Sequence[optuna.trial.FrozenTrial | optuna.Trial],
            log: Callable[[str], None], adapters: Callable[[int], Path], reason: str = ORPHAN_REASON) -> None:
    """Fail RUNNING trials and enqueue each again with its parameters (``retry_of``: not counted)."""
    for t in orphans:
        study.tell(t.number, state=TrialState.FAIL)
        store.upsert_trial(t.number, state="FAIL", reason=reason)
        discard_adapter(adapters(t.number))  # saved but never told, or half written; its retry has its own number
        attrs = {"retry_of": t.number, **({"default": True} if t.user_attrs.get("default") else {})}
        # Killed before or between its suggests, a trial has drawn some parameters or none: its retry
        # keeps those, draws the rest, and still takes its place in the budget.
        study.enqueue_trial(t.params, user_attrs=attrs)
        log(f"trial {t.number} was left RUNNING by a stopped run: failed and enqueued again")


def reap_stale(study: optuna.Study, store: ResultsStore, grace: float, log: Callable[[str], None],
               adapters: Callable[[int], Path]) -> list[int]:
    """Fail and re-enqueue the RUNNING trials of dead workers (no heartbeat for ``grace`` seconds), and
    remove what they left of their adapters (``adapters``: trial number -> its adapter directory).

    The caller holds the storage lock, so two survivors never retry the same orphan.
    """
    now = time.time()
    stale = [t for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)) if now - last_beat(t) > grace]
    requeue(study, store, stale, log, adapters)
    return [t.number for t in stale]


def _recover(study: optuna.Study, store: ResultsStore, log: Callable[[str], None],
             adapters: Callable[[int], Path]) -> None:
    """Fail and re-enqueue orphaned RUNNING trials; bring the results store in line with Optuna."""
    requeue(study, store, study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)), log, adapters)
    _sync(study, store)


def _sync(study: optuna.Study, store: ResultsStore) -> None:
    """Copy finished trials other runs (or workers on other hosts) recorded only in Optuna."""
    recorded = {r.number: r for r in store.trials()}
    for t in study.get_trials(deepcopy=False, states=_FINISHED):
        row = recorded.get(t.number)
        if row is None or row.state != t.state.name or (row.adapter_path is None and "adapter_path" in t.user_attrs):
            store.upsert_trial(t.number, state=t.state.name, params=t.params, objective_values=t.values,
                               user_attrs=dict(t.user_attrs), adapter_path=t.user_attrs.get("adapter_path"))


def _capacity(spec: StudySpec, pm: PackedModel, log: Callable[[str], None]) -> int:
    if spec.packing.max_slots != "auto":
        return int(spec.packing.max_slots)
    from sweep.planning import auto_slots

    n = auto_slots(spec, pm)
    log(f"packing: auto -> {n} slots")
    return n


RESUMABLE = ("budget", "output", "description", "packing", "model.device", "artifacts", "storage", "evaluators")
"""Spec keys a resumed study may change: how long, where, and how it runs, not what a trial is.
(Evaluators only add metrics to later trials; the objectives themselves are fixed.)"""


def spec_record(spec: StudySpec) -> dict[str, Any]:
    """The resolved spec as plain data (JSON and YAML): paths absolute, search dimensions by name,
    the storage URL without its password (``redact_url``)."""
    d = dataclasses.asdict(spec)
    d.pop("source", None)
    search = d.pop("search")
    d["search"] = {p.pop("name"): p for p in search["params"]} | {"target_sets": search["target_sets"]}
    if d.get("storage"):
        d["storage"] = strip_password(d["storage"])
    return json.loads(json.dumps(d, default=str))


def _flat(d: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(d, dict):
        return {prefix: d}
    out: dict[str, Any] = {}
    for k, v in d.items():
        out |= _flat(v, f"{prefix}.{k}" if prefix else str(k))
    return out


def spec_changes(earlier: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """'key changed (old -> new)' for each fixed setting (not under ``RESUMABLE``) that differs."""
    a, b = _flat(earlier), _flat(now)
    keys = [k for k in dict.fromkeys([*a, *b]) if a.get(k) != b.get(k)
            and not any(k == r or k.startswith(r + ".") for r in RESUMABLE)]
    return [f"{k} changed ({json.dumps(a.get(k))} -> {json.dumps(b.get(k))})" for k in keys]


def resolve_device(device: str) -> str:
    """``model.device`` as a torch device: ``auto`` picks CUDA when visible.

    Raises:
        UserError: ``cuda`` or ``cuda:N`` is asked for and no such CUDA device is visible.
    """
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise UserError(f"model.device: {device}, but no CUDA device is visible (torch {torch.__version__}, "
                            f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}); "
                            f"use device: auto or cpu")
        index = int(device.partition(":")[2] or 0)
        if index >= torch.cuda.device_count():
            raise UserError(f"model.device: {device}, but only {torch.cuda.device_count()} CUDA device(s) are visible")
    return device


def open_session(spec: StudySpec, *, log: Callable[[str], None] = print, sharing: Sharing | None = None,
                 allow_changes: bool = False) -> Session:
    """Create or resume the study in ``spec.out_dir`` and load the base model once.

    With ``sharing`` the study lives in a storage other workers use too: only stale RUNNING trials
    are orphans, and the budget is counted there. The resolved spec is recorded in the store (meta
    ``spec``) and the directory (``study.yaml``); resumed, a changed fixed setting (``spec_changes``)
    is an error unless ``allow_changes``.
    """
    optuna.logging.set_verbosity(optuna.logging.WARNING)  # our progress and store say what happened
    device = resolve_device(spec.model.device)  # before anything is created: a user error leaves no trace
    sdir = StudyDir(spec.out_dir)
    lock = None if sharing is not None else own_directory(sdir, log)
    try:
        return _open(spec, sdir, device, log, sharing, lock, allow_changes)
    except BaseException:
        if lock is not None:
            lock.release()
        raise


def own_directory(sdir: StudyDir, log: Callable[[str], None], storage: str | None = None) -> DirectoryLock:
    """Take the study directory's lock for this run (workers of a shared study take none: their
    launcher holds it, and the storage's own lock orders them). ``storage``: the shared storage of a
    ``sweep run --workers``, recorded (without its password) so ``sweep run --join`` can join it.

    Raises:
        UserError: another live process holds it.
    """
    try:
        lock = sdir.acquire(**({"storage": strip_password(storage)} if storage else {}))
    except DirectoryInUse as err:
        join = " or join it with --join" if err.holder.get("storage") else ""
        raise UserError(f"run: {err}; wait for it to end{join} (a second run would fail its running trials)") from None
    if lock.taken_over:
        log(f"took over {sdir.lock} from pid {lock.taken_over.get('pid', '?')} on host "
            f"{lock.taken_over.get('host', '?')}, which ended without releasing it")
    return lock


def _open(spec: StudySpec, sdir: StudyDir, device: str, log: Callable[[str], None], sharing: Sharing | None,
          lock: DirectoryLock | None, allow_changes: bool) -> Session:
    from sweep.planning import check_targets

    # a GGUF source becomes its cached checkpoint directory: what every load, adapter and export names
    base = resolve_base(spec.model.path, spec.model.gguf_file, log=log)
    model, tokenizer = load_base(base, dtype=spec.model.dtype, device=device, quantize=spec.model.quantize)
    check_targets(spec, model)  # before the study is created: a target set the model lacks fails no trial
    sdir.create()
    store = ResultsStore(sdir.results_db)
    record = spec_record(spec)
    earlier = store.meta().get("spec")
    changed = [] if earlier is None else spec_changes(earlier, record)
    if changed and not allow_changes:
        raise UserError(f"run: {changed[0]} since the study started"
                        f"{f' (and {len(changed) - 1} more)' if len(changed) > 1 else ''}; a resumed study keeps its "
                        f"fixed settings: give the same overrides again, or pass --allow-changes")
    for change in changed:
        log(f"resuming with {change} (--allow-changes)")
    store.set_meta(spec=record)
    sdir.write_study_yaml("# The resolved study this directory's last run used (overrides and aliases applied).\n"
                          + yaml.safe_dump(record, sort_keys=False))
    study = _optuna_study(spec, sdir, sharing)
    adapters = partial(trial_adapter_dir, spec, sdir)
    if sharing is None:
        _recover(study, store, log, adapters)
    url = sharing.url if sharing is not None else spec.storage or sdir.optuna_url
    gguf = gguf_source(spec.model.path, spec.model.gguf_file)
    store.set_meta(name=spec.name, storage=strip_password(url), model=base,
                   **({"model_source": str(gguf)} if gguf else {}), data=str(spec.data.train),
                   objectives=[o.metric for o in spec.objectives], directions=spec.directions,
                   constraints=[c.as_dict() for c in spec.constraints])
    pm = PackedModel(model, impl=spec.packing.kernels, fused_base_ops=spec.packing.fused_base_ops)
    if sharing is not None:
        with storage_lock(sharing.url, spec.name):  # the clock first: reaping makes dead trials' ends recent
            resume_clock(study, sharing.grace, earlier=float(store.meta().get("elapsed", 0.0)))
            reap_stale(study, store, sharing.grace, log, adapters)
        _sync(study, store)
    trials = study.get_trials(deepcopy=False)
    orphans = _orphans(trials)
    session = Session(spec, sdir, store, study, pm, tokenizer, _capacity(spec, pm, log),
                      pad_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id,
                      base=base,
                      finished=sum(1 for t in trials if t.state in _FINISHED and t.number not in orphans),
                      tokens=sum(r.tokens or 0 for r in store.trials()),
                      elapsed=float(store.meta().get("elapsed", 0.0)),
                      completed=[(t.number, list(t.values)) for t in trials if t.state == TrialState.COMPLETE],
                      sharing=sharing, lock=lock)
    return session
