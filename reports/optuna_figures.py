"""Figures that ``optuna.visualization`` already draws: optimisation history, parameter importances and
parallel coordinates, one of each per objective, from the study in the Optuna storage the store records.

``_optuna_info`` is the pure part (which targets to draw); each ``plot_x(study, target)`` calls Optuna.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

import plotly.graph_objects as go

from lora_sweep.reports._load import StudyData

__all__ = ["Target", "OptunaInfo", "_optuna_info", "plot_history", "plot_importances", "plot_parallel"]


class Target(NamedTuple):
    idx: int
    """Position of the objective."""
    name: str
    direction: str
    multi: bool
    """The study has several objectives: Optuna then needs an explicit ``target``."""


class OptunaInfo(NamedTuple):
    targets: list[Target]
    n_complete: int


def _optuna_info(data: StudyData) -> OptunaInfo:
    multi = len(data.objectives) > 1
    targets = [Target(i, m, d, multi) for i, (m, d) in enumerate(zip(data.objectives, data.directions, strict=True))]
    return OptunaInfo(targets, len(data.complete))


def _target(t: Target, *, lower_is_better: bool = False) -> Callable[[Any], float] | None:
    if not t.multi:
        return None  # Optuna uses the study's direction
    sign = -1.0 if lower_is_better and t.direction == "maximize" else 1.0
    return lambda trial: sign * trial.values[t.idx]


def _quiet(fn: Callable[..., go.Figure], *args: Any, **kwargs: Any) -> go.Figure:
    from optuna.exceptions import ExperimentalWarning

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ExperimentalWarning)
        warnings.simplefilter("ignore", UserWarning)  # PED-ANOVA: "computes the importances ... low target"
        return fn(*args, **kwargs)


def plot_history(study: Any, t: Target) -> go.Figure:
    from optuna.visualization import plot_optimization_history

    fig = _quiet(plot_optimization_history, study, target=_target(t), target_name=t.name)
    if t.multi:  # Optuna draws the best-so-far line only for single-objective studies
        best = min if t.direction == "minimize" else max
        xs: list[int] = []
        ys: list[float] = []
        for trial in sorted((tr for tr in study.trials if tr.values is not None), key=lambda tr: tr.number):
            v = trial.values[t.idx]
            ys.append(v if not ys else best(ys[-1], v))
            xs.append(trial.number)
        fig.add_trace(go.Scatter(x=xs, y=ys, mode="lines", name="Best Value", line={"shape": "hv"}))
    numbers = [tr.number for tr in study.trials]
    # trials are whole numbers: ticks at integers only (plotly's automatic ticks put 0.5 between two trials)
    fig.update_xaxes(tickmode="linear", tick0=0, dtick=max(1, -(-(max(numbers, default=0) + 1) // 10)),
                     title="trial")
    return fig.update_layout(title=f"Optimisation history: {t.name} ({t.direction})", template="plotly_white")


def plot_importances(study: Any, t: Target) -> go.Figure:
    """PED-ANOVA importances (Optuna's default); a maximised objective is negated, as the evaluator ranks low values."""
    from optuna.visualization import plot_param_importances

    fig = _quiet(plot_param_importances, study, target=_target(t, lower_is_better=True), target_name=t.name)
    return fig.update_layout(title=f"Parameter importances for {t.name}", template="plotly_white")


def plot_parallel(study: Any, t: Target) -> go.Figure:
    from optuna.visualization import plot_parallel_coordinate

    fig = _quiet(plot_parallel_coordinate, study, target=_target(t), target_name=t.name)
    return fig.update_layout(title=f"Parallel coordinates: {t.name}", template="plotly_white")
