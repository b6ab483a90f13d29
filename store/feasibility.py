"""Which trials count as the best: constraint feasibility and the one Pareto front every view shows."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from lora_sweep.store.schema import TrialRecord

__all__ = ["constraint_violation", "is_feasible", "pareto_front", "constraint_text", "best_trials"]


def constraint_violation(op: str, bound: float, x: Any) -> float:
    """Optuna's constraint value of metric value ``x`` against ``op bound``: feasible iff <= 0.

    A missing (None) or non-finite value violates by inf in both directions: a trial that did not
    measure the metric, or measured NaN, has not shown that it meets the bound.
    """
    if x is None or isinstance(x, bool) or not isinstance(x, int | float) or not math.isfinite(x):
        return math.inf
    return float(x) - bound if op == "<=" else bound - float(x)


def is_feasible(metrics: Mapping[str, Any] | None, constraints: Iterable[Mapping[str, Any]]) -> bool:
    """Whether ``metrics`` meet every constraint (``{metric, op, value}`` as in the ``constraints`` meta key)."""
    return all(constraint_violation(c["op"], float(c["value"]), (metrics or {}).get(c["metric"])) <= 0
               for c in constraints)


def pareto_front(points: Iterable[tuple[int, Sequence[float]]], directions: Sequence[str]) -> list[int]:
    """The keys of the points that no other point dominates, in input order: the one Pareto front that the
    status, the export, the run's summary and the report all show.

    Args:
        points: (trial number, its objective values), finite values only, one per direction.
        directions: ``minimize`` or ``maximize`` per objective.
    """
    signs = [1.0 if d == "minimize" else -1.0 for d in directions]
    pts = [(n, [s * v for s, v in zip(signs, vals, strict=True)]) for n, vals in points]

    def dominates(a: list[float], b: list[float]) -> bool:
        return all(x <= y for x, y in zip(a, b, strict=True)) and a != b

    return [n for n, v in pts if not any(dominates(w, v) for _, w in pts)]


def best_trials(complete: Sequence[TrialRecord], directions: Sequence[str], constraints: Sequence[Mapping[str, Any]],
                feasible: bool = True) -> list[TrialRecord]:
    """The trials of ``complete`` on the Pareto front of ``directions`` (one trial, or ties, for one objective), as
    Optuna's ``study.best_trials``; with ``feasible``, among those meeting ``constraints`` when any does (Optuna's
    rule for constrained studies). Trials without a finite value per objective are left out."""
    done = [t for t in complete if t.objective_values and len(t.objective_values) == len(directions)
            and all(v is not None and math.isfinite(v) for v in t.objective_values)]
    if feasible and constraints and any(is_feasible(t.metrics, constraints) for t in done):
        done = [t for t in done if is_feasible(t.metrics, constraints)]
    front = set(pareto_front([(t.number, [float(v) for v in t.objective_values or []]) for t in done], directions))
    return [t for t in done if t.number in front]


def constraint_text(c: Mapping[str, Any]) -> str:
    """``metric <= value`` of one constraint."""
    return f"{c['metric']} {c['op']} {c['value']:g}"

