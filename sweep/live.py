"""Live progress of a running pack: a rich bar on a terminal, plain lines anywhere else.

On a terminal the bar shows the finished trials, what the run is doing, the pack's step, slots, tokens/s, ETA and
the best so far, with log lines printed above it. Without one (``nohup``, CI, ``> run.log``) nothing redraws: every
trial event (started with its parameters, pruned, complete with its metrics, failed) is one timestamped line, and
a status line with the phase and the ETA comes at least once every ``every_s`` seconds, from a ticker thread, so a
long compile or evaluation still shows the run is alive and says which it is. Before the first packed step the
phase is the start's latest line (loading the base model, tokenizing the data, calibrating, the first step's
warm-up and compile); from the first step on, the frames' (training, evaluating), with the ETA counted in steps
(``sweep.eta``) less the seconds since the frame.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from types import TracebackType
from typing import TextIO

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from lora_sweep.sweep.session import Note
from lora_sweep.sweep.study import Progress as PackProgress

__all__ = ["LiveProgress", "PlainLog"]


class LiveProgress:
    """A progress bar over finished trials on a terminal; ``PlainLog`` lines otherwise (``plain``: force one).

    Args:
        enabled: False: no progress at all (``--quiet``); log lines are still printed.
        plain: Plain lines (True), the bar (False), or decide by whether stderr is a terminal (None).
        every_s: Plain mode: the most seconds between two status lines.
    """

    def __init__(self, enabled: bool = True, plain: bool | None = None, every_s: float = 60.0) -> None:
        self.console = Console(stderr=True)
        self.enabled = enabled
        plain = not self.console.is_terminal if plain is None else plain
        self.plain: PlainLog | None = PlainLog(self.console.file, every_s) if enabled and plain else None
        self.bar = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                            TextColumn("{task.fields[info]}"), TimeElapsedColumn(), console=self.console,
                            disable=not enabled or self.plain is not None)
        self.task = self.bar.add_task("trials", total=None, info=f"starting: {LOADING}")
        self.started = False

    def __enter__(self) -> LiveProgress:
        self.bar.__enter__()
        if self.plain is not None:
            self.plain.start()
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        if self.plain is not None:
            self.plain.stop()
        self.bar.__exit__(et, ev, tb)

    def update(self, p: PackProgress) -> None:
        if self.plain is not None:
            self.plain.update(p)
            return
        self.started = True
        self.bar.update(self.task, completed=p.finished, total=p.budget_trials, info=status_text(p))

    def log(self, message: str) -> None:
        """A line of the run's log; with progress off (``--quiet``), not its progress notes (``Note``)."""
        if not self.enabled and isinstance(message, Note):
            return
        phase = start_phase(message)
        if phase is not None and not self.started and self.plain is None:
            self.bar.update(self.task, info=f"starting: {phase}")
        if self.plain is not None:
            self.plain.line(message)
        else:
            self.console.print(message, highlight=False, soft_wrap=True)  # one message, one line: a log file's reader
            # (and a test) splits on newlines, and a terminal wraps a long line itself


class PlainLog:
    """Timestamped plain lines: each trial event, and a status line at least every ``every_s`` seconds.

    Args:
        out: Where the lines go (flushed after each).
        every_s: The most seconds between two status lines while the run lives.
        clock: Wall seconds (``time.time``; tests pass their own).
    """

    def __init__(self, out: TextIO, every_s: float = 60.0, clock: Callable[[], float] = time.time) -> None:
        self.out, self.every_s, self.clock = out, every_s, clock
        self.last: PackProgress | None = None
        self.last_at = 0.0
        """When ``last`` came: its ETA is counted down from then."""
        self.phase = LOADING
        """What the start is doing (``start_phase`` of its latest line), until the first frame."""
        self.started = clock()
        self.last_status = self.started
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Start the ticker thread that prints a status line when none came for ``every_s`` seconds."""
        self._thread = threading.Thread(target=self._tick, name="sweep-progress", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _tick(self) -> None:
        while not self._stop.wait(min(5.0, self.every_s)):
            self.tick()

    def tick(self) -> None:
        """A status line if the last one is ``every_s`` seconds old (the ticker calls this)."""
        if self.clock() - self.last_status >= self.every_s:
            self.status()

    def update(self, p: PackProgress) -> None:
        """A status line when a trial finished since the last frame, or when one is due (the trial events
        themselves are the run's log lines, printed as they happen)."""
        finished = self.last is not None and p.finished != self.last.finished
        self.last, self.last_at = p, self.clock()
        if finished or self.clock() - self.last_status >= self.every_s:
            self.status()

    def status(self) -> None:
        """The status line: trials finished (of the budget), phase, step, slots, tokens/s, ETA, best; before the first
        frame, the start's phase."""
        with self._lock:
            self.last_status = self.clock()
        elapsed = _clock(self.clock() - self.started)
        if self.last is None:
            self.line(f"starting ({elapsed} elapsed): {self.phase}")
        else:
            done = f"{self.last.finished}" + (f"/{self.last.budget_trials}" if self.last.budget_trials else "")
            self.line(f"progress: {done} trials finished  {status_text(self.last, self.clock() - self.last_at)}  "
                      f"elapsed {elapsed}")

    def line(self, message: str) -> None:
        phase = start_phase(message)
        if phase is not None:
            self.phase = phase
        stamp = time.strftime("%H:%M:%S", time.localtime(self.clock()))
        with self._lock:
            self.out.write(f"{stamp} {message}\n")
            self.out.flush()


LOADING = "loading"
_START_PHASES = (("loading the base model", "loading the base model"), ("tokenizing", "tokenizing the data"),
                 ("calibrating", "calibrating the memory model"), ("pack ", "the first step (warm-up, compile)"),
                 ("trial ", "the first step (warm-up, compile)"))
"""The start's log lines (``sweep.resume``, ``sweep.study``, ``sweep.calibration``) by their first words, and the
phase each begins: a trial starts in its slot just before the pack's first step, which warms up and compiles."""


def start_phase(message: str) -> str | None:
    """The phase of the start that the log line ``message`` begins; None for any other line."""
    return next((phase for head, phase in _START_PHASES if message.startswith(head)), None)


def status_text(p: PackProgress, since: float = 0.0) -> str:
    """What the run does (when not training), the pack's step, slots, tokens/s, ETA (the frame's, ``since`` seconds
    ago) and best so far, as the bar and the plain status line show them."""
    eta = "  ETA -" if p.eta_s is None else f"  ETA {_clock(max(0.0, p.eta_s - since))}"
    doing = "" if p.phase == "training" else f"{p.phase}  "
    return f"{doing}step {p.step}  slots {p.active}/{p.capacity}  {p.tokens_per_s:,.0f} tok/s{eta}  best {p.best}"


def _clock(seconds: float) -> str:
    """h:mm:ss of ``seconds``."""
    s = int(round(seconds))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"
