"""The study's strategy, as validated config objects: what it optimises (objectives, constraints), how
trials are proposed and stopped (sampler, cohort pruning), and when the study ends (budget).

Part of the study file's dataclasses (``sweep.config.spec`` re-exports them: ``from sweep.config.spec import Budget``);
they validate themselves in ``__post_init__`` and raise ``ConfigError("key: rule (got value)")``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Literal

from lora_sweep.errors import ConfigError
from lora_sweep.sweep.config._params import _check, _is_num, check_fields, rule

__all__ = ["Objective", "Constraint", "Budget", "PruningSpec", "SamplerSpec"]

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
"""A metric or study name."""


@dataclass(frozen=True)
class Objective:
    """One optimisation target."""

    metric: str = rule(lambda v: bool(_NAME.fullmatch(v)), "must be a metric name")
    direction: Literal["minimize", "maximize"]

    def __post_init__(self) -> None:
        check_fields(self)


@dataclass(frozen=True)
class Constraint:
    """A soft constraint ``metric <= value`` or ``metric >= value`` (Optuna ``set_constraint``)."""

    metric: str = rule(lambda v: bool(_NAME.fullmatch(v)), "must be a metric name")
    op: Literal["<=", ">="]
    value: float = rule(_is_num, "must be a number")

    def __post_init__(self) -> None:
        check_fields(self)

    def violation(self, x: float | None) -> float:
        """Optuna's constraint value for metric value ``x``: feasible iff <= 0; a missing or non-finite
        ``x`` is infeasible in both directions (``store.feasibility.constraint_violation``)."""
        from lora_sweep.store.api import constraint_violation  # sqlite_utils: not on the path of a spec's load

        return constraint_violation(self.op, self.value, x)

    def as_dict(self) -> dict[str, Any]:
        """The form the results store keeps (meta key ``constraints``)."""
        return {"metric": self.metric, "op": self.op, "value": float(self.value)}


@dataclass(frozen=True)
class Budget:
    """When the study stops: whichever limit is reached first (at least one)."""

    trials: int | None = None
    wall_time: float | None = None
    tokens: int | None = None

    def __post_init__(self) -> None:
        if all(v is None for v in (self.trials, self.wall_time, self.tokens)):
            raise ConfigError("set at least one of trials, wall_time, tokens")
        for key in ("trials", "wall_time", "tokens"):
            v = getattr(self, key)
            _check(v is None or (_is_num(v) and v > 0), key, "must be > 0", v)


@dataclass(frozen=True)
class PruningSpec:
    """Cohort successive halving among the trials of one pack, at fixed rung steps."""

    kind: Literal["none", "cohort_sha"] = "none"
    rungs: tuple[int, ...] = ()
    reduction_factor: int = 3
    proxy: str | None = None
    proxy_direction: Literal["minimize", "maximize"] = "minimize"

    def __post_init__(self) -> None:
        check_fields(self)
        if self.kind == "none":
            _check(not self.rungs, "rungs", "only used with kind cohort_sha", self.rungs)
            return
        _check(len(self.rungs) > 0, "rungs", "cohort_sha needs at least one rung step", self.rungs)
        _check(all(isinstance(r, int) and r >= 1 for r in self.rungs), "rungs", "must be steps >= 1", self.rungs)
        _check(list(self.rungs) == sorted(set(self.rungs)), "rungs", "must be increasing", self.rungs)
        _check(
            isinstance(self.reduction_factor, int) and self.reduction_factor >= 2,
            "reduction_factor",
            "must be an int >= 2",
            self.reduction_factor,
        )
        _check(self.proxy is None or bool(_NAME.fullmatch(self.proxy)), "proxy", "must be a metric name", self.proxy)


@dataclass(frozen=True)
class SamplerSpec:
    """Optuna sampler; TPE always runs with ``constant_liar=True, multivariate=True``."""

    name: Literal["tpe", "random", "grid", "gp", "nsga2"] = "tpe"
    n_startup_trials: int | None = None
    population_size: int | None = None

    def __post_init__(self) -> None:
        check_fields(self)
        n, pop = self.n_startup_trials, self.population_size
        _check(n is None or self.name in ("tpe", "gp"), "n_startup_trials", "only used by tpe and gp", n)
        _check(n is None or (isinstance(n, int) and n >= 0), "n_startup_trials", "must be >= 0", n)
        _check(pop is None or self.name == "nsga2", "population_size", "only used by nsga2", pop)
        _check(pop is None or (isinstance(pop, int) and pop >= 2), "population_size", "must be >= 2", pop)
