"""``sweep plan``'s predicted time against the run's, study by study: the check that the plan holds.

For each study file it runs, as a new user would, ``sweep plan STUDY`` (which calibrates into an empty calibration
cache of its own) and then ``sweep run STUDY --quiet`` into a fresh study directory (which reads that calibration),
each in its own process, and prints one row per study: the plan's predicted seconds for the trial budget, the run
command's wall seconds (from its start to its exit, report included) and their ratio, with the host's load average
before and after (the plan's time is measured on the host as it is: a busy shared one skews both).

Run:  python -m lora_sweep.benchmarks.plan_vs_run studies/tiny-demo.yaml studies/variants.yaml [--split]
      [--override key=value ...]
(``--split``: each study's plan parts, from its total line, how it had its step and what its storage counts,
beside its run's phases from ``timing.json`` and its pack steps.)
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
from dataclasses import dataclass, field
from pathlib import Path

from lora_sweep.sweep.timing import last_run

__all__ = ["PlanVsRun", "plan_vs_run", "predicted_seconds", "plan_total", "plan_row", "run_steps"]

_TOTAL = re.compile(r"^predicted time for the trial budget\s+(\d+(?:\.\d+)?) s(?: \((.*)\))?$", re.MULTILINE)
_STEPS = re.compile(r" in \d+(?:\.\d+)? s \((\d+) packed steps\); study in ")


@dataclass(frozen=True)
class PlanVsRun:
    """One study's plan against its run."""

    study: str
    predicted_s: float
    run_s: float
    load_before: float
    load_after: float
    plan_parts: str = ""
    """What the plan's total counts (its total line's parenthesis: steps, training, evaluation, turnover, ...)."""
    run_phases: dict[str, float] = field(default_factory=dict)
    """The run's own split (``timing.json``: seconds per phase), to read against ``plan_parts``."""
    plan_step: str = ""
    """How the plan had its step (its ``sized pack's step`` row: the steps timed, or why none)."""
    run_steps: int = 0
    """The run's pack steps (its summary line), to read the run's seconds per step off ``run_phases``."""
    plan_storage: str = ""
    """What the plan's storage counts (its ``predicted storage`` row: the trials, the curves, the report)."""

    @property
    def ratio(self) -> float:
        """Predicted over measured: 1 is exact, < 1 the plan was too low."""
        return self.predicted_s / self.run_s

    def row(self) -> str:
        return (f"| {self.study} | {self.predicted_s:.0f} | {self.run_s:.0f} | {self.ratio:.2f} | "
                f"{self.load_before:.1f} / {self.load_after:.1f} |")

    def split(self) -> str:
        """The plan's parts beside the run's phases, one line each (``--split``)."""
        phases = ", ".join(f"{k} {v:.1f} s" for k, v in self.run_phases.items() if v >= 0.05)
        steps = f" ({self.run_steps} pack steps)" if self.run_steps else ""
        return (f"{self.study}: plan: {self.plan_parts or '-'}\n{self.study}: plan's step: {self.plan_step or '-'}\n"
                f"{self.study}: plan's storage: {self.plan_storage or '-'}\n{self.study}: run{steps}: {phases or '-'}")


def predicted_seconds(plan_output: str) -> float:
    """The total of ``sweep plan``'s line ``predicted time for the trial budget``.

    Raises:
        ValueError: the output has no such line (a study without a trial budget, or a failed plan).
    """
    return plan_total(plan_output)[0]


def plan_total(plan_output: str) -> tuple[float, str]:
    """(the total, what it counts: the line's parenthesis) of the plan's total line; ValueError as
    ``predicted_seconds``."""
    match = _TOTAL.search(plan_output)
    if match is None:
        raise ValueError(f"no predicted time in the plan's output:\n{plan_output}")
    return float(match.group(1)), match.group(2) or ""


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
        plan = _sweep("plan", str(study), *overrides, env=env).stdout
        predicted, parts = plan_total(plan)
        t0 = time.perf_counter()
        run = _sweep("run", str(study), *overrides, "--out", str(Path(tmp) / "study"), "--quiet", env=env).stdout
        run_s = time.perf_counter() - t0
        record = last_run(Path(tmp) / "study") or {}
        return PlanVsRun(Path(study).name, predicted, run_s, load_before, os.getloadavg()[0], parts,
                         dict(record.get("phases", {})), plan_row(plan, "sized pack's step"), run_steps(run),
                         plan_row(plan, "predicted storage"))


def plan_row(plan_output: str, name: str) -> str:
    """The text of the plan's row ``name`` (``sized pack's step``: how many steps it timed, or why none); "" where it
    has none."""
    match = re.search(rf"^{re.escape(name)}\s{{2,}}(.*)$", plan_output, re.MULTILINE)
    return match.group(1) if match else ""


def run_steps(run_output: str) -> int:
    """The pack steps of ``sweep run``'s summary line; 0 where it has none."""
    match = _STEPS.search(run_output)
    return int(match.group(1)) if match else 0


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("studies", nargs="+", help="Study files (their models built).")
    parser.add_argument("--override", action="append", default=[], help="key=value for every study (repeatable).")
    parser.add_argument("--split", action="store_true",
                        help="After the table, each study's plan parts beside its run's phases (timing.json).")
    args = parser.parse_args(argv)
    print("| study | predicted s | run s | predicted / run | load avg before / after |")
    print("|---|---|---|---|---|")
    rows = []
    for study in args.studies:
        rows.append(plan_vs_run(study, tuple(args.override)))
        print(rows[-1].row(), flush=True)
    if args.split:
        print("\n" + "\n".join(r.split() for r in rows))


if __name__ == "__main__":
    main()
