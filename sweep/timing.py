"""Where a ``sweep run``'s wall time goes, from the process's start to its last line: every second named.

``WallSplit.phase(name)`` is a context manager that charges the wall time inside it to ``name``, *exclusively*:
a phase opened inside another (an evaluation inside the training loop's ``on_end`` callback, itself inside
``train``) stops the outer clock while it runs, so the phases add up to the split's wall time and nothing is
counted twice. The phases (``PHASES``, in the order the table prints them):

- ``import``: the interpreter's start up to the ``sweep`` command (``import:python``, until ``lora_sweep`` was
  imported; ``import:cli``, click and the command line), then the imports a run needs, each a part:
  ``import:torch``, ``import:transformers``, ``import:optuna`` and ``import:engine`` (the sweep's own modules,
  with the transformers submodules they name).
- ``read``: the study file read, checked and resolved (``sweep.config.loader``).
- ``load``: the model and data load, parted (``WallSplit.part``) into ``load:model`` (the base model and
  tokenizer, to the device), ``load:study`` (results store, Optuna storage and study) and ``load:data``.
- ``calibrate``: the planner's calibration of ``pack: auto`` (about nothing when the cache holds it).
- ``compile``: the training loop's kernel precompile, warm-up and CUDA-graph capture (``packer.step.train``'s
  ``TrainResult``), moved out of ``train`` when the loop returns.
- ``train``: the step loop itself: host staging and the replayed or eager steps, including the loss read-backs
  that wait for the GPU.
- ``evaluate``: the evaluator calls, with ``evaluate:<evaluator>`` beside it for each.
- ``save``: what the run waits for of its adapters' saving: their copy to the host, and a write still running
  when its trial is told (``packer.model.checkpoint.AdapterWriter`` writes them meanwhile; ``save:writer``, its
  threads' seconds, overlaps the other phases).
- ``storage``: the callbacks' Optuna asks and tells and results-store writes.
- ``report``: the HTML report written at the end.
- ``profile``: ``sweep run --profile``'s profiler started, stopped and its files written.
- ``other``: what no phase holds (the summary's lines, Python between the phases).

A ``sweep run`` command's split starts at the process's start (``process_started``: the kernel's start time of
the process), so its wall time is the command's. A run from the API (``run_study`` called by a program) starts
its split when the run starts; what the program did before is ``process_before_s``.

The clock is the host's: GPU work launched asynchronously is charged to the phase that waits for it (the
training step's read-back is in ``train``; evaluations read their results, so they wait for their own work).
Beside each phase's wall seconds the split keeps the process's CPU seconds in it (``cpu``: user and system time of
all its threads, charged the same exclusive way; child processes such as the trackers' are not counted). On a
shared or throttled host the wall seconds move from run to run; the CPU seconds of the same work do not move much,
so a phase that took longer at the same CPU seconds ran on a busier or slower host, and one whose CPU seconds grew
does more work.

``timing.json`` in the study directory keeps the split of every run of the study; ``sweep status`` shows the last
one. ``Profile`` (``sweep run --profile DIR``) adds a torch profiler trace of a window of packed steps, each
phase a named range in it.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path
from typing import Any, TypeVar

__all__ = ["PHASES", "WallSplit", "append_run", "last_run", "seconds_since_import", "TIMING_FILE",
           "process_started", "command_split", "run_split", "split_table"]

PHASES = ("import", "read", "load", "calibrate", "compile", "train", "evaluate", "save", "storage", "report", "profile")
"""The split's top-level phases, in the order the table prints them (``other`` follows)."""
TIMING_FILE = "timing.json"
EXEC_GAP_S = 2.0
"""The most seconds between the process's start and ``lora_sweep``'s import for the start to be the interpreter's:
more, and the process ran something else before it exec'd Python (a shell running its last command in place,
``(pip install ... && sweep run ...)``), whose time is not this command's."""
T = TypeVar("T")


class WallSplit:
    """Exclusive wall seconds per phase (module docstring).

    Args:
        start: the wall clock (``time.time()``) the split starts at; default now.
    """

    def __init__(self, start: float | None = None) -> None:
        self.seconds: dict[str, float] = {}
        self.counts: dict[str, int] = {}
        self._stack: list[str] = []
        now = time.perf_counter()
        self.started = now if start is None else now - max(0.0, time.time() - start)
        self._mark = self.started
        self.started_at = time.time() - (now - self.started)
        """The split's start as a wall clock time: the key of its run in ``timing.json``."""
        self.source = "run"
        """Where the split starts: ``process`` (the process's start), ``import`` (``lora_sweep``'s import, when the
        process's own start is not the interpreter's) or ``run`` (the run's start, a run from the API)."""
        self.process_before_s = 0.0 if start is not None else seconds_since_import()
        """Seconds of the process before the split started (imports, the study file, a program's own work): 0 for a
        split that starts with the process."""
        self.cpu: dict[str, float] = {}
        """The process's CPU seconds (user + system, all its threads; ``time.process_time``) charged to each phase
        as its wall time is: more CPU seconds than wall seconds is the phase's parallelism, and a phase whose wall
        grew at the same CPU seconds ran on a slower or busier host, not on more work."""
        self._cpu_mark = self.cpu_started = time.process_time()
        """The process's CPU seconds at the split's start (``command_split`` charges them to ``import``)."""
        self.label: Callable[[str], AbstractContextManager[Any]] | None = None
        """Opens a named range for each phase (``Profile``: a ``torch.profiler.record_function``), or None."""

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Charge the wall time of the block, less that of the phases nested in it, to ``name``."""
        self._switch()
        self._stack.append(name)
        self.counts[name] = self.counts.get(name, 0) + 1
        try:
            with self.label(name) if self.label is not None else nullcontext():
                yield
        finally:
            self._switch()
            self._stack.pop()

    def _switch(self) -> None:
        now, cpu = time.perf_counter(), time.process_time()
        if self._stack:
            top = self._stack[-1]
            self.seconds[top] = self.seconds.get(top, 0.0) + now - self._mark
            self.cpu[top] = self.cpu.get(top, 0.0) + cpu - self._cpu_mark
        self._mark, self._cpu_mark = now, cpu

    def timed(self, name: str, fn: Callable[..., T]) -> Callable[..., T]:
        """``fn`` with every call charged to phase ``name``."""
        def call(*args: Any, **kwargs: Any) -> T:
            with self.phase(name):
                return fn(*args, **kwargs)

        return call

    @contextmanager
    def part(self, name: str) -> Iterator[None]:
        """Add the wall time of the block to the sub-phase ``name`` (``load:model``), leaving the phases' clocks
        alone: a part of the phase it runs in, shown beneath it."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, time.perf_counter() - t0)

    def add(self, name: str, seconds: float) -> None:
        """Charge ``seconds`` measured elsewhere to ``name`` (e.g. per-evaluator times, which overlap ``evaluate``)."""
        self.seconds[name] = self.seconds.get(name, 0.0) + seconds

    def move(self, seconds: float, src: str, dst: str, detail: str | None = None) -> None:
        """Re-charge ``seconds`` of ``src`` to ``dst`` (the training loop's capture, counted by the loop itself),
        and to the sub-phase ``detail`` if given."""
        seconds = min(seconds, self.seconds.get(src, 0.0))
        self.seconds[src] = self.seconds.get(src, 0.0) - seconds
        self.add(dst, seconds)
        if detail is not None:
            self.add(detail, seconds)

    def wall_s(self) -> float:
        return time.perf_counter() - self.started

    def record(self) -> dict[str, Any]:
        """Plain data: wall seconds, the top-level phases (``other``: time outside any of them), the sub-phases,
        where the split starts (``source``, ``started_at``) and what the process did before it."""
        self._switch()  # a phase still open (the caller's) is counted up to now
        wall = self.wall_s()
        top = {p: round(self.seconds.get(p, 0.0), 3) for p in PHASES}
        top["other"] = round(max(0.0, wall - sum(top.values())), 3)
        sub = {k: round(v, 3) for k, v in self.seconds.items() if ":" in k}  # in the order they began
        cpu = {p: round(self.cpu.get(p, 0.0), 3) for p in PHASES}
        cpu["other"] = round(max(0.0, time.process_time() - self.cpu_started - sum(cpu.values())), 3)
        return {"wall_s": round(wall, 3), "phases": top, "cpu": cpu, "detail": sub,
                "calls": {k: v for k, v in sorted(self.counts.items())},
                "process_before_s": round(self.process_before_s, 3), "source": self.source,
                "started_at": round(self.started_at, 3)}

    def table(self, record: dict[str, Any] | None = None) -> str:
        """The split as aligned text lines (``split_table``)."""
        return split_table(record or self.record())


def split_table(rec: dict[str, Any], title: str = "this run") -> str:
    """A split's record as aligned text lines: phase, seconds, share of the wall time, its parts beneath it."""
    wall = max(rec["wall_s"], 1e-9)
    since = {"process": ", from the process's start", "import": ", from lora_sweep's import"}.get(rec.get("source", ""))
    lines = [f"wall-time split of {title} ({rec['wall_s']:.1f} s{since or ''}):"]
    cpu = rec.get("cpu", {})  # records written before it was kept have none
    for name, sec in rec["phases"].items():
        used = f"  cpu {cpu[name]:6.1f} s" if name in cpu else ""
        lines.append(f"  {name:<10} {sec:8.1f} s {100 * sec / wall:5.1f}%{used}")
        for sub, s in rec["detail"].items():
            if sub.split(":", 1)[0] == name:
                lines.append(f"    {sub.split(':', 1)[1]:<12} {s:6.1f} s")
    if rec.get("process_before_s"):
        lines.append(f"  (before it in the process: {rec['process_before_s']:.1f} s: imports, study file)")
    return "\n".join(lines)


def seconds_since_import() -> float:
    """Wall seconds since this process imported ``lora_sweep`` (``lora_sweep.IMPORTED_AT``): its imports and
    whatever it did before now."""
    import lora_sweep

    return max(0.0, time.time() - lora_sweep.IMPORTED_AT)


def process_started() -> tuple[float, str]:
    """(wall clock time, source) of this process's start: the kernel's start time of the process (``process``), or
    ``lora_sweep``'s import (``import``) where that is unknown (no /proc) or is not the interpreter's (more than
    ``EXEC_GAP_S`` before the import: the process ran a shell's commands before it exec'd Python)."""
    import lora_sweep

    try:
        started = _proc_start()
    except (OSError, ValueError, IndexError, AttributeError):  # not Linux, or /proc not mounted
        return lora_sweep.IMPORTED_AT, "import"
    if not 0.0 <= lora_sweep.IMPORTED_AT - started <= EXEC_GAP_S:
        return lora_sweep.IMPORTED_AT, "import"
    return started, "process"


def _proc_start() -> float:
    """The process's start from /proc/self/stat (field 22, clock ticks since boot), as a wall clock time; good to a
    tick (10 ms)."""
    with open("/proc/self/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()  # after the command name, which may hold spaces: field 3 on
    ticks = int(fields[22 - 3])
    age = time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
    return time.time() - age


_COMMAND: list[WallSplit] = []
"""The split ``command_split`` started, until ``run_split`` hands it to the run."""


def command_split() -> WallSplit:
    """The split of a command, from the process's start (``process_started``); the time until now is charged to
    ``import`` (``import:python`` up to ``lora_sweep``'s import, ``import:cli`` after it). The next ``run_split``
    call (the run's) continues it."""
    import lora_sweep

    start, source = process_started()
    split = WallSplit(start)
    split.source = source
    before = split.wall_s()
    python = min(before, max(0.0, lora_sweep.IMPORTED_AT - start))
    split.add("import", before)
    split.add("import:python", python)
    split.add("import:cli", before - python)
    split.cpu["import"], split.cpu_started = split.cpu_started, 0.0  # the process's CPU so far: its imports
    _COMMAND[:] = [split]
    return split


def run_split() -> WallSplit:
    """The split a run records: the command's (``command_split``), once, else one that starts now."""
    return _COMMAND.pop() if _COMMAND else WallSplit()


class Profile:
    """A torch profiler trace of a window of packed steps, and the run's split as a table (``sweep run --profile``).

    The profiler records the host's operators, and the GPU's kernels where CUDA is available, for ``steps`` packed
    steps from the step after ``skip`` (the first steps also compile and capture, which the split shows), each
    phase of the split a named range (``WallSplit.label``); a run shorter than that records up to its end. ``out``
    then holds ``trace.json`` (Chrome trace format: chrome://tracing, https://ui.perfetto.dev), ``ops.txt`` (the
    recorded operators by their own time, ``torch.profiler``'s ``key_averages`` table) and, once ``write_table`` is
    called, ``phases.txt`` (the split's table, as printed at the end of the run).
    """

    TRACE, OPS, TABLE = "trace.json", "ops.txt", "phases.txt"

    def __init__(self, out: str | Path, split: WallSplit, skip: int = 3, steps: int = 8) -> None:
        import torch

        self.out, self.skip, self.steps = Path(out), skip, steps
        self.out.mkdir(parents=True, exist_ok=True)
        acts = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            acts.append(torch.profiler.ProfilerActivity.CUDA)
        self._prof = torch.profiler.profile(activities=acts, record_shapes=False, with_stack=False)
        self._recording = self._done = False
        self._last = -1
        self._split = split
        split.label = self._label

    def _label(self, name: str) -> AbstractContextManager[Any]:
        if not self._recording:
            return nullcontext()
        import torch

        return torch.profiler.record_function(f"phase:{name}")

    def step(self, step: int) -> None:
        """Called with the pack's step count after each step (repeats are ignored): starts and ends the window."""
        if step == self._last or self._done:
            return
        self._last = step
        if not self._recording and step >= self.skip:
            with self._split.phase("profile"):
                self._prof.__enter__()
            self._recording = True
        elif self._recording and step >= self.skip + self.steps:
            self.stop()

    def stop(self) -> None:
        """End the window (if open) and write the trace and the operators' table."""
        if not self._recording or self._done:
            return
        self._done, self._recording = True, False
        with self._split.phase("profile"):
            self._prof.__exit__(None, None, None)
            self._prof.export_chrome_trace(str(self.out / self.TRACE))
            cuda = any(a.name == "CUDA" for a in self._prof.activities)
            ops = self._prof.key_averages().table(sort_by=f"self_{'cuda' if cuda else 'cpu'}_time_total", row_limit=40)
            (self.out / self.OPS).write_text(ops + "\n")

    def write_table(self, record: dict[str, Any]) -> Path:
        """Write the split's table to ``phases.txt``; returns its path."""
        path = self.out / self.TABLE
        path.write_text(split_table(record) + "\n")
        return path


def append_run(root: str | Path, record: dict[str, Any]) -> None:
    """Add one run's record to ``root/timing.json``, or replace the one with the same ``started_at`` (the command's
    record, completed after its run with the report); written atomically: a resumed study keeps every run's."""
    from lora_sweep.store.api import atomic_write_text

    path = Path(root) / TIMING_FILE
    runs = [r for r in _runs(path) if r.get("started_at") is None or r.get("started_at") != record.get("started_at")]
    runs.append(record)
    atomic_write_text(path, json.dumps({"runs": runs}, indent=1))


def last_run(root: str | Path) -> dict[str, Any] | None:
    """The last run's record in ``root/timing.json``, or None (no file, or one this version cannot read)."""
    runs = _runs(Path(root) / TIMING_FILE)
    return runs[-1] if runs else None


def _runs(path: Path) -> list[dict[str, Any]]:
    try:
        runs = json.loads(path.read_text()).get("runs", [])
    except (OSError, ValueError, AttributeError):
        return []
    return [r for r in runs if isinstance(r, dict) and isinstance(r.get("phases"), dict)]
