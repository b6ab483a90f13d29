"""``sweep status DIR``: counts by state, best trials with params and values, packs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from packer.errors import UserError
from sweep.store import ResultsStore, StudyDir

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
    done = [t for t in trials if t.state == "COMPLETE" and t.objective_values]
    best: list[dict[str, Any]] = []
    if done and directions:
        sign = 1 if directions[0] == "minimize" else -1
        for t in sorted(done, key=lambda t: sign * t.objective_values[0])[:top]:
            best.append({"number": t.number, "values": dict(zip(objectives, t.objective_values, strict=False)),
                         "params": t.params, "adapter": t.adapter_path, "default": bool((t.user_attrs or {})
                                                                                       .get("default"))})
    return {
        "study": meta.get("name"),
        "directory": str(root),
        "storage": meta.get("storage"),
        "objectives": dict(zip(objectives, directions, strict=False)),
        "counts": counts,
        "best": best,
        "packs": [{"pack_id": p.pack_id, "status": p.status, "slots": p.slots, "steps": p.steps,
                   "tokens": p.tokens, "tokens_per_s": p.tokens_per_s, "wall_s": p.wall_s,
                   "peak_mem_bytes": p.peak_mem_bytes} for p in packs],
    }


def render(info: dict[str, Any]) -> None:
    """Rich tables of ``study_status``'s data."""
    console = Console()
    counts = ", ".join(f"{k.lower()} {v}" for k, v in sorted(info["counts"].items())) or "no trials"
    console.print(f"[bold]{info['study']}[/bold] ({info['directory']}): {counts}")
    objectives = list(info["objectives"])
    table = Table(title=f"best by {objectives[0] if objectives else '-'}")
    for col in ["trial", *objectives, "params", "adapter"]:
        table.add_column(col)
    for b in info["best"]:
        params = ", ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in b["params"].items())
        table.add_row(f"{b['number']}{' (default)' if b['default'] else ''}",
                      *[f"{b['values'].get(o, float('nan')):.5g}" for o in objectives], params, b["adapter"] or "")
    console.print(table)
    packs = Table(title="packs")
    for col in ("pack", "status", "slots", "steps", "tokens", "tokens/s", "wall s"):
        packs.add_column(col)
    for p in info["packs"]:
        packs.add_row(str(p["pack_id"]), p["status"], str(p["slots"]), str(p["steps"]), str(p["tokens"]),
                      f"{p['tokens_per_s'] or 0:,.0f}", f"{p['wall_s'] or 0:.1f}")
    console.print(packs)
