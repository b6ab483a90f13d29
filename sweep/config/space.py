"""A study's ``SearchSpace`` in Optuna terms: suggestions, samplers, the default trial, AdapterSpecs.

Optuna parameter names are the canonical names of ``sweep.config.spec.SEARCHABLE`` (``rank``, ``lr``,
``alpha_ratio``, ``targets``, ...); a searched ``targets`` takes target-set *names*, so
``trial.params`` stays a flat dict of scalars that ``adapter_spec`` turns back into module tuples.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import fields
from typing import Any

import optuna
from optuna.distributions import BaseDistribution
from optuna.trial import FrozenTrial, TrialState

from lora_sweep.errors import ConfigError
from lora_sweep.packer.api import AdapterSpec
from lora_sweep.sweep.config.spec import SEARCHABLE, Param, SamplerSpec, SearchSpace, TrainSpec

__all__ = ["GridSearch", "adapter_spec", "baseline_params", "community_default", "default_params", "make_sampler",
           "suggest"]

_COMMUNITY = ("rank", "alpha", "alpha_ratio", "lr")
"""Dimensions whose default (rank 16, alpha 32, lr 2e-4) must lie in the space for a default trial."""


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


def adapter_spec(params: Mapping[str, Any], train: TrainSpec, seed: int, *, space: SearchSpace) -> AdapterSpec:
    """One trial's adapter: the fixed values of ``train`` overridden by the searched ``params``.

    Args:
        params: ``suggest(...)`` or ``FrozenTrial.params``.
        train: The study's fixed values.
        seed: The adapter's seed (initialisation, data order, dropout).
        space: The study's search space (resolves target-set names).

    Returns:
        The AdapterSpec; ``alpha = alpha_ratio * rank`` when ``alpha_ratio`` is searched or fixed.

    Raises:
        ConfigError: An unknown parameter name or target set, or a value AdapterSpec rejects.
    """
    values = dict(params)
    for name, value in values.items():
        if name not in SEARCHABLE:
            raise ConfigError(f"{name}: not an adapter hyperparameter (got {value!r})")
    t = values.get("targets")
    if isinstance(t, str):
        if t not in space.target_sets:
            raise ConfigError(f"targets: unknown target set (got {t!r})")
        values["targets"] = tuple(space.target_sets[t])
    elif t is not None:
        values["targets"] = tuple(t)
    return AdapterSpec(seed=seed, **dataclasses.replace(train, **values).adapter_values())  # type: ignore[arg-type]


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


def default_params(space: SearchSpace, clamp: bool = False) -> dict[str, object] | None:
    """The community default trial (rank 16, alpha 32, lr 2e-4: AdapterSpec's defaults) inside ``space``.

    Each searched value starts from AdapterSpec's default and snaps to the nearest choice or step. The
    community defaults (rank, alpha or alpha_ratio, lr) must lie within their dimension's span; the
    others are clamped into it. Non-numeric values not among the choices take the first choice (a
    target set equal to the default targets is preferred). Enqueue it first with
    ``study.enqueue_trial(params)`` so the searched points are ranked against the default.

    Args:
        space: The study's search space.
        clamp: Clamp the community defaults into their spans too (never None: the baseline's other dimensions).

    Returns:
        Parameter name -> value, or None if rank, alpha, alpha_ratio or lr has its default outside the space.
    """
    base = AdapterSpec()
    want: dict[str, Any] = {f.name: getattr(base, f.name) for f in fields(base)} | {
        "alpha_ratio": base.alpha / base.rank
    }
    out: dict[str, object] = {}
    for p in space.params:
        if p.name == "targets":
            same = [n for n in p.choices if space.target_sets[str(n)] == base.targets]
            out[p.name] = (same or list(p.choices))[0]
            continue
        value = _snap(p, want[p.name], clamp=clamp or p.name not in _COMMUNITY)
        if value is None:
            return None
        out[p.name] = value
    return out


def community_default(space: SearchSpace, train: TrainSpec) -> tuple[dict[str, object] | None, str]:
    """``default_params``, or (None, why) when that trial would not train the community default: the study fixes
    one of its rank, alpha or lr otherwise (a torchtune config's ``lora_alpha: 128`` beside a searched rank), and a
    trial labelled the community default would train the config's value."""
    base = AdapterSpec()
    default = f"rank {base.rank}, alpha {base.alpha:g}, lr {base.lr:g}"
    params = default_params(space)
    if params is None:
        return None, f"the community default ({default}) lies outside the search space"
    searched = {p.name for p in space.params} | ({"alpha"} if any(p.name == "alpha_ratio" for p in space.params)
                                                 else set())
    trained = adapter_spec(params, train, 0, space=space)
    off = [f"{k} {getattr(trained, k):g}" for k in ("rank", "alpha", "lr")
           if k not in searched and not math.isclose(getattr(trained, k), getattr(base, k))]
    if off:
        return None, f"the study fixes {', '.join(off)} (the community default trains {default})"
    return params, ""


def baseline_params(space: SearchSpace, own: Mapping[str, Any]) -> tuple[dict[str, object] | None, str]:
    """The baseline trial: ``own`` values (a config's hyperparameters, by train field) on the searched dimensions,
    the community default's (``default_params``, clamped into the space) on the others.

    Returns:
        (parameter name -> value, '') or (None, why there is none: no searched value set, or one outside
        the space; an enqueued value must be one the space can draw).
    """
    own = dict(own)
    if "alpha_ratio" in {p.name for p in space.params} and "alpha_ratio" not in own and "alpha" in own:
        own["alpha_ratio"] = own["alpha"] / own["rank"] if own.get("rank") else None  # alpha = alpha_ratio * rank
    if not any(p.name in own for p in space.params):
        return None, "it sets none of the searched dimensions"
    out = default_params(space, clamp=True) or {}
    for p in space.params:
        if p.name not in own:
            continue
        value = _own_point(space, p, own[p.name])
        if value is None:
            return None, f"its {p.name}={own[p.name]!r} lies outside search.{p.name}"
        out[p.name] = value
    return out, ""


def _own_point(space: SearchSpace, p: Param, x: Any) -> object | None:
    """``x`` as a value of dimension ``p`` (a target set by its name), or None when the space cannot draw it."""
    if p.name == "targets":
        modules = (x,) if isinstance(x, str) else tuple(x)
        return next((n for n in p.choices if set(space.target_sets[str(n)]) == set(modules)), None)
    if p.kind == "categorical":
        return next((c for c in p.choices if c == x), None)
    if isinstance(x, bool) or not isinstance(x, int | float) or p.low is None or p.high is None:
        return None
    if not p.low <= x <= p.high or (p.step is not None and not math.isclose((x - p.low) / p.step,
                                                                             round((x - p.low) / p.step))):
        return None
    return int(x) if p.kind == "int" else float(x)


def _snap(p: Param, x: Any, clamp: bool) -> object | None:
    """``x`` moved onto dimension ``p``; None if it lies outside ``p``'s span and ``clamp`` is False."""
    if p.kind == "categorical":
        if x in p.choices:
            return next(c for c in p.choices if c == x)
        nums = [c for c in p.choices if isinstance(c, int | float) and not isinstance(c, bool)]
        if not nums or isinstance(x, bool) or not isinstance(x, int | float):
            return p.choices[0]
        if not clamp and not min(nums) <= x <= max(nums):  # type: ignore[type-var]
            return None
        return min(nums, key=lambda c: abs(math.log(c / x)) if c > 0 and x > 0 else abs(c - x))  # type: ignore[operator]
    assert p.low is not None and p.high is not None
    if not clamp and not p.low <= x <= p.high:
        return None
    x = min(max(x, p.low), p.high)
    if p.step is not None:
        x = min(p.low + round((x - p.low) / p.step) * p.step, p.high)
    return int(round(x)) if p.kind == "int" else float(x)
