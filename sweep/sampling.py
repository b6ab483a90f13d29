"""The study's Optuna side of its search space: the sampler a ``sampler:`` section names, the grid sampler of an
ask-and-tell study, and one trial's suggestions (``sweep.config.space`` turns them into an AdapterSpec).

Optuna parameter names are the canonical names of ``sweep.config.spec.SEARCHABLE``; a searched ``targets`` is
suggested by target-set *name*, so ``trial.params`` stays a flat dict of scalars.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Mapping, Sequence
from typing import Any

import optuna
from optuna.distributions import BaseDistribution
from optuna.trial import FrozenTrial, TrialState

from lora_sweep.sweep.config.spec import SamplerSpec, SearchSpace

__all__ = ["GridSearch", "make_sampler", "suggest"]


def suggest(trial: optuna.Trial, space: SearchSpace) -> dict[str, object]:
    """Ask ``trial`` for one value per dimension of ``space``.

    Args:
        trial: A trial from ``study.ask()``.
        space: The study's search space.

    Returns:
        Parameter name -> value, equal to ``trial.params`` (target sets by name).
    """
    out: dict[str, object] = {}
    for p in space.params:
        if p.kind == "categorical":
            out[p.name] = trial.suggest_categorical(p.name, list(p.choices))  # type: ignore[arg-type]
        elif p.kind == "int":
            step = int(p.step or 1)
            out[p.name] = trial.suggest_int(p.name, int(p.low or 0), int(p.high or 0), step=step, log=p.log)
        else:
            out[p.name] = trial.suggest_float(p.name, float(p.low or 0), float(p.high or 0), step=p.step, log=p.log)
    return out


def make_sampler(spec: SamplerSpec, seed: int, space: SearchSpace) -> optuna.samplers.BaseSampler:
    """The study's Optuna sampler.

    TPE gets ``constant_liar=True, multivariate=True`` explicitly (the 5.0 defaults, not 4.9's), so
    the trials of one pack, asked together while all are RUNNING, do not crowd one region.

    Raises:
        ConfigError: ``grid`` over a space with a continuous dimension.
    """
    startup: dict[str, Any] = {} if spec.n_startup_trials is None else {"n_startup_trials": spec.n_startup_trials}
    if spec.name == "tpe":
        return optuna.samplers.TPESampler(seed=seed, multivariate=True, constant_liar=True, **startup)
    if spec.name == "gp":
        return optuna.samplers.GPSampler(seed=seed, **startup)
    if spec.name == "grid":
        return GridSearch(space.grid(), seed=seed)
    if spec.name == "nsga2":
        pop: dict[str, Any] = {} if spec.population_size is None else {"population_size": spec.population_size}
        return optuna.samplers.NSGAIISampler(seed=seed, **pop)
    return optuna.samplers.RandomSampler(seed=seed)


class GridSearch(optuna.samplers.BaseSampler):
    """Every point of a grid once, in a seeded random order, for ask-and-tell studies.

    Optuna's ``GridSampler`` fits ``Study.optimize`` only: its ``after_trial`` calls ``study.stop()``,
    which raises outside ``optimize``, once the grid is spent, and looks up a ``grid_id`` that an
    enqueued trial (the community default, a retry) never gets, so it raises ``KeyError``. Here a
    point is taken by any trial that drew it, enqueued ones included: the default's point is not run
    again, and ``left`` tells the budget when the grid is spent (``sweep.budget.budget_state``).
    A point is assigned when a trial starts and read back by each of its suggestions, so the whole
    ask + suggest must happen before the next ask (shared studies do both under the storage lock).
    """

    def __init__(self, grid: Mapping[str, Sequence[Any]], seed: int = 0) -> None:
        self._names = sorted(grid)
        self._points = list(itertools.product(*(grid[n] for n in self._names)))
        random.Random(seed).shuffle(self._points)  # a budget below the grid's size samples it without bias
        self._assigned: dict[int, tuple[Any, ...]] = {}

    @property
    def size(self) -> int:
        """Points in the grid."""
        return len(self._points)

    def _taken(self, study: optuna.Study) -> set[tuple[Any, ...]]:
        states = (TrialState.RUNNING, TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL)
        return {tuple(t.params[n] for n in self._names) for t in study.get_trials(deepcopy=False, states=states)
                if all(n in t.params for n in self._names)}

    def left(self, study: optuna.Study) -> int:
        """Points no trial has drawn yet, plus the trials enqueued and not yet started (retries)."""
        taken = self._taken(study)
        waiting = len(study.get_trials(deepcopy=False, states=(TrialState.WAITING,)))
        return sum(1 for p in self._points if p not in taken) + waiting

    def before_trial(self, study: optuna.Study, trial: FrozenTrial) -> None:
        taken = self._taken(study)
        free = [p for p in self._points if p not in taken]
        # Spent (a retry drawing its missing parameters, or a caller ignoring ``left``): any point will do.
        self._assigned[trial.number] = free[0] if free else self._points[trial.number % len(self._points)]

    def infer_relative_search_space(self, study: optuna.Study, trial: FrozenTrial) -> dict[str, BaseDistribution]:
        return {}

    def sample_relative(self, study: optuna.Study, trial: FrozenTrial,
                        search_space: dict[str, BaseDistribution]) -> dict[str, Any]:
        return {}

    def sample_independent(self, study: optuna.Study, trial: FrozenTrial, param_name: str,
                           param_distribution: BaseDistribution) -> Any:
        return self._assigned[trial.number][self._names.index(param_name)]

    def after_trial(self, study: optuna.Study, trial: FrozenTrial, state: TrialState,
                    values: Sequence[float] | None) -> None:
        self._assigned.pop(trial.number, None)
