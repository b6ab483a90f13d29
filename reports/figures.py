"""The report's own figures, each a pure ``_x_info(data) -> NamedTuple`` and a ``plot_x(info) -> go.Figure``.

Pareto front (2-D scatter, or a scatter matrix for three or more objectives), per-trial learning curves with
prune markers, and the cohort pruner's decisions. Optuna's own plots are in ``reports/_optuna.py``, the
pack timeline in ``reports/timeline.py``.
"""

from __future__ import annotations

import html
import math
from typing import Any, NamedTuple

import plotly.graph_objects as go

from lora_sweep.reports._fmt import fmt
from lora_sweep.reports._load import StudyData, objective_values, pareto_numbers

__all__ = ["ParetoInfo", "CurvesInfo", "PruneInfo", "_pareto_info", "_curves_info", "_eval_curves_info", "_prune_info",
           "plot_pareto", "plot_curves", "plot_prunes", "STATE_COLORS"]

STATE_COLORS = {"COMPLETE": "#1f77b4", "PRUNED": "#ff7f0e", "FAIL": "#d62728", "RUNNING": "#2ca02c",
                "WAITING": "#7f7f7f"}


def _num(v: Any) -> float | None:
    """A finite float, or None (plotly draws a gap)."""
    return float(v) if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) else None


def _hover(title: str, *groups: dict[str, Any]) -> str:
    lines = [f"<b>{html.escape(title)}</b>"]
    for g in groups:
        lines += [f"{html.escape(str(k))}: {html.escape(fmt(v))}" for k, v in g.items()]
    return "<br>".join(lines)


# ---------------------------------------------------------------- Pareto front


class ParetoPoint(NamedTuple):
    number: int
    values: list[float]
    front: bool
    default: bool
    hover: str


class ParetoInfo(NamedTuple):
    objectives: list[str]
    directions: list[str]
    points: list[ParetoPoint]
    skipped: int
    """Complete trials left out for a missing or non-finite objective value."""


def _pareto_info(data: StudyData) -> ParetoInfo:
    n = len(data.objectives)
    front = set(pareto_numbers(data.trials, data.directions))
    points, skipped = [], 0
    for t in data.complete:
        vals = objective_values(t, n)
        if vals is None:
            skipped += 1
            continue
        default = t.is_default
        title = f"trial {t.number}{' (default)' if default else ''}{' · Pareto' if t.number in front else ''}"
        metrics = {k: v for k, v in (t.metrics or {}).items() if k not in data.objectives}
        hover = _hover(title, dict(zip(data.objectives, vals, strict=True)), t.params or {}, metrics)
        points.append(ParetoPoint(t.number, vals, t.number in front, default, hover))
    return ParetoInfo(list(data.objectives), list(data.directions), points, skipped)


def plot_pareto(info: ParetoInfo) -> go.Figure:
    """Two objectives: scatter with the front joined; three or more: a scatter matrix. Hover: params, metrics."""
    labels = [f"{o} ({'↓' if d == 'minimize' else '↑'})" for o, d in zip(info.objectives, info.directions,
                                                                           strict=True)]
    groups = [("Pareto front", [p for p in info.points if p.front and not p.default], "#d62728", "circle"),
              ("dominated", [p for p in info.points if not p.front and not p.default], "#9aa5b1", "circle"),
              ("default trial", [p for p in info.points if p.default], "#2ca02c", "star")]
    fig = go.Figure()
    if len(info.objectives) == 2:
        front = sorted((p for p in info.points if p.front), key=lambda p: p.values[0],
                       reverse=info.directions[0] == "maximize")  # best first: the staircase is 'hv'
        fig.add_trace(go.Scatter(x=[p.values[0] for p in front], y=[p.values[1] for p in front], mode="lines",
                                 line={"shape": "hv", "width": 1, "dash": "dot", "color": "#d62728"},
                                 hoverinfo="skip", showlegend=False))
        for name, pts, color, symbol in groups:
            if pts:
                fig.add_trace(go.Scatter(x=[p.values[0] for p in pts], y=[p.values[1] for p in pts], name=name,
                                         mode="markers", marker={"color": color, "size": 14 if symbol == "star" else 10,
                                                                 "symbol": symbol},
                                         hovertext=[p.hover for p in pts], hoverinfo="text"))
        fig.update_layout(xaxis_title=labels[0], yaxis_title=labels[1])
    else:
        for name, pts, color, symbol in groups:
            if pts:
                fig.add_trace(go.Splom(dimensions=[{"label": lab, "values": [p.values[i] for p in pts]}
                                                   for i, lab in enumerate(labels)],
                                       name=name, marker={"color": color, "size": 8, "symbol": symbol},
                                       hovertext=[p.hover for p in pts], hoverinfo="text", diagonal_visible=False))
        fig.update_layout(height=250 * len(labels))
    fig.update_layout(title="Pareto front (★ = default trial)", hovermode="closest", template="plotly_white")
    return fig


# ---------------------------------------------------------------- learning curves


class Curve(NamedTuple):
    number: int
    state: str
    steps: list[int]
    losses: list[float | None]
    prune_step: int | None
    """Trial step of the rung that pruned it, None if not pruned by the cohort pruner."""
    prune_loss: float | None
    reason: str | None


class CurvesInfo(NamedTuple):
    curves: list[Curve]
    max_points: int


def _curves_info(data: StudyData, max_points: int = 400) -> CurvesInfo:
    pruned_at = {d.trial: d.rung_step for d in data.prunes if d.decision == "prune"}
    curves = []
    for t in data.trials:
        rows = data.curves.get(t.number, [])
        stride = max(1, math.ceil(len(rows) / max_points))
        kept = rows[::stride] + ([rows[-1]] if rows and (len(rows) - 1) % stride else [])
        by_step = {r.step: r.loss for r in rows}
        ps = pruned_at.get(t.number) if t.state == "PRUNED" else None  # the default is ranked, never stopped
        near = max((s for s in by_step if ps is not None and s <= ps), default=None)
        curves.append(Curve(t.number, t.state or "?", [r.step for r in kept], [_num(r.loss) for r in kept], ps,
                            _num(by_step.get(near)) if near is not None else None, t.reason))
    return CurvesInfo(curves, max_points)


def _eval_curves_info(data: StudyData, metric: str = "eval_loss") -> CurvesInfo:
    """Held-out loss per trial at its ``train.eval_every`` steps (the store's 'curve' evaluations)."""
    points: dict[int, list[tuple[int, float | None]]] = {}
    for e in data.eval_curves:
        if e.metric == metric:
            points.setdefault(e.trial, []).append((e.step, _num(e.value)))
    curves = [Curve(t.number, t.state or "?", [s for s, _ in points[t.number]], [v for _, v in points[t.number]],
                    None, None, t.reason) for t in data.trials if t.number in points]
    return CurvesInfo(curves, max(map(len, points.values()), default=0))


def plot_curves(info: CurvesInfo, *, title: str = "Training loss per trial", y: str = "training loss",
                mode: str = "lines") -> go.Figure:
    """Loss per trial step; one trace per state (lines separated by gaps), ✕ where a trial was pruned."""
    fig = go.Figure()
    for state in sorted({c.state for c in info.curves}):
        xs: list[int | None] = []
        ys: list[float | None] = []
        texts: list[str] = []
        for c in (c for c in info.curves if c.state == state and c.steps):
            xs += [*c.steps, None]
            ys += [*c.losses, None]
            texts += [f"trial {c.number} ({state.lower()})"] * len(c.steps) + [""]
        if xs:
            fig.add_trace(go.Scatter(x=xs, y=ys, mode=mode, name=state.lower(), text=texts,
                                     line={"width": 1, "color": STATE_COLORS.get(state, "#444")},
                                     hovertemplate="%{text}<br>step %{x}<br>loss %{y:.4g}<extra></extra>"))
    pruned = [c for c in info.curves if c.prune_step is not None]
    if pruned:
        fig.add_trace(go.Scatter(x=[c.prune_step for c in pruned], y=[c.prune_loss for c in pruned], mode="markers",
                                 name="pruned here", marker={"symbol": "x", "size": 9, "color": "#000"},
                                 text=[f"trial {c.number}: {c.reason or 'pruned'}" for c in pruned],
                                 hovertemplate="%{text}<extra></extra>"))
    fig.update_layout(title=title, xaxis_title="trial step", yaxis_title=y,
                      template="plotly_white", hovermode="closest")
    return fig


# ---------------------------------------------------------------- prune decisions


class PruneInfo(NamedTuple):
    rung_steps: list[int]
    values: list[float | None]
    decisions: list[str]
    texts: list[str]


def _prune_info(data: StudyData) -> PruneInfo:
    rows = sorted(data.prunes, key=lambda d: (d.rung_step, d.pack_id, d.rank or 0, d.trial))
    return PruneInfo([d.rung_step for d in rows], [_num(d.value) for d in rows], [d.decision for d in rows],
                     [f"trial {d.trial} · pack {d.pack_id} · rank {fmt(d.rank)} of {fmt(d.cohort_size)}<br>"
                      f"{html.escape(d.reason or '')}" for d in rows])


def plot_prunes(info: PruneInfo) -> go.Figure:
    """Rung value of each trial at each rung, kept or pruned; hover gives the pruner's reason."""
    fig = go.Figure()
    for decision, color in (("keep", "#1f77b4"), ("prune", "#ff7f0e")):
        idx = [i for i, d in enumerate(info.decisions) if d == decision]
        fig.add_trace(go.Scatter(x=[info.rung_steps[i] for i in idx], y=[info.values[i] for i in idx],
                                 mode="markers", name=decision, marker={"color": color, "size": 9, "opacity": 0.8},
                                 text=[info.texts[i] for i in idx], hovertemplate="%{text}<extra></extra>"))
    fig.update_layout(title="Cohort pruner decisions at each rung", xaxis_title="rung (trial step)",
                      yaxis_title="rung value (pruning proxy)", template="plotly_white", hovermode="closest")
    return fig
