"""The report's tables: every trial (sortable, with its adapter path) and every prune decision with its reason."""

from __future__ import annotations

import html
import os
from pathlib import Path
from typing import Any, NamedTuple

from lora_sweep.reports._fmt import esc, fmt, table
from lora_sweep.reports._load import StudyData

__all__ = ["TrialRow", "TrialTableInfo", "_trial_table_info", "render_trial_table", "render_prune_table",
           "render_samples"]


class TrialRow(NamedTuple):
    number: int
    state: str
    default: bool
    objectives: list[float | None]
    metrics: dict[str, Any]
    params: dict[str, Any]
    steps: int | None
    tokens: int | None
    device_s: float | None
    pack_slot: str
    adapter: str | None
    """Adapter path as stored (relative to the study directory)."""
    adapter_href: str | None
    """The adapter directory relative to the report file, when it exists."""
    reason: str | None
    feasible: bool | None = None
    """Whether a complete trial meets the constraints; None without constraints or for unfinished trials."""
    baseline: bool = False
    """The trial of the config's own hyperparameters (``TrialRecord.is_baseline``)."""


class TrialTableInfo(NamedTuple):
    objectives: list[str]
    metric_names: list[str]
    param_names: list[str]
    rows: list[TrialRow]


def _trial_table_info(data: StudyData, report_dir: Path) -> TrialTableInfo:
    n = len(data.objectives)
    # the table has columns of its own for a trial's tokens and device seconds: not twice
    shown = {*data.objectives, "train_tokens", "device_seconds"}
    metric_names = sorted({k for t in data.trials for k in (t.metrics or {})} - shown)
    param_names = list(dict.fromkeys(k for t in data.trials for k in (t.params or {})))
    rows = []
    for t in data.trials:
        vals = list(t.objective_values or [])
        vals = (vals + [None] * n)[:n]
        href = None
        if t.adapter_path and (data.root / t.adapter_path).is_dir():
            href = Path(os.path.relpath((data.root / t.adapter_path).resolve(), report_dir.resolve())).as_posix()
        rows.append(TrialRow(t.number, t.state or "?", t.is_default, vals,
                             dict(t.metrics or {}), dict(t.params or {}), t.steps_done, t.tokens, t.device_seconds,
                             f"{fmt(t.pack_id)}·{fmt(t.slot)}", t.adapter_path, href, t.reason,
                             data.feasible(t) if data.constraints and t.state == "COMPLETE" else None,
                             t.is_baseline))
    return TrialTableInfo(list(data.objectives), metric_names, param_names, rows)


def render_trial_table(info: TrialTableInfo) -> str:
    """A sortable, filterable HTML table of all trials."""
    constrained = any(r.feasible is not None for r in info.rows)
    headers = ["trial", "state", *(["constraints"] if constrained else []), *info.objectives,
               *info.metric_names, *info.param_names, "steps", "tokens",
               "device s", "pack·slot", "adapter", "reason"]
    body = []
    for r in info.rows:
        adapter = "–" if r.adapter is None else f"<code>{esc(r.adapter)}</code>"
        if r.adapter_href is not None:
            adapter = f'<a href="{html.escape(r.adapter_href, quote=True)}">{adapter}</a>'
        mark = (" ★" if r.default else "") + (" (config baseline)" if r.baseline else "")
        body.append([(f"#{r.number}{mark}", r.number),
                     f'<span class="state {esc(r.state.lower())}">{esc(r.state.lower())}</span>',
                     *([_feasibility(r.feasible)] if constrained else []),
                     *[(esc(v), v) for v in r.objectives],
                     *[(esc(r.metrics.get(m)), r.metrics.get(m)) for m in info.metric_names],
                     *[(esc(r.params.get(p)), r.params.get(p)) for p in info.param_names],
                     (esc(r.steps), r.steps), (esc(r.tokens), r.tokens), (esc(r.device_s), r.device_s),
                     esc(r.pack_slot), (adapter, r.adapter or ""), esc(r.reason or "")])
    return ('<input class="filter" data-table="trials" placeholder="filter rows (e.g. complete, attn)…">'
            + table(headers, body, table_id="trials"))


def _feasibility(feasible: bool | None) -> str:
    return "–" if feasible is None else ("feasible" if feasible else '<span class="state fail">infeasible</span>')


def render_prune_table(data: StudyData) -> str:
    """Every cohort-pruner decision with its reason, sortable."""
    if not data.prunes:
        return '<p class="note">No prune decisions recorded (pruning is off, or no trial reached a rung yet).</p>'
    rows = [[(str(d.pack_id), d.pack_id), (str(d.rung_step), d.rung_step), (f"#{d.trial}", d.trial),
             f'<span class="state {"pruned" if d.decision == "prune" else "complete"}">{esc(d.decision)}</span>',
             (esc(d.value), d.value), (f"{fmt(d.rank)} / {fmt(d.cohort_size)}", d.rank), esc(d.reason or "")]
            for d in sorted(data.prunes, key=lambda d: (d.pack_id, d.rung_step, d.rank or 0, d.trial))]
    return table(["pack", "rung step", "trial", "decision", "value", "rank / cohort", "reason"], rows,
                 table_id="prunes")


def render_samples(data: StudyData) -> str:
    """The first generated answers of the default and the best trials, beside their references: one row per
    trial and item, with the score of every metric that scored it (a generation scored by several scorers is
    one answer)."""
    rows = []
    for number, by_metric in sorted(data.samples.items()):
        items: dict[int, tuple[dict[str, Any], dict[str, Any]]] = {}
        for metric, scored in sorted(by_metric.items()):
            for it in scored:
                items.setdefault(it.item, (it.detail, {}))[1][metric] = it.score
        for item, (d, scores) in sorted(items.items()):
            rows.append([(f"#{number}", number), (esc(item), item), esc(d.get("prompt")), esc(d.get("output")),
                         esc(d.get("reference")), esc(", ".join(f"{m}={fmt(v)}" for m, v in scores.items()))])
    if not rows:
        return ('<p class="note">No generated answers stored (no generative evaluator, or no complete trial '
                "yet).</p>")
    return table(["trial", "item", "prompt", "output", "reference", "scores"], rows, table_id="samples-table")
