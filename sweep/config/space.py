"""The trials a study's ``SearchSpace`` defines: a trial's parameters as an AdapterSpec, the community default's
and a config's baseline trial as parameters of the space (Optuna's sampler and suggestions: ``sweep.sampling``).

Parameter names are the canonical names of ``sweep.config.spec.SEARCHABLE`` (``rank``, ``lr``, ``alpha_ratio``,
``targets``, ...); a searched ``targets`` takes target-set *names*, so ``trial.params`` stays a flat dict of scalars
that ``adapter_spec`` turns back into module tuples.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import fields
from typing import Any

from lora_sweep.errors import ConfigError
from lora_sweep.packer.api import AdapterSpec
from lora_sweep.sweep.config.spec import SEARCHABLE, Param, SearchSpace, TrainSpec

__all__ = ["adapter_spec", "baseline_params", "community_default", "default_params"]

_COMMUNITY = ("rank", "alpha", "alpha_ratio", "lr")
"""Dimensions whose default (rank 16, alpha 32, lr 2e-4) must lie in the space for a default trial."""


def adapter_spec(params: Mapping[str, Any], train: TrainSpec, seed: int, *, space: SearchSpace) -> AdapterSpec:
    """One trial's adapter: the fixed values of ``train`` overridden by the searched ``params``.

    Args:
        params: ``sweep.sampling.suggest(...)`` or ``FrozenTrial.params``.
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
