"""The searched dimensions of a study: ``Param`` and ``SearchSpace`` (re-exported by ``sweep.config.spec``).

Values are checked with each setting's own rules (``sweep.config.settings``: AdapterSpec's, for its fields), so a
range or a list of choices accepts exactly what an adapter accepts (rank 1..256, dropout in [0, 1), ...).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any, Literal, get_args, get_origin, get_type_hints

from lora_sweep.errors import ConfigError
from lora_sweep.sweep.config.settings import RANGED, SEARCHABLE, _check, _is_num, check_value, rule

__all__ = ["Param", "SearchSpace", "SEARCHABLE", "check_fields", "rule"]


def check_fields(obj: Any) -> None:
    """Check each field of dataclass ``obj``, in order: by its ``rule`` (``rule``), and a ``bool`` or ``Literal`` one
    against its annotation, where the closed set is declared (``cuda_graphs: Literal["auto", "on", "off"]``:
    "cuda_graphs: must be auto, on or off")."""
    hints = _hints(type(obj))
    for f in fields(obj):
        value, hint = getattr(obj, f.name), hints[f.name]
        if "rule" in f.metadata:
            _check(f.metadata["rule"][0](value), f.name, f.metadata["rule"][1], value)
        if hint is bool:
            _check(isinstance(value, bool), f.name, "must be true or false", value)
        elif get_origin(hint) is Literal:
            options = get_args(hint)
            either = f"one of {', '.join(options)}" if len(options) > 3 else " or ".join(
                [", ".join(options[:-1]), options[-1]])
            _check(value in options, f.name, f"must be {either}", value)


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return get_type_hints(cls)


@dataclass(frozen=True)
class Param:
    """One search dimension; ``name`` is a searchable train setting (``sweep.config.settings.SETTINGS``)."""

    name: str
    kind: Literal["float", "int", "categorical"]
    low: float | None = None
    high: float | None = None
    log: bool = False
    step: float | None = None
    choices: tuple[object, ...] = ()

    def __post_init__(self) -> None:
        _check(self.name in SEARCHABLE, "name", f"must be one of {', '.join(SEARCHABLE)}", self.name)
        _check(self.kind in ("float", "int", "categorical"), "kind", "must be float, int or categorical", self.kind)
        if self.kind == "categorical":
            _check(len(self.choices) > 0, "choices", "must not be empty", self.choices)
            _check(len(set(map(repr, self.choices))) == len(self.choices), "choices", "must be unique", self.choices)
            if self.name != "targets":
                for v in self.choices:
                    check_value(self.name, "choices", v)
            return
        if self.name not in RANGED:
            raise ConfigError("takes a list of values, not a range")
        for key in ("low", "high"):
            v = getattr(self, key)
            _check(_is_num(v) and (self.kind == "float" or isinstance(v, int)), key, f"must be a {self.kind}", v)
            check_value(self.name, key, v)
        assert self.low is not None and self.high is not None
        _check(self.low < self.high, "high", f"must be > low ({self.low})", self.high)
        _check(not self.log or self.low > 0, "low", "must be > 0 with log", self.low)
        if self.step is not None:
            _check(not self.log, "step", "cannot be combined with log", self.step)
            _check(_is_num(self.step) and self.step > 0, "step", "must be > 0", self.step)
            _check(self.kind == "float" or isinstance(self.step, int), "step", "must be an int", self.step)


@dataclass(frozen=True)
class SearchSpace:
    """The searched dimensions and the named target-module sets."""

    params: tuple[Param, ...]
    target_sets: Mapping[str, tuple[str, ...]] = field(default_factory=dict, hash=False)

    def __post_init__(self) -> None:
        names = [p.name for p in self.params]
        if not names:
            raise ConfigError("no parameter to search: add at least one range or list of values under search:")
        for n in names:
            _check(names.count(n) == 1, n, "searched twice", n)
        _check(
            not {"alpha", "alpha_ratio"} <= set(names),
            "alpha_ratio",
            "cannot search both alpha and alpha_ratio",
            "alpha",
        )
        for set_name, modules in self.target_sets.items():
            check_value("targets", f"targets.{set_name}", modules)
        if "targets" in names:
            for c in self.param("targets").choices:
                _check(c in self.target_sets, "targets", "unknown target set", c)

    def param(self, name: str) -> Param:
        """The dimension called ``name`` (KeyError if it is not searched)."""
        for p in self.params:
            if p.name == name:
                return p
        raise KeyError(name)

    def grid(self) -> dict[str, list[object]]:
        """Every value of every dimension, for ``GridSampler``.

        Raises:
            ConfigError: a dimension is a float range without ``step``.
        """
        out: dict[str, list[object]] = {}
        for p in self.params:
            if p.kind == "categorical":
                out[p.name] = list(p.choices)
            elif p.kind == "int":
                out[p.name] = list(range(int(p.low or 0), int(p.high or 0) + 1, int(p.step or 1)))
            else:
                _check(
                    p.step is not None,
                    p.name,
                    "grid sampler needs a list of values or a step, not a range",
                    f"{p.low}..{p.high}",
                )
                assert p.low is not None and p.high is not None and p.step is not None
                n = int(round((p.high - p.low) / p.step))
                out[p.name] = [p.low + i * p.step for i in range(n + 1)]
        return out
