"""The study's budget: trials, tokens and wall time, whichever ends first, and the tokens a trial plans.

A single run counts the budget itself (``budget_state`` over the counts of earlier runs and its own
training trials). Shared by several workers (``store.storage.Sharing``), the budget is counted in the
shared storage instead (``shared_budget``): each trial records its planned tokens when asked and its
trained tokens when told (``store.attrs``), and the wall time runs on the study's own clock
(``store.storage.study_elapsed``). A grid study ends with its grid, whatever its budget says.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Protocol

import optuna
from optuna.trial import FrozenTrial, TrialState

from lora_sweep.packer.api import data
from lora_sweep.store.api import DirectoryInUse, ResultsStore, StudyDir, attrs
from lora_sweep.store.storage import Sharing, open_storage, study_elapsed
from lora_sweep.sweep.config.spec import StudySpec
from lora_sweep.sweep.ledger import FINISHED, orphans, storage_url
from lora_sweep.sweep.sampling import GridSearch

__all__ = ["BudgetState", "Counts", "budget_state", "shared_budget", "counted", "TokenPlan", "end_line",
           "recorded_budget"]


@dataclass(frozen=True)
class BudgetState:
    exhausted: bool
    reason: str = ""
    key: str = ""
    """The spent budget's study key (``budget.trials``); '' for a spent grid, which no key extends."""


class Counts(Protocol):
    """What a run has counted so far (``sweep.session.Session``)."""

    @property
    def study(self) -> optuna.Study: ...

    sharing: Sharing | None
    finished: int
    """Trials that count against the budget (finished, orphans excluded)."""
    tokens: int
    """Tokens trained by the trials told so far (earlier runs' and this run's)."""
    elapsed: float
    """Wall seconds of earlier runs."""


def budget_state(spec: StudySpec, s: Counts, *, live: int, elapsed: float, live_tokens: int,
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


def recorded_budget(spec: StudySpec, log: Callable[[str], None]) -> BudgetState | None:
    """The budget of the study ``spec.out_dir`` holds, read from its storage and results.db before any model loads
    (under the directory's lock), so a finished study's rerun says so at once; None when the directory holds no
    study (or one this cannot read, or another run owns it: the run itself then says what is wrong). Opening the
    storage sets a torn journal record aside, said on ``log`` (``store.storage.open_storage``)."""
    sdir = StudyDir(spec.out_dir)
    if not sdir.is_study():
        return None
    try:
        lock = sdir.acquire()
    except (DirectoryInUse, OSError):
        return None
    if (line := lock.took_over()) is not None:  # said here: the run's own take finds the lock released
        log(line)
    try:
        study = optuna.load_study(study_name=spec.name, storage=open_storage(storage_url(spec, sdir), log))
        with ResultsStore(sdir.results_db, create=False) as store:
            tokens, elapsed = sum(r.tokens or 0 for r in store.trials()), float(store.meta().get("elapsed", 0.0))
        counts = SimpleNamespace(study=study, sharing=None, finished=len(counted(study.get_trials(deepcopy=False))),
                                 tokens=tokens, elapsed=elapsed)
        return budget_state(spec, counts, live=0, elapsed=0.0, live_tokens=0)
    except Exception:  # noqa: BLE001 (a damaged or missing storage: the run's own checks name it)
        return None
    finally:
        lock.release()


def shared_budget(spec: StudySpec, study: optuna.Study, *, mine: Collection[int] = (),
                  live_tokens: int = 0) -> BudgetState:
    """``budget_state`` of a study workers share, counted in its storage (the caller holds its lock).

    Trials count when finished or RUNNING, orphans (trials with a retry) excepted. A finished trial
    counts the tokens it trained; a RUNNING trial of another worker counts its planned tokens, the
    most it can train, since its progress reaches the storage only when it is told: so no worker
    starts a trial once the tokens trained by all workers reach the budget, and the overshoot stays
    what one worker's pack allows alone. This worker's own training trials (``mine``) count
    ``live_tokens``, their tokens so far, as in a single run. The wall time is the study's clock
    (``store.storage.study_elapsed``).
    """
    trials = counted(study.get_trials(deepcopy=False), running=True)
    tokens = live_tokens + sum(_tokens_of(t) for t in trials if t.number not in mine)
    elapsed = study_elapsed(study) if spec.budget.wall_time is not None else 0.0
    return _grid_spent(spec, study) or _against(spec, len(trials), tokens, elapsed)


def counted(trials: Sequence[FrozenTrial], *, running: bool = False) -> list[FrozenTrial]:
    """The trials that count against the budget: finished (and, with ``running``, RUNNING), orphans excluded."""
    retried = orphans(trials)
    states = (*FINISHED, TrialState.RUNNING) if running else FINISHED
    return [t for t in trials if t.state in states and t.number not in retried]


def _tokens_of(trial: FrozenTrial) -> int:
    # A trial asked or told by an older version has no attr: it counts nothing, as it did then.
    key = attrs.PLANNED_TOKENS if trial.state == TrialState.RUNNING else attrs.TOKENS
    return int(trial.user_attrs.get(key, 0))


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


def end_line(spec: StudySpec, state: BudgetState, *, trials: int, tokens: int, elapsed: float) -> tuple[str, bool]:
    """The one line that says which budget ended a run, what was used against its limit; and whether the run
    went over it.

    A budget stops the asking; the trials training when it is reached run to their end, so the wall time and
    the tokens can end above their limits (and, with workers sharing a study, the trials too): the line says
    by how much.

    Args:
        state: The exhausted budget (``budget_state``).
        trials: Trials counted against the budget, earlier runs' included.
        tokens: Tokens trained by them.
        elapsed: Wall seconds of the study, earlier runs' included.
    """
    b = spec.budget
    if not state.key:
        return f"finished: {state.reason} were all tried", False
    used: dict[str, tuple[float, float | None, str]] = {
        "budget.trials": (trials, b.trials, "{:,.0f} trials"),
        "budget.tokens": (tokens, b.tokens, "{:,.0f} tokens"),
        "budget.wall_time": (elapsed, b.wall_time, "{:,.1f} s"),
    }
    value, limit, unit = used[state.key]
    text = f"stopped: {state.key} reached: {unit.format(value)} used of {unit.format(limit)}"
    over = limit is not None and value > limit
    if over:
        text += (f" (OVER by {unit.format(value - limit)}: the trials training when it was reached ran to their "
                 f"end)")
    return text, over


class TokenPlan:
    """Planned tokens: the target tokens a trial trains when it runs all its steps.

    Every trial draws its micro-batches from the same seeded order (``SlotStream``), so a full trial's
    tokens are known when it is asked: the loss tokens (labels after the causal shift, as the training
    loop counts them) of its first ``max_steps`` micro-batches. A pruned or failed trial trains fewer.
    """

    def __init__(self, examples: Sequence[data.Example], seed: int) -> None:
        self.examples, self.seed = examples, seed
        self._per_example: dict[int, int] = {}
        self._planned: dict[tuple[int, int], int] = {}

    def __call__(self, micro_batch: int, max_steps: int) -> int:
        key = (micro_batch, max_steps)
        if key not in self._planned:
            stream = data.SlotStream(self.examples, micro_batch, seed=self.seed)
            self._planned[key] = sum(self._targets(e) for _ in range(max_steps) for e in stream.next_batch())
        return self._planned[key]

    def _targets(self, example: data.Example) -> int:
        # Counted once per example drawn (not over the whole data set), keyed by identity: the stream
        # hands out the very objects of ``examples``, which stay alive as long as it does.
        n = self._per_example.get(id(example))
        if n is None:
            n = self._per_example[id(example)] = data.target_tokens(example)
        return n
