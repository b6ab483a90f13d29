"""``write_report``: one self-contained HTML file (plotly.js embedded once, inline; no CDN, opens offline).

Sections: summary and gain over the default trial, Pareto front, optimisation history, parameter importances,
parallel coordinates, learning curves with prune markers, pack timeline and pack throughput, the trial table
and the prune decisions. A section that cannot be drawn (too few trials, an unreachable Optuna storage, a bug)
shows why instead, so the report is always written: ``sweep run`` rewrites it after every pack.
"""

from __future__ import annotations

import html
import traceback
from collections.abc import Callable
from pathlib import Path

import plotly.graph_objects as go
from plotly.offline import get_plotlyjs

from lora_sweep.reports import figures, optuna_figures, summary, tables, timeline
from lora_sweep.reports._load import StudyData, load_optuna_study, load_study_data
from lora_sweep.store.api import StudyDir, atomic_write_text

__all__ = ["write_report", "build_report", "preload"]

_CONFIG = {"displaylogo": False, "responsive": True}

_CSS = """
body { font-family: system-ui, sans-serif; margin: 0 auto; max-width: 1280px; padding: 0 1.5em 4em; color: #222; }
nav { position: sticky; top: 0; background: #fff; padding: .5em 0; border-bottom: 1px solid #ddd; z-index: 10; }
nav a { margin-right: 1em; font-size: .9em; }
section { margin-top: 2em; }
dl.facts { display: grid; grid-template-columns: max-content auto; gap: .2em 1em; }
dl.facts dt { font-weight: 600; }
table { border-collapse: collapse; font-size: .85em; margin: .5em 0; }
th, td { border: 1px solid #ddd; padding: .25em .5em; text-align: left; vertical-align: top; }
table.sortable th { cursor: pointer; background: #f4f6f8; position: sticky; top: 0; }
#trials td { white-space: nowrap; }
#trials td:nth-last-child(-n+2) { white-space: normal; overflow-wrap: anywhere; min-width: 8em; max-width: 16em; }
th[data-dir=asc]::after { content: " ▲"; } th[data-dir=desc]::after { content: " ▼"; }
.tablewrap { max-height: 36em; overflow: auto; }
.note { color: #555; font-style: italic; }
.error { color: #b00; }
.banner { background: #fff3cd; border: 1px solid #e0c36b; padding: .6em; }
.state.complete { color: #1f77b4; } .state.pruned { color: #d9730d; } .state.fail { color: #d62728; }
.state.running { color: #2ca02c; }
input.filter { margin: .5em 0; padding: .3em; width: 24em; }
"""

_JS = """
(function () {
  function key(cell) { return cell.hasAttribute('data-v') ? cell.getAttribute('data-v') : cell.textContent.trim(); }
  document.querySelectorAll('table.sortable').forEach(function (tbl) {
    tbl.querySelectorAll('th').forEach(function (th, col) {
      th.addEventListener('click', function () {
        var asc = th.getAttribute('data-dir') !== 'asc';
        tbl.querySelectorAll('th').forEach(function (h) { h.removeAttribute('data-dir'); });
        th.setAttribute('data-dir', asc ? 'asc' : 'desc');
        var body = tbl.tBodies[0];
        var rows = Array.prototype.slice.call(body.rows);
        rows.sort(function (a, b) {
          var x = key(a.cells[col]), y = key(b.cells[col]);
          if (x === '' || y === '') { return (x === '') - (y === ''); }  // empty cells last either way
          var nx = Number(x), ny = Number(y);
          var c = (!isNaN(nx) && !isNaN(ny)) ? (nx < ny ? -1 : nx > ny ? 1 : 0) : x.localeCompare(y);
          return asc ? c : -c;
        });
        rows.forEach(function (r) { body.appendChild(r); });
      });
    });
  });
  document.querySelectorAll('input.filter').forEach(function (inp) {
    var tbl = document.getElementById(inp.getAttribute('data-table'));
    inp.addEventListener('input', function () {
      var q = inp.value.toLowerCase();
      Array.prototype.forEach.call(tbl.tBodies[0].rows, function (r) {
        r.style.display = r.textContent.toLowerCase().indexOf(q) >= 0 ? '' : 'none';
      });
    });
  });
})();
"""


def _figure(fig: go.Figure, div_id: str) -> str:
    return fig.to_html(full_html=False, include_plotlyjs=False, div_id=div_id, config=_CONFIG)


def _safe(what: str, build: Callable[[], str]) -> str:
    """The section's HTML, or one line saying why it could not be drawn."""
    try:
        return build()
    except Exception as err:  # a broken figure must not cost the whole report
        last = traceback.extract_tb(err.__traceback__)[-1]
        return (f'<p class="error">Could not draw {html.escape(what)}: {html.escape(type(err).__name__)}: '
                f"{html.escape(str(err).splitlines()[0] if str(err) else '')} "
                f"({html.escape(Path(last.filename).name)}:{last.lineno})</p>")


IMPORTANCE_TRIALS = 20
"""Complete trials under which the parameter importances are not drawn: PED-ANOVA compares the best trials'
parameter distribution with all trials', which a handful of trials cannot pin down."""


def _note(text: str) -> str:
    return f'<p class="note">{html.escape(text)}</p>'


def _optuna_section(data: StudyData, study: object, kind: str) -> str:
    info = optuna_figures._optuna_info(data)
    need = 2 if kind == "importances" else 1
    if isinstance(study, str):
        return _note(f"Optuna figures unavailable: {study}.")
    if info.n_complete < need:
        return _note(f"Needs at least {need} complete trial{'s' if need > 1 else ''} "
                     f"({info.n_complete} so far).")
    plot = {"history": optuna_figures.plot_history, "importances": optuna_figures.plot_importances,
            "parallel": optuna_figures.plot_parallel}[kind]

    def one(t: optuna_figures.Target) -> str:
        return _safe(f"{kind} for {t.name}", lambda: _figure(plot(study, t), f"fig-{kind}-{t.idx}"))

    if kind == "importances" and info.n_complete < IMPORTANCE_TRIALS:
        return _note(f"Not drawn: importances need at least {IMPORTANCE_TRIALS} complete trials ({info.n_complete} "
                     f"so far). With fewer, PED-ANOVA ranks the parameters by noise (on a 12-trial study it ranked "
                     f"lr first for adapter_params, which lr cannot change).")
    return "\n".join(one(t) for t in info.targets)


def _pareto_section(data: StudyData) -> str:
    if len(data.objectives) < 2:
        return _note("Single-objective study: no Pareto front (see the optimisation history and best trials).")
    info = figures._pareto_info(data)
    skipped = _note(f"{info.skipped} complete trial(s) left out: a non-finite objective value.") if info.skipped else ""
    if not info.points:
        return _note("No complete trial with finite objective values yet.") + skipped
    return _figure(figures.plot_pareto(info), "fig-pareto") + skipped


def _curves_section(data: StudyData) -> str:
    info = figures._curves_info(data)
    if not any(c.steps for c in info.curves):
        return _note("No training steps recorded yet.")
    out = _figure(figures.plot_curves(info), "fig-curves")
    held_out = figures._eval_curves_info(data)
    if held_out.curves:  # train.eval_every: the held-out loss during training
        out += "\n" + _figure(figures.plot_curves(held_out, title="Held-out loss per trial (train.eval_every)",
                                                   y="held-out loss", mode="lines+markers"), "fig-eval-curves")
    return out


def _packs_section(data: StudyData) -> str:
    if not data.packs:
        return _note("No pack has run yet.")
    parts = [_safe("the pack timeline", lambda: _figure(timeline.plot_timeline(timeline._timeline_info(data)),
                                                         "fig-timeline"))]
    parts.append(_safe("pack throughput", lambda: _figure(timeline.plot_packs(timeline._packs_info(data)),
                                                          "fig-packs")))
    parts.append(_note("Training step: " + "; ".join(f"pack {p.pack_id}: {p.step or 'not recorded'}"
                                                     for p in data.packs)))
    return "\n".join(parts)


def _prunes_section(data: StudyData) -> str:
    out = []
    if data.prunes:
        out.append(_safe("the prune decisions", lambda: _figure(figures.plot_prunes(figures._prune_info(data)),
                                                                "fig-prunes")))
    out.append('<div class="tablewrap">' + tables.render_prune_table(data) + "</div>")
    return "\n".join(out)


def _gain_title(data: StudyData) -> str:
    """The gain section's heading: what the best is measured against in this study."""
    if data.default is None:
        return "Gain over the default trial"
    if data.default_name == "config baseline":
        return "Gain over the config baseline (the config's own hyperparameters)"
    return "Gain over the community default (rank 16, alpha 32, lr 2e-4)"


def build_report(study_dir: str | Path, report_dir: str | Path | None = None) -> str:
    """The report's HTML text; ``report_dir`` is where it will be written (adapter links are relative to it).

    Raises:
        FileNotFoundError: ``study_dir`` holds no study.
    """
    data = load_study_data(study_dir)
    report_dir = Path(report_dir) if report_dir is not None else data.root
    study = load_optuna_study(data) if data.complete else "no complete trial yet"
    sections: list[tuple[str, str, str]] = [
        ("summary", "Summary", _safe("the summary", lambda: summary.render_summary(summary._summary_info(data)))),
        ("gain", _gain_title(data),
         _safe("the gain over the default", lambda: summary.render_gain(summary._gain_info(data)))),
        ("pareto", "Pareto front", _safe("the Pareto front", lambda: _pareto_section(data))),
        ("history", "Optimisation history", _optuna_section(data, study, "history")),
        ("importances", "Parameter importances", _optuna_section(data, study, "importances")),
        ("parallel", "Parallel coordinates", _optuna_section(data, study, "parallel")),
        ("curves", "Learning curves", _safe("the learning curves", lambda: _curves_section(data))),
        ("packs", "Packs", _packs_section(data)),
        ("trials", "Trials", _safe("the trial table", lambda: '<div class="tablewrap">' + tables.render_trial_table(
            tables._trial_table_info(data, report_dir)) + "</div>")),
        ("prunes", "Prune decisions", _safe("the prune decisions", lambda: _prunes_section(data))),
        ("samples", "Generated answers", _safe("the generated answers", lambda: '<div class="tablewrap">'
                                               + tables.render_samples(data) + "</div>")),
    ]
    name = html.escape(str(data.meta.get("name", data.root.name)))
    nav = "".join(f'<a href="#{sid}">{html.escape(title)}</a>' for sid, title, _ in sections)
    body = "\n".join(f'<section id="{sid}"><h2>{html.escape(title)}</h2>\n{content}\n</section>'
                     for sid, title, content in sections)
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
            f'<meta name="viewport" content="width=device-width, initial-scale=1">'
            f"<title>{name}: lora-sweep report</title><style>{_CSS}</style>\n"
            f'<script type="text/javascript">{get_plotlyjs()}</script>\n</head><body>\n'
            f"<h1>{name}</h1><nav>{nav}</nav>\n{body}\n<script>{_JS}</script>\n</body></html>\n")


def preload() -> None:
    """Import what ``write_report`` loads lazily: Optuna's visualization package (it imports matplotlib too, where
    installed), scipy.stats (the bootstrap of the gain over the default) and plotly's layout classes (made with
    the first figure). ``sweep run`` calls this on a thread while its pack trains, to take the second they cost on
    a GPU host off the report written after the run (BENCHMARKS.md, "A GPU run's start-up and exit")."""
    import optuna.visualization  # noqa: F401
    import scipy.stats  # noqa: F401

    go.Figure(layout=go.Layout(title={"text": ""}, xaxis={"title": {"text": ""}}, yaxis={"type": "log"},
                               legend={}, template="plotly_white"))


def write_report(study_dir: str | Path, out: str | Path | None = None) -> Path:
    """Write the study's HTML report (default ``<study_dir>/report.html``) atomically; returns its path.

    Raises:
        FileNotFoundError: ``study_dir`` holds no study.
    """
    path = Path(out) if out is not None else StudyDir(study_dir).report_html
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, build_report(study_dir, path.parent))
    return path
