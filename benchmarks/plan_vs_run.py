"""``sweep plan``'s predicted time against the run's, study by study: the check that the plan holds.

For each study file it runs, as a new user would, ``sweep plan STUDY`` (which calibrates into an empty calibration
cache of its own) and then ``sweep run STUDY --quiet`` into a fresh study directory (which reads that calibration),
each in its own process, and prints one row per study: the plan's predicted seconds for the trial budget, the run
command's wall seconds (from its start to its exit, report included) and their ratio, with the host's load average
before and after (the plan's time is measured on the host as it is: a busy shared one skews both).

Run:  python -m lora_sweep.benchmarks.plan_vs_run studies/tiny-demo.yaml studies/variants.yaml [-- key=value ...]
The models the studies name must exist (``sweep tiny-model --family llama --out models/tiny-llama``).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

__all__ = ["PlanVsRun", "plan_vs_run", "predicted_seconds"]

_TOTAL = re.compile(r"^predicted time for the trial budget\s+(\d+(?:\.\d+)?) s", re.MULTILINE)


@dataclass(frozen=True)
class PlanVsRun:
    """One study's plan against its run."""

    study: str
    predicted_s: float
    run_s: float
    load_before: float
    load_after: float

    @property
    def ratio(self) -> float:
        """Predicted over measured: 1 is exact, < 1 the plan was too low."""
        return self.predicted_s / self.run_s

    def row(self) -> str:
        return (f"| {self.study} | {self.predicted_s:.0f} | {self.run_s:.0f} | {self.ratio:.2f} | "
                f"{self.load_before:.1f} / {self.load_after:.1f} |")


def predicted_seconds(plan_output: str) -> float:
    """The total of ``sweep plan``'s line ``predicted time for the trial budget``.

    Raises:
        ValueError: the output has no such line (a study without a trial budget, or a failed plan).
    """
    match = _TOTAL.search(plan_output)
    if match is None:
        raise ValueError(f"no predicted time in the plan's output:\n{plan_output}")
    return float(match.group(1))


def _sweep(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    result = subprocess.run([sys.executable, "-m", "lora_sweep", *args], capture_output=True, text=True, env=env,
                            check=False)
    if result.returncode != 0:
        raise SystemExit(f"sweep {' '.join(args)} exited {result.returncode}:\n{result.stderr[-2000:]}")
    return result


def plan_vs_run(study: str | Path, overrides: tuple[str, ...] = (), work: Path | None = None) -> PlanVsRun:
    """Plan ``study`` into an empty calibration cache, then run it into a fresh directory; both timed here."""
    with tempfile.TemporaryDirectory(prefix="plan-vs-run-", dir=work) as tmp:
        env = {**os.environ, "LORA_SWEEP_CACHE": str(Path(tmp) / "cache")}
        load_before = os.getloadavg()[0]
        predicted = predicted_seconds(_sweep("plan", str(study), *overrides, env=env).stdout)
        t0 = time.perf_counter()
        _sweep("run", str(study), *overrides, "--out", str(Path(tmp) / "study"), "--quiet", env=env)
        run_s = time.perf_counter() - t0
        return PlanVsRun(Path(study).name, predicted, run_s, load_before, os.getloadavg()[0])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("studies", nargs="+", help="Study files (their models built).")
    parser.add_argument("--override", action="append", default=[], help="key=value for every study (repeatable).")
    args = parser.parse_args(argv)
    print("| study | predicted s | run s | predicted / run | load avg before / after |")
    print("|---|---|---|---|---|")
    for study in args.studies:
        print(plan_vs_run(study, tuple(args.override)).row(), flush=True)


if __name__ == "__main__":
    main()
