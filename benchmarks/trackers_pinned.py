"""The demo's wall time with and without the three trackers, each run on two CPUs of its own (issue 41: the
trackers add < 1% to the demo's wall time).

On the 2-core machine the demo is written for (``benchmarks/trackers_overhead.sh``), the host's slow stretches
move single runs by -5% to +20% and blur a 1% difference. Here a machine with cores to spare stands in for several
2-core machines: every ``sweep run`` is pinned to two CPUs on two physical cores that no other run uses (the
trackers' process and W&B's core inherit the pin, so they share the run's two cores, as on a 2-core machine),
with ``OMP_NUM_THREADS=2`` and no GPU visible. A round starts every run at once, plain and tracked side by side in
pairs (``trackers=[mlflow, wandb, tensorboard]``, all local), the kinds swapping places from one round to the
next; a pair's two runs share whatever the host did meanwhile, so the pairs' changes are the measure.

Before the first round, MLflow's empty store is made in the cache, as any earlier study on a machine would have
made it (``sweep.trackers._mlflow``).

Usage: python -m lora_sweep.benchmarks.trackers_pinned [--study studies/demo.yaml] [--rounds 1] [--out DIR]
  Adds ``--rounds`` rounds to those already in DIR (``runs/bench-trackers-pinned``), so a run cut short by a time
  limit can go on, then prints every pair so far and the summary (a table last). DIR/runs.jsonl holds one line a
  run. Needs the mlflow, wandb and tensorboard extras and the demo's model
  (``sweep model smollm2 --out models/smollm2-135m``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

__all__ = ["physical_cpus", "slots", "said_cost", "pairs", "summary", "main"]

TRACKERS = "trackers=[mlflow, wandb, tensorboard]"
_SAID = re.compile(r"trackers: (\d+) passes; CPU ([\d.]+) s in their process \(([\d.]+) s preparing, ([\d.]+) s "
                   r"after the run\), ([\d.]+) s in its child")


def said_cost(log: str) -> dict[str, float] | None:
    """What the trackers said they cost in a run's log (``sweep.trackers.sync``'s last line): ``passes``, CPU
    seconds ``own`` (their process), ``prepared``, ``after`` (the run's end), ``children`` (W&B's core), and
    ``during``: their process's and its children's between preparing and the run's end. None if not said."""
    found = _SAID.search(log)
    if not found:
        return None
    passes, own, prepared, after, children = (float(x) for x in found.groups())
    return dict(passes=passes, own=own, prepared=prepared, after=after, children=children,
                during=own - prepared - after + children)


def physical_cpus(allowed: Sequence[int], sys_cpu: Path = Path("/sys/devices/system/cpu")) -> list[int]:
    """One CPU of ``allowed`` per physical core (the lowest-numbered; its hyperthread siblings left idle), in
    order; all of ``allowed`` where the topology cannot be read."""
    seen: dict[tuple[str, str], int] = {}
    for cpu in sorted(allowed):
        topo = sys_cpu / f"cpu{cpu}" / "topology"
        try:
            key = ((topo / "physical_package_id").read_text().strip(), (topo / "core_id").read_text().strip())
        except OSError:
            return sorted(allowed)
        seen.setdefault(key, cpu)
    return sorted(seen.values())


def slots(cpus: Sequence[int], per_run: int = 2) -> list[tuple[int, ...]]:
    """``cpus`` cut into groups of ``per_run``, an even number of them (pairs of runs); the rest stays idle."""
    n = len(cpus) // per_run // 2 * 2
    return [tuple(cpus[i * per_run:(i + 1) * per_run]) for i in range(n)]


def _start(study: str, out: Path, name: str, cpus: tuple[int, ...], tracked: bool) -> subprocess.Popen:
    """One ``sweep run`` into ``out/name``, pinned to ``cpus`` (its children inherit the pin)."""
    env = {**os.environ, "OMP_NUM_THREADS": str(len(cpus)), "CUDA_VISIBLE_DEVICES": "", "WANDB_SILENT": "true"}
    cmd = [sys.executable, "-m", "lora_sweep", "run", study, "--quiet", "--out", str(out / name)]
    with open(out / f"{name}.log", "w") as log:
        return subprocess.Popen(cmd + ([TRACKERS] if tracked else []), stdout=log, stderr=subprocess.STDOUT, env=env,
                                preexec_fn=lambda: os.sched_setaffinity(0, cpus))


def _round(study: str, out: Path, index: int, places: list[tuple[int, ...]]) -> list[dict]:
    """Round ``index``: every place's run at once (tracked on odd places in even rounds, even places in odd ones);
    each run's wall and CPU seconds (its own process and the children it waited for) when it ends."""
    start = time.monotonic()
    runs = {}
    for place, cpus in enumerate(places):
        tracked = (place + index) % 2 == 1
        name = f"r{index}-p{place}-{'trackers' if tracked else 'plain'}"
        runs[_start(study, out, name, cpus, tracked).pid] = dict(round=index, place=place, cpus=list(cpus),
                                                                 kind="trackers" if tracked else "plain", name=name)
    done = []
    while len(done) < len(runs):
        pid, status, used = os.wait4(-1, 0)
        if pid not in runs:
            continue
        row = runs[pid] | dict(wall=round(time.monotonic() - start, 2), cpu=round(used.ru_utime + used.ru_stime, 2),
                               rc=os.waitstatus_to_exitcode(status))
        said = said_cost((out / f"{row['name']}.log").read_text())
        if said:  # the trackers' own account: their CPU between preparing and the run's end, W&B's core included
            row["trackers_cpu_during"] = round(said["during"], 3)
        done.append(row)
    return sorted(done, key=lambda r: r["place"])


def pairs(rows: Sequence[dict]) -> list[tuple[dict, dict]]:
    """(plain, tracked) for places 2k and 2k+1 of each round."""
    by = {(r["round"], r["place"]): r for r in rows}
    out = []
    for (rnd, place), a in sorted(by.items()):
        b = by.get((rnd, place + 1))
        if place % 2 == 0 and b is not None:
            out.append((a, b) if a["kind"] == "plain" else (b, a))
    return out


def summary(rows: Sequence[dict]) -> list[str]:
    """The table printed last: medians by kind, the pairs' changes in wall and CPU, the trackers' own CPU."""
    ps = pairs(rows)
    change = [100 * (t["wall"] / p["wall"] - 1) for p, t in ps]
    cpu_change = [100 * (t["cpu"] / p["cpu"] - 1) for p, t in ps]
    own = [100 * t["trackers_cpu_during"] / t["wall"] for _, t in ps if "trackers_cpu_during" in t]
    se = statistics.stdev(change) / len(change) ** 0.5 if len(change) > 1 else float("nan")
    plain, tracked = (statistics.median(r["wall"] for r in rows if r["kind"] == k) for k in ("plain", "trackers"))
    return [
        f"| pairs | {len(ps)} (failed runs: {sum(r['rc'] != 0 for r in rows)}) |",
        f"| median wall, plain / trackers | {plain:.1f} s / {tracked:.1f} s ({100 * (tracked / plain - 1):+.2f}%) |",
        f"| pairs' wall change: mean (SE), median | {statistics.mean(change):+.2f}% ({se:.2f}), "
        f"{statistics.median(change):+.2f}% |",
        f"| pairs' wall change: min, max | {min(change):+.2f}%, {max(change):+.2f}% |",
        f"| pairs' change in the run's own CPU s: mean, median | {statistics.mean(cpu_change):+.2f}%, "
        f"{statistics.median(cpu_change):+.2f}% |",
        "| trackers' CPU during the run, % of its wall: median, max | "
        + (f"{statistics.median(own):.2f}%, {max(own):.2f}% |" if own else "not said |"),
    ]


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--study", default="studies/demo.yaml")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--out", type=Path, default=Path("runs/bench-trackers-pinned"))
    parser.add_argument("--cpus", type=int, default=2, help="CPUs per run (default 2: the demo's machine)")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    log = args.out / "runs.jsonl"
    rows = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    places = slots(physical_cpus(os.sched_getaffinity(0)), args.cpus)
    if len(places) < 2:
        sys.exit(f"trackers_pinned: {len(os.sched_getaffinity(0))} CPUs hold no pair of {args.cpus}-CPU runs")
    if not rows:  # what an earlier study leaves on a machine: MLflow's empty store in the cache
        subprocess.run([sys.executable, "-c", "from lora_sweep.sweep.trackers import _mlflow; _mlflow.prepare({})"],
                       check=True)
    print(f"{len(places)} runs a round on CPUs {places}", flush=True)
    first = max((r["round"] for r in rows), default=-1) + 1
    for index in range(first, first + args.rounds):
        new = _round(args.study, args.out, index, places)
        with log.open("a") as f:
            f.writelines(json.dumps(r) + "\n" for r in new)
        rows += new
        for r in new:
            said = f", trackers' CPU {r['trackers_cpu_during']} s" if "trackers_cpu_during" in r else ""
            print(f"round {r['round']} place {r['place']} {r['kind']}: wall {r['wall']} s, CPU {r['cpu']} s, "
                  f"rc {r['rc']}{said}", flush=True)
    for p, t in pairs(rows):
        change = 100 * (t["wall"] / p["wall"] - 1)
        print(f"round {p['round']}: plain {p['wall']} s, trackers {t['wall']} s: {change:+.2f}%")
    print("\n".join(summary(rows)))


if __name__ == "__main__":
    main()
