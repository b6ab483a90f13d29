"""``sweep status DIR``: counts by state, best trials with params and values, the best against the default, packs.

The comparison with the config's own hyperparameters (the baseline trial of an Axolotl or torchtune config), else
with the community-default trial (user attribute ``default``), is the one the report's gain
section makes: per-item scores of the final evaluation (the ``items`` table; item i is the same held-out
example for every trial), the mean of best − default with a 95% paired bootstrap interval.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from lora_sweep.errors import UserError
from lora_sweep.store.api import (
    ResultsStore,
    StudyDir,
    TrialRecord,
    constraint_text,
    is_feasible,
    paired_bootstrap,
    pareto_front,
    reference_trial,
)
from lora_sweep.sweep.timing import last_run, split_table

__all__ = ["study_status", "render"]


def study_status(root: Path, top: int = 5) -> dict[str, Any]:
    """Plain data for ``--json``: study name, counts by state, best trials, packs.

    Raises:
        UserError: ``root`` is not a study directory.
    """
    sdir = StudyDir(root)
    if not sdir.is_study():
        raise UserError(f"{root}: not a study directory (no results.db and study.yaml)")
    with ResultsStore(sdir.results_db, create=False) as store:
        meta = store.meta()
        trials = store.trials()
        packs = store.packs()
        objectives, directions = meta.get("objectives", []), meta.get("directions", [])
        constraints = list(meta.get("constraints") or [])
        vs_default = _vs_default(store, trials, directions, constraints)
    counts: dict[str, int] = {}
    for t in trials:
        counts[t.state] = counts.get(t.state, 0) + 1
    done = [t for t in trials if t.state == "COMPLETE" and t.objective_values]
    feasible = {t.number for t in done if is_feasible(t.metrics, constraints)}
    best: list[dict[str, Any]] = []
    if done and directions:
        sign = 1 if directions[0] == "minimize" else -1
        # feasible trials first (Optuna's rule for constrained studies), each group by the first objective
        for t in sorted(done, key=lambda t: (t.number not in feasible, _rank(sign, t.objective_values[0])))[:top]:
            best.append({"number": t.number, "values": dict(zip(objectives, t.objective_values, strict=False)),
                         "params": t.params, "adapter": t.adapter_path, "default": t.is_default,
                         "baseline": t.is_baseline, "role": t.role.strip(" ()"), "feasible": t.number in feasible})
    return {
        "study": meta.get("name"),
        "directory": str(root),
        "storage": meta.get("storage"),
        "objectives": dict(zip(objectives, directions, strict=False)),
        "counts": counts,
        "constraints": [constraint_text(c) for c in constraints],
        "feasible": len(feasible),
        "best": best,
        "pareto": _front(done, objectives, directions) if len(directions) > 1 else [],
        "vs_default": vs_default,
        "last_end": meta.get("last_end"),
        "split": last_run(root),
        "packs": [{"pack_id": p.pack_id, "status": p.status, "slots": p.slots, "steps": p.steps,
                   "tokens": p.tokens, "tokens_per_s": p.tokens_per_s, "wall_s": p.wall_s,
                   "peak_mem_bytes": p.peak_mem_bytes, "step": p.step, "fallback": p.fallback} for p in packs],
    }


def _rank(sign: int, value: float | None) -> float:
    return math.inf if value is None or not math.isfinite(value) else sign * value


def _vs_default(store: ResultsStore, trials: list[TrialRecord], directions: list[str],
                constraints: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The best trial (feasible first, then by the first objective) against the reference trial (the config's
    own hyperparameters when the study has that trial, else the community default: ``reference_trial``), per
    metric with per-item scores; ``default`` is its number, ``against`` its name.

    None without a complete reference trial or a complete best trial other than it. Each row: the metric, both
    trials' means over the items both scored, best − reference and its 95% paired bootstrap interval.
    """
    reference = reference_trial(trials)
    done = [t for t in trials if t.state == "COMPLETE" and t.objective_values]
    if reference is None or reference[0].state != "COMPLETE" or not reference[0].objective_values or not done \
            or not directions:
        return None
    sign = 1 if directions[0] == "minimize" else -1
    default, against = reference
    best = min(done, key=lambda t: (not is_feasible(t.metrics, constraints), _rank(sign, t.objective_values[0]),
                                    t.number))
    if best.number == default.number:
        return {"best": best.number, "default": default.number, "against": against, "rows": []}
    scores: dict[int, dict[str, dict[int, float]]] = {}
    for t in (best, default):
        for row in store.items(trial=t.number):
            if row.score is not None and row.score == row.score:  # finite per-item scores only
                scores.setdefault(t.number, {}).setdefault(row.evaluator, {})[row.item] = float(row.score)
    rows = []
    for metric in sorted(scores.get(best.number, {}).keys() & scores.get(default.number, {}).keys()):
        b, d = scores[best.number][metric], scores[default.number][metric]
        keys = sorted(b.keys() & d.keys())
        diff, low, high = paired_bootstrap([b[k] for k in keys], [d[k] for k in keys])
        rows.append({"metric": metric, "best": sum(b[k] for k in keys) / len(keys),
                     "default": sum(d[k] for k in keys) / len(keys), "diff": diff, "low": low, "high": high,
                     "items": len(keys), "excludes_zero": low > 0 or high < 0})
    return {"best": best.number, "default": default.number, "against": against, "rows": rows}


def _front(done: list[TrialRecord], objectives: list[str], directions: list[str]) -> list[dict[str, Any]]:
    """The complete trials on the Pareto front (finite values only), by trial number, with their values."""
    points = [(t.number, [float(v) for v in t.objective_values]) for t in done
              if len(t.objective_values) == len(directions) and all(math.isfinite(v) for v in t.objective_values)]
    values = dict(points)
    return [{"number": n, "values": dict(zip(objectives, values[n], strict=False))}
            for n in sorted(pareto_front(points, directions))]


def render(info: dict[str, Any]) -> None:
    """Rich tables of ``study_status``'s data."""
    console = Console()
    counts = ", ".join(f"{k.lower()} {v}" for k, v in sorted(info["counts"].items())) or "no trials"
    console.print(f"[bold]{info['study']}[/bold] ({info['directory']}): {counts}")
    end = info.get("last_end")
    if isinstance(end, dict) and end.get("text"):
        console.print(f"last run {end['text']}", highlight=False)
    if info["constraints"]:
        done = info["counts"].get("COMPLETE", 0)
        console.print(f"constraints: {'; '.join(info['constraints'])}: {info['feasible']} of {done} complete "
                      f"trials feasible")
    objectives = list(info["objectives"])
    table = Table(title=f"best by {objectives[0] if objectives else '-'}")
    for col in ["trial", *objectives, "params", "adapter"]:
        table.add_column(col)
    for b in info["best"]:
        params = ", ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in b["params"].items())
        mark = (f" ({b['role']})" if b.get("role") else "") + ("" if b["feasible"] else " (infeasible)")
        table.add_row(f"{b['number']}{mark}",
                      *[f"{b['values'].get(o, float('nan')):.5g}" for o in objectives], params, b["adapter"] or "")
    console.print(table)
    if info.get("pareto"):
        axes = ", ".join(f"{o} ({'min' if d == 'minimize' else 'max'})" for o, d in info["objectives"].items())
        points = "; ".join(f"#{p['number']} (" + ", ".join(f"{v:.4g}" for v in p["values"].values()) + ")"
                           for p in info["pareto"])
        console.print(f"Pareto front over {axes}: {len(info['pareto'])} trials: {points}")
    _render_vs_default(console, info.get("vs_default"))
    packs = Table(title="packs")
    for col in ("pack", "status", "slots", "steps", "tokens", "tokens/s", "wall s", "step"):
        packs.add_column(col)
    for p in info["packs"]:
        packs.add_row(str(p["pack_id"]), p["status"], str(p["slots"]), str(p["steps"]), str(p["tokens"]),
                      f"{p['tokens_per_s'] or 0:,.0f}", f"{p['wall_s'] or 0:.1f}", p["step"] or "-")
    console.print(packs)
    for p in info["packs"]:
        if p.get("fallback"):
            console.print(f"pack {p['pack_id']}: CUDA graph capture failed, trained eagerly: {p['fallback']}",
                          highlight=False, markup=False, soft_wrap=True)  # one line, however long
    if info.get("split"):
        console.print(split_table(info["split"], "the last run"), highlight=False)


def _render_vs_default(console: Console, vs: dict[str, Any] | None) -> None:
    if vs is None:
        console.print("no comparison with a default trial (no complete config-baseline or community-default trial, "
                      "or no other complete trial)")
        return
    ref = vs["against"]
    if not vs["rows"]:
        console.print(f"the {ref} trial #{vs['default']} is the best" if vs["best"] == vs["default"] else
                      f"best #{vs['best']} vs {ref} #{vs['default']}: no per-item scores to compare")
        return
    table = Table(title=f"best #{vs['best']} vs {ref} #{vs['default']} (per-item means, 95% paired bootstrap CI)")
    for col in ("metric", "best", ref, f"best - {ref}", "95% CI", "items", "CI excludes 0"):
        table.add_column(col)
    for r in vs["rows"]:
        table.add_row(f"{r['metric']} (per-item mean)", f"{r['best']:.4g}", f"{r['default']:.4g}", f"{r['diff']:+.4g}",
                      f"[{r['low']:+.4g}, {r['high']:+.4g}]", str(r["items"]), "yes" if r["excludes_zero"] else "no")
    console.print(table)
