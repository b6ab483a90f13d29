"""The report's summary: what was swept, how much budget it used, the best trials and the gain over the default.

The gain over the community-default trial (user attribute ``default``) is the difference of each objective
between the best trial for it and the default, with a paired bootstrap interval over the per-item scores of
the ``items`` table when both trials have them (the same item index is the same example for every trial).
"""

from __future__ import annotations

import datetime as dt
import math
from typing import Any, NamedTuple

from lora_sweep.reports._fmt import esc, fmt, table
from lora_sweep.reports._load import StudyData, best_trial, objective_values, pareto_numbers
from lora_sweep.store.api import constraint_text, paired_bootstrap, paired_scores

__all__ = ["SummaryInfo", "GainInfo", "GainRow", "BestRow", "_summary_info", "_gain_info", "render_summary",
           "render_gain"]


class BestRow(NamedTuple):
    number: int
    values: list[float]
    params: dict[str, Any]
    default: bool
    adapter: str | None
    feasible: bool = True
    role: str = ""
    """' (default)', ' (config baseline)', both, or '' (``TrialRecord.role``)."""


class SummaryInfo(NamedTuple):
    name: str
    model: str
    data: str
    storage: str
    objectives: list[tuple[str, str]]
    """(metric, direction) in objective order."""
    counts: dict[str, int]
    budget: list[tuple[str, str, str]]
    """(what, used, limit) rows; limit '–' when the study sets none."""
    best_title: str
    best: list[BestRow]
    running: bool
    updated: str
    constraints: list[str] = []
    """``metric <= value`` of each constraint."""
    feasible: int = 0
    """Complete trials that meet every constraint."""
    ended: str = ""
    """How the last run ended (``stopped: budget.wall_time reached: ...``); '' when no run recorded it."""


class GainRow(NamedTuple):
    objective: str
    direction: str
    best: int
    best_value: float
    default_value: float
    diff: float
    """best - default of the objective value."""
    low: float | None
    high: float | None
    """Paired bootstrap interval of the per-item mean difference; None without per-item scores."""
    n_items: int
    verdict: str


class GainInfo(NamedTuple):
    default: int | None
    note: str
    rows: list[GainRow]
    against: str = "default"
    """How the compared trial is named: ``config baseline`` (the config's own hyperparameters) or ``default``."""


def _time(t: Any) -> str:
    if not isinstance(t, int | float) or not math.isfinite(t):
        return "–"
    return dt.datetime.fromtimestamp(t, dt.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def _summary_info(data: StudyData, top: int = 5) -> SummaryInfo:
    counts: dict[str, int] = {}
    for t in data.trials:
        counts[t.state or "?"] = counts.get(t.state or "?", 0) + 1
    finished = sum(v for k, v in counts.items() if k in ("COMPLETE", "PRUNED", "FAIL"))
    tokens = sum(t.tokens or 0 for t in data.trials)
    device_s = sum(t.device_seconds or 0.0 for t in data.trials)
    b = data.budget
    elapsed = float(data.meta.get("elapsed") or 0.0)
    budget = [("trials finished", str(finished), _limit(finished, b.get("trials"), "{:,.0f}")),
              ("training tokens", f"{tokens:,}", _limit(tokens, b.get("tokens"), "{:,.0f}")),
              ("wall time", f"{elapsed:.1f} s", _limit(elapsed, b.get("wall_time"), "{:,.1f} s")),
              ("device time (trials)", f"{device_s:.1f} s", "–"),
              ("packs", str(len(data.packs)), "–")]
    n = len(data.objectives)
    # feasible trials first: the best are chosen among them when any exists
    done = [(vals, t) for t in data.candidates if (vals := objective_values(t, n)) is not None]
    if n == 1:
        sign = 1.0 if data.directions[0] == "minimize" else -1.0
        chosen = sorted(done, key=lambda x: (sign * x[0][0], x[1].number))[:top]
        title = f"best {len(chosen)} by {data.objectives[0]} ({data.directions[0]})"
    else:
        front = set(pareto_numbers(data.candidates, data.directions))
        chosen = sorted((x for x in done if x[1].number in front), key=lambda x: (x[0][0], x[1].number))
        title = f"Pareto front ({len(chosen)} trials)"
    best = [BestRow(t.number, vals, dict(t.params or {}), t.is_default, t.adapter_path,
                    data.feasible(t), t.role) for vals, t in chosen]
    return SummaryInfo(str(data.meta.get("name", data.root.name)), str(data.meta.get("model", "–")),
                       str(data.meta.get("data", "–")), str(data.meta.get("storage", "–")),
                       list(zip(data.objectives, data.directions, strict=False)), counts, budget, title, best,
                       data.running, _time(data.meta.get("updated")), [constraint_text(c) for c in data.constraints],
                       sum(1 for t in data.complete if data.feasible(t)), _end_text(data.meta))


def _limit(used: float, limit: Any, unit: str) -> str:
    """The limit cell of a budget row: the limit, flagged with the overshoot when ``used`` went over it (the
    trials training when a budget is reached run to their end)."""
    if not isinstance(limit, int | float) or isinstance(limit, bool):
        return fmt(limit)
    if used > limit:
        return f"{fmt(limit)} (OVER by {unit.format(used - limit)})"
    return fmt(limit)


def _end_text(meta: dict[str, Any]) -> str:
    """How the last run ended, in the line the run printed (the store's meta ``last_end``); '' if unknown."""
    end = meta.get("last_end")
    return str(end.get("text") or "") if isinstance(end, dict) else ""


def _verdict(direction: str, diff: float, low: float | None, high: float | None) -> str:
    if diff == 0 and low is None:
        return "same"
    good = (lambda x: x < 0) if direction == "minimize" else (lambda x: x > 0)
    if low is None or high is None:
        return "better (no per-item scores)" if good(diff) else "not better (no per-item scores)"
    if good(low) and good(high):
        return "better (interval excludes 0)"
    if not good(low) and not good(high) and low != 0 and high != 0:
        return "worse (interval excludes 0)"
    return "not significant (interval contains 0)"


def _gain_info(data: StudyData, confidence: float = 0.95) -> GainInfo:
    default, name = data.default, data.default_name
    if default is None:
        return GainInfo(None, "This study has no default trial (the community default lies outside the search "
                        "space or the config fixes its values otherwise, and no config baseline was trained).", [])
    n = len(data.objectives)
    dvals = objective_values(default, n) if default.state == "COMPLETE" else None
    if dvals is None:
        why = default.reason or "no finite objective values"
        return GainInfo(default.number, f"The {name} trial #{default.number} is {default.state} ({why}): "
                        "no gain to report.", [])
    rows = []
    for i, (metric, direction) in enumerate(zip(data.objectives, data.directions, strict=True)):
        best = best_trial(data.candidates, i, data.directions)
        assert best is not None  # the default is complete: candidates are not empty
        bval = (objective_values(best, n) or [math.nan] * n)[i]
        per_item = data.items.get(metric, {})
        a, b = paired_scores(per_item.get(best.number, {}), per_item.get(default.number, {}))
        low = high = None
        if a and best.number != default.number:
            _, low, high = paired_bootstrap(a, b, confidence=confidence)
        diff = bval - dvals[i]
        rows.append(GainRow(metric, direction, best.number, bval, dvals[i], diff, low, high, len(a),
                            f"the {name} is the best" if best.number == default.number
                            else _verdict(direction, diff, low, high)))
    rows += _other_metrics(data, default, confidence)
    own = " (the config's own hyperparameters)" if name == "config baseline" else ""
    note = (f"Best trial per objective against the {name} trial #{default.number}{own}; "
            f"{int(confidence * 100)}% paired bootstrap interval of the per-item mean difference (2000 resamples). "
            f"A metric that is no objective compares the best trial by {data.objectives[0]} (its per-item mean).")
    return GainInfo(default.number, note, rows, name)


def _other_metrics(data: StudyData, default: Any, confidence: float) -> list[GainRow]:
    """Gain rows of the per-item metrics that are no objective (``exact_match`` beside an ``eval_loss``
    objective): the best trial by the first objective against the default, on the items both scored."""
    best = best_trial(data.candidates, 0, data.directions)
    directions = data.meta.get("metric_directions") or {}
    rows = []
    for metric in sorted(set(data.items) - set(data.objectives)):
        per_item = data.items[metric]
        if best is None or default.number not in per_item or best.number not in per_item:
            continue
        a, b = paired_scores(per_item[best.number], per_item[default.number])
        if not a:
            continue
        bval, dval = sum(a) / len(a), sum(b) / len(b)
        low = high = None
        if best.number != default.number:
            _, low, high = paired_bootstrap(a, b, confidence=confidence)
        direction = str(directions.get(metric, ""))
        verdict = (f"the {data.default_name} is the best" if best.number == default.number
                   else _verdict(direction, bval - dval, low, high) if direction else "direction unknown")
        rows.append(GainRow(metric, direction or "–", best.number, bval, dval, bval - dval, low, high, len(a),
                            verdict))
    return rows


def render_summary(info: SummaryInfo) -> str:
    """HTML of the summary section."""
    objectives = ", ".join(f"{esc(m)} ({esc(d)})" for m, d in info.objectives) or "–"
    counts = ", ".join(f"{esc(k.lower())} {v}" for k, v in sorted(info.counts.items())) or "no trials yet"
    facts = [("study", esc(info.name)), ("model", esc(info.model)), ("data", esc(info.data)),
             ("objectives", objectives), ("trials", counts),
             *([("constraints", f"{esc('; '.join(info.constraints))}: {info.feasible} of "
                                f"{info.counts.get('COMPLETE', 0)} complete trials feasible"
                                + ("" if info.feasible else " (the best below are infeasible)"))]
               if info.constraints else []), ("Optuna storage", f"<code>{esc(info.storage)}</code>"),
             *([("last run", esc(info.ended))] if info.ended else []), ("last update", esc(info.updated))]
    out = ['<dl class="facts">' + "".join(f"<dt>{k}</dt><dd>{v}</dd>" for k, v in facts) + "</dl>"]
    if info.running:
        out.insert(0, '<p class="banner">This study is still running (or a run stopped without finishing): '
                   "the report shows the state at the last update.</p>")
    out.append("<h3>Budget used</h3>" + table(["budget", "used", "limit"], info.budget, table_id="budget",
                                              sortable=False))
    out.append(f"<h3>{esc(info.best_title)}</h3>")
    if not info.best:
        out.append('<p class="note">No complete trial with finite objective values yet.</p>')
    else:
        names = [m for m, _ in info.objectives]
        rows = [[(f"#{b.number}{b.role}{'' if b.feasible else ' (infeasible)'}", b.number),
                 *[(esc(v), v) for v in b.values],
                 esc(", ".join(f"{k}={fmt(v)}" for k, v in b.params.items())),
                 f"<code>{esc(b.adapter)}</code>"] for b in info.best]
        out.append(table(["trial", *names, "params", "adapter"], rows, table_id="best"))
    return "\n".join(out)


def render_gain(info: GainInfo) -> str:
    """HTML of the gain-over-default section."""
    out = [f'<p class="note">{esc(info.note)}</p>']
    if info.rows:
        rows = [[esc(r.objective), esc(r.direction), (f"#{r.best}", r.best), (esc(r.best_value), r.best_value),
                 (esc(r.default_value), r.default_value), (esc(r.diff), r.diff),
                 "–" if r.low is None else f"[{fmt(r.low)}, {fmt(r.high)}]", (str(r.n_items), r.n_items),
                 esc(r.verdict)] for r in info.rows]
        out.append(table(["objective", "direction", "best trial", "best", info.against, f"best − {info.against}",
                          "95% CI (paired)", "items", "verdict"], rows, table_id="gain", sortable=False))
    return "\n".join(out)
