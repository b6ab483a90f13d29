"""Pack figures: which trial sat in which slot when (backfills visible), and each pack's throughput and memory.

Both are ``_x_info(data) -> NamedTuple`` + ``plot_x(info) -> go.Figure`` pairs, read from the ``slot_spans``
and ``packs`` tables.
"""

from __future__ import annotations

import html
from typing import NamedTuple

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from lora_sweep.reports._fmt import fmt
from lora_sweep.reports._load import StudyData

__all__ = ["TimelineInfo", "Span", "PacksInfo", "_timeline_info", "_packs_info", "plot_timeline", "plot_packs"]

# end_reason -> colour; the engine writes 'finished' / 'stopped', the schema also names 'complete' / 'pruned'.
_REASON_COLORS = {"finished": "#1f77b4", "complete": "#1f77b4", "stopped": "#ff7f0e", "pruned": "#ff7f0e",
                  "failed": "#d62728", "oom": "#d62728", "training": "#2ca02c"}


class Span(NamedTuple):
    pack_id: int
    slot: int
    trial: int
    start: int
    end: int
    reason: str
    """end_reason, or 'training' while the trial is still in its slot."""
    backfill: bool
    """The trial entered its slot after the pack started (it refilled a freed slot)."""
    hover: str


class TimelineInfo(NamedTuple):
    spans: list[Span]
    rows: list[str]
    """y-axis labels, one per (pack, slot), in order."""


def _timeline_info(data: StudyData) -> TimelineInfo:
    last_step = {p.pack_id: p.steps for p in data.packs}
    params = {t.number: t.params or {} for t in data.trials}
    spans = []
    for s in data.spans:
        start = s.start_step or 0
        end = s.end_step if s.end_step is not None else max(last_step.get(s.pack_id) or start, start)
        reason = s.end_reason or "training"
        pars = ", ".join(f"{k}={fmt(v)}" for k, v in params.get(s.trial, {}).items())
        hover = (f"<b>trial {s.trial}</b> · pack {s.pack_id} slot {s.slot}<br>pack steps {start}–{end} "
                 f"({reason}{', backfill' if start > 0 else ''})<br>{html.escape(pars)}")
        spans.append(Span(s.pack_id, s.slot, s.trial, start, end, reason, start > 0, hover))
    rows = sorted({(s.pack_id, s.slot) for s in spans})
    return TimelineInfo(spans, [f"pack {p} · slot {s}" for p, s in rows])


def plot_timeline(info: TimelineInfo) -> go.Figure:
    """One bar per slot span (x: pack steps), coloured by how the trial left; hatched bars are backfills."""
    fig = go.Figure()
    for reason in sorted({s.reason for s in info.spans}):
        spans = [s for s in info.spans if s.reason == reason]
        fig.add_trace(go.Bar(orientation="h", base=[s.start for s in spans],
                             x=[max(s.end - s.start, 0.5) for s in spans],
                             y=[f"pack {s.pack_id} · slot {s.slot}" for s in spans], name=reason,
                             text=[f"#{s.trial}" for s in spans], textposition="inside", insidetextanchor="middle",
                             marker={"color": _REASON_COLORS.get(reason, "#7f7f7f"),
                                     "line": {"color": "#fff", "width": 1},
                                     "pattern": {"shape": ["/" if s.backfill else "" for s in spans]}},
                             hovertext=[s.hover for s in spans], hoverinfo="text"))
    fig.update_layout(title="Pack timeline: trials per slot (hatched = backfill)", barmode="overlay",
                      xaxis_title="pack step", template="plotly_white",
                      yaxis={"categoryorder": "array", "categoryarray": list(reversed(info.rows))},
                      height=max(300, 140 + 34 * len(info.rows)))
    return fig


class PacksInfo(NamedTuple):
    labels: list[str]
    tokens_per_s: list[float | None]
    peak_mib: list[float | None]
    hovers: list[str]


def _packs_info(data: StudyData) -> PacksInfo:
    packs = data.packs
    return PacksInfo([f"pack {p.pack_id}" for p in packs], [p.tokens_per_s for p in packs],
                     [p.peak_mem_bytes / 2**20 if p.peak_mem_bytes is not None else None for p in packs],
                     [f"<b>pack {p.pack_id}</b> ({fmt(p.status)}, {fmt(p.device)})<br>{fmt(p.slots)} slots, "
                      f"{fmt(p.steps)} steps, {fmt(p.tokens)} tokens in {fmt(p.wall_s)} s, the {fmt(p.step)} step"
                      for p in packs])


def plot_packs(info: PacksInfo) -> go.Figure:
    """Tokens/s and peak device memory of each pack (memory is not measured on CPU)."""
    fig = make_subplots(rows=1, cols=2, subplot_titles=("training tokens/s", "peak device memory (MiB)"))
    fig.add_trace(go.Bar(x=info.labels, y=info.tokens_per_s, hovertext=info.hovers, hoverinfo="text+y",
                         name="tokens/s", marker_color="#1f77b4"), row=1, col=1)
    fig.add_trace(go.Bar(x=info.labels, y=info.peak_mib, hovertext=info.hovers, hoverinfo="text+y",
                         name="peak MiB", marker_color="#9467bd"), row=1, col=2)
    if all(v is None for v in info.peak_mib):
        fig.add_annotation(text="not measured (CPU packs)", xref="x2 domain", yref="y2 domain", x=0.5, y=0.5,
                           showarrow=False)
    fig.update_layout(title="Packs", showlegend=False, template="plotly_white", height=320)
    return fig
