"""A journal file storage's own machinery: the lock its appends are made under and the repair of a torn last record.

Optuna's ``JournalStorage`` over a ``JournalFileBackend`` appends each change to one file as a JSON line, synced.
``store.storage``'s journal backend opens it with ``JournalFlock`` as the writer lock, sets a torn tail aside first
(``cut_torn_tail``) and names the first undecodable record of a journal damaged before its end (``first_bad_line``).
"""

from __future__ import annotations

import fcntl
import json
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from lora_sweep.store.directory import atomic_write_bytes

__all__ = ["JournalFlock", "cut_torn_tail", "first_bad_line"]


def _stderr(message: str) -> None:
    print(message, file=sys.stderr)


class JournalFlock:
    """The lock a journal file is appended under: an ``flock`` on ``<journal>.writer-lock`` (Optuna's
    ``lock_obj`` interface of ``JournalFileBackend``: ``acquire``, ``release``).

    Optuna's default (``JournalFileSymlinkLock``) is a symlink that a process killed mid-append leaves
    behind; the next writer then waits out its 30 s grace period. The kernel drops an flock when its
    process dies, however it dies, so a dead owner's lock is taken over at once. One process's threads
    (the heartbeat beside the step loop) are ordered by a thread lock first: an flock is held per open file.
    """

    def __init__(self, journal: Path) -> None:
        self.path = journal.with_name(journal.name + ".writer-lock")
        self._threads = threading.Lock()
        self._fd: int | None = None

    def acquire(self) -> bool:
        self._threads.acquire()
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            fcntl.flock(fd, fcntl.LOCK_EX)
        except BaseException:
            self._threads.release()
            raise
        self._fd = fd
        return True

    def release(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)
            self._threads.release()

    @contextmanager
    def held(self) -> Iterator[None]:
        self.acquire()
        try:
            yield
        finally:
            self.release()


def cut_torn_tail(path: Path, log: Callable[[str], None] = _stderr) -> Path | None:
    """Set aside a journal's torn last record; returns the file holding it (None when the journal is whole).

    Optuna writes each append as whole lines, then syncs; a process killed (or a disk filled) mid-append
    leaves the last line without its newline. Optuna's reader skips such a line as "still being
    written", but the next append would continue it into one undecodable line and make the whole
    journal unreadable. The bytes after the last newline are copied to ``<journal>.torn-<time>`` and cut,
    so every complete record stays and the next append starts a line of its own. The caller holds the
    journal's writer lock (``JournalFlock``): no live writer is mid-append.
    """
    with open(path, "rb+") as f:
        size = f.seek(0, os.SEEK_END)
        keep = size
        while keep > 0:  # back to the last newline, a block at a time
            start = max(0, keep - 65536)
            f.seek(start)
            block = f.read(keep - start)
            newline = block.rfind(b"\n")
            if newline >= 0:
                keep = start + newline + 1
                break
            keep = start
        if keep == size:
            return None
        f.seek(keep)
        torn = f.read()
        aside = path.with_name(f"{path.name}.torn-{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}")
        atomic_write_bytes(aside, torn)
        f.truncate(keep)
        f.flush()
        os.fsync(f.fileno())
    log(f"storage: {path} ended in a partial record ({len(torn)} bytes, left by a process stopped while it wrote); "
        f"kept every complete record and set the partial one aside in {aside}")
    return aside


def first_bad_line(path: Path) -> int | None:
    """The line number of the first record of journal ``path`` that does not decode (None: all do): what a torn
    record continued by a later append (an earlier version's resume) leaves."""
    with open(path, "rb") as f:
        for number, line in enumerate(f, start=1):
            try:
                json.loads(line)
            except ValueError:
                return number
    return None
