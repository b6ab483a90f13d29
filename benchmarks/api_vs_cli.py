"""The Python API against the ``sweep`` command on one study, with busy processes beside both: the API's threads.

Each repeat runs the same study three ways, each in a fresh process and a fresh study directory, in turn:
``sweep run STUDY`` (the CLI), ``python -c "import lora_sweep; lora_sweep.run(...)"`` (the API, imported first, as
a script does) and the same with ``import torch`` before ``lora_sweep`` (as a notebook that used torch already does:
the OpenMP runtime then read its wait policy before ``lora_sweep`` could set it, and the run trains on one thread,
``lora_sweep.api.engine_threads``). ``--busy N`` processes spin beside them the whole time (a shared CPU: the case where
spinning OpenMP threads made the API several times slower than the CLI). Each way's seconds are its process's wall
time from start to exit; the table gives the median of the repeats and the API's ratio to the CLI (issue 53's
target: at most 1.3x).

Run:  sweep tiny-model --family llama --out models/tiny-llama
      python -m lora_sweep.benchmarks.api_vs_cli [--study studies/tiny-demo.yaml] [--repeats 3] [--busy 1]
      [-- key=value ...]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

__all__ = ["WAYS", "time_way"]

OVERRIDES = ("budget.trials=6", "train.max_steps=40", "pruning.rungs=[20]", "pack.max_slots=6")
"""A study small enough to repeat: six trials in one pack of 40 steps, a rung at step 20."""

_API = "import lora_sweep; lora_sweep.run({study!r}, {overrides!r}, out={out!r})"
WAYS = {
    "cli": lambda study, overrides, out: [sys.executable, "-m", "lora_sweep", "run", study, "--out", out, "--quiet",
                                          *overrides],
    "api": lambda study, overrides, out: [sys.executable, "-c", _API.format(study=study, overrides=overrides,
                                                                              out=out)],
    "api, torch first": lambda study, overrides, out: [
        sys.executable, "-c", "import torch; " + _API.format(study=study, overrides=overrides, out=out)],
}
"""Each way's command for a study file, its overrides and a fresh study directory."""


def time_way(way: str, study: str, overrides: tuple[str, ...], out: Path) -> float:
    """Wall seconds of one run of ``way`` (a ``WAYS`` key) from its process's start to its exit."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}  # the caller's policy is not the test's
    start = time.perf_counter()
    done = subprocess.run(WAYS[way](study, list(overrides), str(out)), env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"{way} failed (exit {done.returncode}): {done.stderr.strip()[-2000:]}")
    return seconds


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--study", default="studies/tiny-demo.yaml")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--busy", type=int, default=1, help="processes spinning beside the runs")
    parser.add_argument("override", nargs="*", help=f"key=value (default: {' '.join(OVERRIDES)})")
    args = parser.parse_args(argv)
    overrides = tuple(args.override) or OVERRIDES
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.busy)]
    seconds: dict[str, list[float]] = {way: [] for way in WAYS}
    try:
        with tempfile.TemporaryDirectory(prefix="api-vs-cli-") as work:
            for r in range(args.repeats):
                for way in WAYS:
                    out = Path(work) / f"{r}-{way.replace(' ', '-').replace(',', '')}"
                    seconds[way].append(time_way(way, args.study, overrides, out))
                    print(f"repeat {r + 1}: {way:<17} {seconds[way][-1]:6.1f} s", flush=True)
    finally:
        for p in busy:
            p.kill()
    cli = statistics.median(seconds["cli"])
    print(f"\n{args.study} {' '.join(overrides)}; {args.busy} busy process(es); load average "
          f"{os.getloadavg()[0]:.1f}; median of {args.repeats}")
    print(f"{'way':<17} {'median':>8} {'runs':<24} {'/ cli':>6}")
    for way, runs in seconds.items():
        med = statistics.median(runs)
        print(f"{way:<17} {med:7.1f}s {', '.join(f'{s:.1f}' for s in runs):<24} {med / cli:5.2f}x")


if __name__ == "__main__":
    main()
