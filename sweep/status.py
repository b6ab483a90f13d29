"""``sweep status DIR``: counts by state, best trials with params and values, packs."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from packer.errors import UserError
from sweep.store import ResultsStore, StudyDir, constraint_text, is_feasible

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
    counts: dict[str, int] = {}
    for t in trials:
        counts[t.state] = counts.get(t.state, 0) + 1
    objectives, directions = meta.get("objectives", []), meta.get("directions", [])
    constraints = list(meta.get("constraints") or [])
    done = [t for t in trials if t.state == "COMPLETE" and t.objective_values]
    feasible = {t.number for t in done if is_feasible(t.metrics, constraints)}
    best: list[dict[str, Any]] = []
    if done and directions:
        sign = 1 if directions[0] == "minimize" else -1
        # feasible trials first (Optuna's rule for constrained studies), each group by the first objective
        for t in sorted(done, key=lambda t: (t.number not in feasible, _rank(sign, t.objective_values[0])))[:top]:
            best.append({"number": t.number, "values": dict(zip(objectives, t.objective_values, strict=False)),
                         "params": t.params, "adapter": t.adapter_path, "default": bool((t.user_attrs or {})
                                                                                       .get("default")),
                         "feasible": t.number in feasible})
    return {
        "study": meta.get("name"),
        "directory": str(root),
        "storage": meta.get("storage"),
        "objectives": dict(zip(objectives, directions, strict=False)),
        "counts": counts,
        "constraints": [constraint_text(c) for c in constraints],
        "feasible": len(feasible),
        "best": best,
        "packs": [{"pack_id": p.pack_id, "status": p.status, "slots": p.slots, "steps": p.steps,
                   "tokens": p.tokens, "tokens_per_s": p.tokens_per_s, "wall_s": p.wall_s,
                   "peak_mem_bytes": p.peak_mem_bytes} for p in packs],
    }


def _rank(sign: int, value: float | None) -> float:
    return math.inf if value is None or not math.isfinite(value) else sign * value


def render(info: dict[str, Any]) -> None:
    """Rich tables of ``study_status``'s data."""
    console = Console()
    counts = ", ".join(f"{k.lower()} {v}" for k, v in sorted(info["counts"].items())) or "no trials"
    console.print(f"[bold]{info['study']}[/bold] ({info['directory']}): {counts}")
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
        mark = (" (default)" if b["default"] else "") + ("" if b["feasible"] else " (infeasible)")
        table.add_row(f"{b['number']}{mark}",
                      *[f"{b['values'].get(o, float('nan')):.5g}" for o in objectives], params, b["adapter"] or "")
    console.print(table)
    packs = Table(title="packs")
    for col in ("pack", "status", "slots", "steps", "tokens", "tokens/s", "wall s"):
        packs.add_column(col)
    for p in info["packs"]:
        packs.add_row(str(p["pack_id"]), p["status"], str(p["slots"]), str(p["steps"]), str(p["tokens"]),
                      f"{p['tokens_per_s'] or 0:,.0f}", f"{p['wall_s'] or 0:.1f}")
    console.print(packs)
