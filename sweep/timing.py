"""Where a ``sweep run``'s wall time goes: load, compile/capture, train, evaluate, save, storage.

``WallSplit.phase(name)`` is a context manager that charges the wall time inside it to ``name``, *exclusively*:
a phase opened inside another (an evaluation inside the training loop's ``on_end`` callback, itself inside
``train``) stops the outer clock while it runs, so the phases add up to the run's wall time and nothing is
counted twice. The sweep wraps: the model and data load (``load``), the planner's calibration of
``pack: auto`` (``calibrate``; about nothing when the cache holds it), the ``packer.step.train`` call (``train``),
its callbacks' Optuna asks/tells and results-store writes (``storage``), evaluator calls (``evaluate``, with
``evaluate:<evaluator>`` beside it for each), adapter saving (``save``); the training loop's own kernel
precompile, warm-up and CUDA-graph capture seconds (``packer.step.train.TrainResult``) move from ``train`` to
``compile`` when the loop returns. ``train`` is then the step loop itself: host staging and the replayed or
eager steps, including the loss read-backs that wait for the GPU. ``load`` is parted (``WallSplit.part``) into
``load:model`` (the base model and tokenizer, to the device), ``load:study`` (results store, Optuna storage and
study) and ``load:data`` (the training and held-out examples, tokenized). What the process did before the run
(its imports and the study file, from the ``sweep`` package's import on: the part of a ``sweep run`` command's
wall outside the split) is recorded beside it as ``process_before_s``.

The clock is the host's: GPU work launched asynchronously is charged to the phase that waits for it (the
training step's read-back is in ``train``; evaluations and saves read their results, so they wait for their
own work). ``timing.json`` in the study directory keeps the split of every run of the study; ``sweep status``
shows the last one.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

__all__ = ["PHASES", "WallSplit", "append_run", "last_run", "seconds_since_import", "TIMING_FILE"]

PHASES = ("load", "calibrate", "compile", "train", "evaluate", "save", "storage")
"""The split's top-level phases, in the order the table prints them."""
TIMING_FILE = "timing.json"
T = TypeVar("T")


class WallSplit:
    """Exclusive wall seconds per phase (module docstring)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.counts: dict[str, int] = {}
        self._stack: list[str] = []
        self._mark = 0.0
        self.started = time.perf_counter()
        self.process_before_s = seconds_since_import()
        """Seconds since the process imported ``sweep`` when the split started (imports, the study file): for a
        ``sweep run`` the time before its run (``seconds_since_import``)."""

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Charge the wall time of the block, less that of the phases nested in it, to ``name``."""
        self._switch()
        self._stack.append(name)
        self.counts[name] = self.counts.get(name, 0) + 1
        try:
            yield
        finally:
            self._switch()
            self._stack.pop()

    def _switch(self) -> None:
        now = time.perf_counter()
        if self._stack:
            top = self._stack[-1]
            self.seconds[top] = self.seconds.get(top, 0.0) + now - self._mark
        self._mark = now

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
        """Plain data: wall seconds, the top-level phases (``other``: time outside any of them), the sub-phases."""
        wall = self.wall_s()
        top = {p: round(self.seconds.get(p, 0.0), 3) for p in PHASES}
        top["other"] = round(max(0.0, wall - sum(top.values())), 3)
        sub = {k: round(v, 3) for k, v in sorted(self.seconds.items()) if ":" in k}
        return {"wall_s": round(wall, 3), "phases": top, "detail": sub,
                "calls": {k: v for k, v in sorted(self.counts.items())},
                "process_before_s": round(self.process_before_s, 3)}

    def table(self, record: dict[str, Any] | None = None) -> str:
        """The split as aligned text lines: phase, seconds, share of the wall time."""
        rec = record or self.record()
        wall = max(rec["wall_s"], 1e-9)
        lines = [f"wall-time split of this run ({rec['wall_s']:.1f} s):"]
        for name, sec in rec["phases"].items():
            lines.append(f"  {name:<10} {sec:8.1f} s {100 * sec / wall:5.1f}%")
            for sub, s in rec["detail"].items():
                if sub.split(":", 1)[0] == name:
                    lines.append(f"    {sub.split(':', 1)[1]:<12} {s:6.1f} s")
        if rec.get("process_before_s") is not None:
            lines.append(f"  (before it in the process: {rec['process_before_s']:.1f} s: imports, study file)")
        return "\n".join(lines)


def seconds_since_import() -> float:
    """Wall seconds since this process imported ``lora_sweep`` (``lora_sweep.IMPORTED_AT``): its imports and
    whatever it did before now. Not /proc's start time: that is the fork's, which a shell that execs its last
    command in place (``(pip install ... && sweep run ...)``) puts at the start of the whole command line."""
    import lora_sweep

    return max(0.0, time.time() - lora_sweep.IMPORTED_AT)


def append_run(root: str | Path, record: dict[str, Any]) -> None:
    """Add one run's record to ``root/timing.json`` (written atomically; a resumed study keeps every run's)."""
    from lora_sweep.sweep.store import atomic_write_text

    path = Path(root) / TIMING_FILE
    runs = _runs(path)
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
