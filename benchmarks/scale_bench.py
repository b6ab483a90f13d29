"""Scale-out benchmark: trials per hour of the same study run by 1, 2, ... workers on one host.

A command, not a test: ``python -m lora_sweep.benchmarks.scale_bench STUDY --workers 1 2``. For each worker count it
runs ``sweep run STUDY --workers N`` (one worker process per GPU, pinned with ``CUDA_VISIBLE_DEVICES``)
in a fresh output folder with its own journal-file storage, and counts the finished trials in that
storage. Wall time is the whole command: process start, model load, every pack, every evaluation.
Heartbeats every 2 s (a worker that drained its last pack looks for the end of the others' RUNNING
trials every ``sweep.worker.WAIT_POLL_S``, whatever the heartbeat). A short warm-up study first
fills Triton's kernel cache, so no worker count pays the compile alone (list the larger worker count
first: kernels the warm-up missed are then compiled in its time, not in the one-worker baseline's).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from lora_sweep.benchmarks.timing import check_row
from lora_sweep.store.api import ResultsStore, StudyDir
from lora_sweep.sweep.worker import study_counts

__all__ = ["run_once", "main"]

FINISHED = ("COMPLETE", "PRUNED", "FAIL")


def run_once(study: str, workers: int, root: Path, *overrides: str, name: str | None = None, rep: int = 0) -> dict:
    """Run the study with ``workers`` workers in ``root/w<workers>`` (``-r<rep>`` after the first repeat);
    wall time and finished trials.

    Raises:
        SystemExit: a worker failed (its log is under the output folder's ``workers/``).
    """
    out = root / (f"w{workers}" if rep == 0 else f"w{workers}-r{rep}")
    storage = f"journal:///{(out / 'optuna.log').resolve().as_posix().lstrip('/')}"
    out.mkdir(parents=True, exist_ok=True)
    name = name or out.name.replace("w", "scale-w", 1)
    cmd = [sys.executable, "-m", "lora_sweep", "run", study, f"name={name}", *overrides, "--out", str(out),
           "--workers", str(workers), "--storage", storage, "--heartbeat", "2", "--quiet"]
    t0 = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} exited {done.returncode}:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    counts = study_counts(storage, name)
    finished = sum(counts[s] for s in FINISHED)
    store = ResultsStore(StudyDir(out).results_db, create=False)
    try:  # each worker's packs: the part of the wall time that is training, evaluating and telling
        packs = [dict(wall_s=round(p.wall_s or 0.0, 1), steps=p.steps, ms_per_step=round(1e3 * (p.wall_s or 0.0)
                      / max(1, p.steps or 0), 1)) for p in store.packs()]
    finally:
        store.close()
    return dict(workers=workers, rep=rep, wall_s=round(wall, 1), finished=finished, complete=counts["COMPLETE"],
                pruned=counts["PRUNED"], failed=counts["FAIL"], trials_per_hour=round(finished / wall * 3600, 1),
                packs=packs)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m lora_sweep.benchmarks.scale_bench", description=__doc__)
    parser.add_argument("study", help="study YAML (studies/scale-out.yaml)")
    parser.add_argument("overrides", nargs="*", help="KEY=VALUE overrides, as sweep run takes them")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2], help="worker counts to compare")
    parser.add_argument("--root", type=Path, default=Path("runs/scale-bench"), help="output folders go here")
    parser.add_argument("--no-warmup", action="store_true", help="skip the kernel-cache warm-up study")
    parser.add_argument("--warmup-trials", type=int, default=16,
                        help="trials of the warm-up study (3 steps each): enough packs to meet the mixes of ranks "
                             "and dropout whose kernels Triton compiles, so that no timed run compiles them")
    parser.add_argument("--repeat", type=int, default=1,
                        help="runs of each worker count, interleaved (2, 1, 2, 1, ...); the table compares medians")
    args = parser.parse_args(argv)
    if not args.no_warmup:
        run_once(args.study, 1, args.root / "warmup", *args.overrides, f"budget.trials={args.warmup_trials}",
                 "train.max_steps=3", name="scale-warmup")
    rows = []
    for rep in range(args.repeat):  # interleaved, so a drift of the machine's speed hits every count alike
        for n in args.workers:
            rows.append(check_row(run_once(args.study, n, args.root, *args.overrides, rep=rep), f"{n} workers"))
            print(json.dumps(rows[-1]), flush=True)
    rate = {n: statistics.median(r["trials_per_hour"] for r in rows if r["workers"] == n) for n in args.workers}
    base = rate[min(args.workers)]
    print(f"{'workers':>8}{'run':>5}{'wall s':>9}{'finished':>10}{'trials/h':>10}{'vs fewest':>10}")
    for r in rows:
        print(f"{r['workers']:>8}{r['rep']:>5}{r['wall_s']:>9.1f}{r['finished']:>10}{r['trials_per_hour']:>10.1f}"
              f"{r['trials_per_hour'] / base:>9.2f}x")
    if args.repeat > 1:
        for n in args.workers:
            print(f"{n:>8}  median {rate[n]:>10.1f} trials/h{rate[n] / base:>9.2f}x")


if __name__ == "__main__":
    main()
