"""What keeps the trackers' process within bounds: its output without passwords (``Redacted``), its record checked
(``checked``), the study directory's holder (``lock_holder``: a run refused the directory logs nothing), and a
tracker that talks to a server given a bounded time a call (``Bounded``, ``deadline``)."""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TextIO

from lora_sweep.store.api import redact_url
from lora_sweep.sweep.trackers.base import Tracker

__all__ = ["CALL_S", "END_S", "Bounded", "NoAnswer", "Redacted", "checked", "deadline", "lock_holder"]

CALL_S = 10.0
"""The longest a call of a tracker that talks to a server may take (its run opened, a batch logged, its end): one
that cannot connect is given up after it, with one line."""
END_S = 8.0
"""The time such a tracker has, all calls together, once the run has ended (the run waits for the trackers' last
pass): a server that does not answer costs the run's end at most this."""


class NoAnswer(Exception):
    """A tracker's call ran past its time. Not a ``TimeoutError``: an HTTP client takes that for a read timeout of
    its own and retries."""


class Redacted(io.TextIOBase):
    """A text stream whose writes go to ``stream`` with every URI's password hidden (``redact_url``)."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream

    def write(self, text: str) -> int:
        self.stream.write(redact_url(text))
        return len(text)

    def flush(self) -> None:
        self.stream.flush()

    def close(self) -> None:
        self.stream.close()

    def fileno(self) -> int:
        return self.stream.fileno()

    def isatty(self) -> bool:
        return self.stream.isatty()

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return self.stream.encoding

    def __getattr__(self, name: str) -> Any:  # the rest of a text stream (``buffer``, ``errors``, ...) as it is
        return getattr(self.stream, name)


def checked(state: Any) -> dict[str, Any]:
    """``trackers.json``'s data, its shape checked: tracker -> {parent, trials: number -> {run, step, ended}}.

    Raises:
        ValueError: naming what is not as written.
    """
    if not isinstance(state, dict):
        raise ValueError(f"not a mapping of trackers (a {type(state).__name__})")
    for name, mine in state.items():
        if not isinstance(mine, dict) or not isinstance(mine.get("trials", {}), dict):
            raise ValueError(f"{name}: not a mapping with trials")
        if not isinstance(mine.get("parent"), str | None):
            raise ValueError(f"{name}: parent is not a run id")
        for number, c in mine.get("trials", {}).items():
            if not (number.isdigit() and isinstance(c, dict) and isinstance(c.get("run"), str | None)
                    and type(c.get("step")) is int and type(c.get("ended")) is bool):
                raise ValueError(f"{name}: trial {number!r} is not {{run, step, ended}}")
        mine.setdefault("trials", {})
    return state


def lock_holder(lock: Path) -> int | None:
    """The pid of the live process of this host holding the study directory's lock (``StudyDir.acquire``), or
    None: no holder (the file empty, absent or unreadable; the holder dead)."""
    try:
        holder = json.loads(lock.read_text(encoding="utf-8") or "{}")
    except (OSError, ValueError):
        return None
    pid = holder.get("pid") if isinstance(holder, dict) else None
    if not isinstance(pid, int) or holder.get("host") != socket.gethostname():
        return pid if isinstance(pid, int) else None  # another host's: taken as alive
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:
        pass
    return pid


class Bounded:
    """A tracker that talks to a server, each of its calls given at most ``CALL_S`` seconds, and all of them together
    ``END_S`` once ``end`` was called (``deadline``)."""

    def __init__(self, tracker: Tracker) -> None:
        self.tracker, self.name, self.remote = tracker, tracker.name, True
        self.end_by: float | None = None

    def end(self) -> None:
        """The run has ended: what is left of this tracker's work has ``END_S`` seconds."""
        self.end_by = time.monotonic() + END_S

    def __getattr__(self, method: str) -> Callable[..., Any]:
        call = getattr(self.tracker, method)

        def bounded(*args: Any, **kwargs: Any) -> Any:
            left = CALL_S if self.end_by is None else min(CALL_S, self.end_by - time.monotonic())
            with deadline(left):
                return call(*args, **kwargs)

        return bounded


@contextlib.contextmanager
def deadline(seconds: float) -> Iterator[None]:
    """Raise ``NoAnswer`` in this (the main) thread if the block runs past ``seconds`` (at once when none is left): a
    tracker's call to a server that never answers, where its own timeouts do not apply."""
    if seconds <= 0:
        raise NoAnswer("no time left at the run's end")

    def expire(signum: int, frame: Any) -> None:
        raise NoAnswer(f"no answer in {seconds:.0f} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
