"""Shared Optuna storages: open one by URL, lock it across workers, keep heartbeats in it.

Several ``sweep worker`` processes (on one host or many) share one study through its Optuna storage
(notes §1.6): an RDB URL (``postgresql+psycopg2://...``, ``mysql+pymysql://...``, ``sqlite:///x.db``) or
a journal file (``journal:///abs/path.log``, or a plain ``*.log`` path) for processes on one host.

``storage_lock`` makes "count the trials that count + ask one" atomic across workers with a lock the
storage owns: PostgreSQL ``pg_advisory_lock``, MySQL ``GET_LOCK``, and an ``fcntl.flock`` on a file
beside a SQLite database or journal file. Heartbeats are a trial system attr (``attrs.HEARTBEAT``,
wall-clock seconds, written by ``sweep.ledger``) that works on every storage; Optuna's own heartbeats run
only inside ``Study.optimize`` (notes §1.5). The study's wall-time clock is a study user attr
(``attrs.CLOCK``), so every worker measures the wall-time budget from the same start (``resume_clock``,
``study_elapsed``).
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import optuna
from optuna.storages import BaseStorage

from lora_sweep.sweep.store import atomic_write_bytes, attrs

__all__ = ["Sharing", "JournalFlock", "cut_torn_tail", "damaged_record", "normalize_url", "open_storage",
           "storage_lock", "last_beat", "resume_clock", "study_elapsed"]

_JOURNAL = "journal://"


@dataclass(frozen=True)
class Sharing:
    """How one worker shares its study with others."""

    url: str
    """The shared Optuna storage URL (``normalize_url`` form)."""
    worker: int = 0
    """This worker's index (offsets the sampler seed, so workers started together propose different trials)."""
    heartbeat: float = 5.0
    """Seconds between the heartbeats of this worker's RUNNING trials."""
    grace: float = 60.0
    """A RUNNING trial whose last heartbeat is older than this belongs to a dead worker."""


def normalize_url(text: str) -> str:
    """A storage URL, or a plain ``*.log`` path turned into ``journal:///<absolute path>``."""
    if "://" not in text and text.endswith(".log"):
        return _JOURNAL + str(Path(text).expanduser().absolute())
    return text


def _journal_path(url: str) -> Path:
    return Path(url.removeprefix(_JOURNAL))


def _stderr(message: str) -> None:
    print(message, file=sys.stderr)


def open_storage(url: str, log: Callable[[str], None] | None = None) -> BaseStorage:
    """The Optuna storage behind ``url`` (journal file or RDB, with a patient SQLite).

    A journal file is appended to under ``JournalFlock`` (not Optuna's symlink lock, which a killed
    process leaves behind), and a torn last record is set aside first (``cut_torn_tail``, said on ``log``;
    default stderr).
    """
    if url.startswith(_JOURNAL):
        from optuna.storages.journal import JournalFileBackend

        path = _journal_path(url)
        path.parent.mkdir(parents=True, exist_ok=True)
        lock = JournalFlock(path)
        if path.is_file() and os.access(path, os.W_OK) and os.access(path.parent, os.W_OK):
            with lock.held():  # no other writer is mid-append: an unterminated tail is torn, not in progress
                cut_torn_tail(path, log or _stderr)
        return optuna.storages.JournalStorage(JournalFileBackend(str(path), lock_obj=lock))
    # SQLite serialises writers: wait for the lock instead of failing (Optuna FAQ).
    kwargs = {"connect_args": {"timeout": 60}} if url.startswith("sqlite") else {}
    db = Path(url.removeprefix("sqlite:///"))
    if url.startswith("sqlite:///") and "?" not in url and url != "sqlite:///:memory:" and db.parent.is_dir():
        _wal(db)  # (a missing folder is left to Optuna's own error)
    return optuna.storages.RDBStorage(url, engine_kwargs=kwargs, skip_table_creation=False)


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


def damaged_record(url: str) -> int | None:
    """The line number of the first record of journal ``url`` that does not decode (None: all do, or not a
    journal): what a torn record continued by a later append (an earlier version's resume) leaves."""
    if not url.startswith(_JOURNAL):
        return None
    import json

    with open(_journal_path(url), "rb") as f:
        for number, line in enumerate(f, start=1):
            try:
                json.loads(line)
            except ValueError:
                return number
    return None


def _wal(db: Path) -> None:
    """Put a SQLite file in write-ahead-log mode (kept in the file; results.db is in it too), before Optuna opens it.

    In its default rollback-journal mode every Optuna commit (each ``suggest_*``, user attr, ask and tell is one)
    syncs the journal twice, the database and the directory: about 12 commits per trial, 4 syncs each. In WAL mode
    a commit appends to the log and syncs it once; ``synchronous`` stays at its default (FULL), so a commit is as
    durable as before, a kill or a power loss after it keeps it. Readers (``sweep status``, the report, Optuna's
    dashboard) read a WAL file as before, on a local file system (a network one cannot hold a WAL database,
    nor results.db). The file is created here when missing: Optuna then creates its tables in it.
    """
    import sqlite3

    conn = sqlite3.connect(db, timeout=60)
    try:
        conn.execute("PRAGMA journal_mode=WAL")
    finally:
        conn.close()


_THREAD_LOCK = threading.Lock()  # threads of one process; the storage lock orders processes
_ENGINES: dict[str, Any] = {}


def _lock_key(name: str) -> int:
    return int.from_bytes(hashlib.sha256(f"lora-sweep:{name}".encode()).digest()[:8], "big", signed=True)


def _lock_file(url: str) -> Path | None:
    if url.startswith(_JOURNAL):
        return _journal_path(url).with_name(_journal_path(url).name + ".sweep-lock")
    if url.startswith("sqlite:///") and url != "sqlite:///:memory:":
        db = Path(url.removeprefix("sqlite:///"))
        return db.with_name(db.name + ".sweep-lock")
    return None


@contextmanager
def storage_lock(url: str, study_name: str) -> Iterator[None]:
    """Hold the study's lock in its storage: one worker at a time counts and asks."""
    with _THREAD_LOCK:
        path = _lock_file(url)
        if path is not None:
            with open(path, "a+") as f:
                fcntl.flock(f, fcntl.LOCK_EX)
                try:
                    yield
                finally:
                    fcntl.flock(f, fcntl.LOCK_UN)
            return
        import sqlalchemy as sa

        engine = _ENGINES.get(url)
        if engine is None:
            engine = _ENGINES[url] = sa.create_engine(url, poolclass=sa.pool.NullPool)
        with engine.connect() as conn:
            give = _take_server_lock(conn, url, study_name)
            try:
                yield
            finally:
                conn.execute(*give)


def _take_server_lock(conn: Any, url: str, study_name: str) -> tuple[Any, dict[str, Any]]:
    """Take the study's session-level lock on a database server; returns the statement that gives it back."""
    import sqlalchemy as sa

    dialect = url.split(":", 1)[0].split("+", 1)[0]
    if dialect == "postgresql":
        key = {"k": _lock_key(study_name)}
        conn.execute(sa.text("select pg_advisory_lock(:k)"), key)
        return sa.text("select pg_advisory_unlock(:k)"), key
    if dialect in ("mysql", "mariadb"):
        key = {"k": f"lora-sweep:{study_name}"[:64]}  # MySQL lock names are at most 64 characters
        # MariaDB rejects a negative (infinite) timeout with NULL and a warning: wait an hour at a time.
        # GET_LOCK answers 1 (taken), 0 (timed out) or NULL (error): only 1 may go on.
        while (got := conn.execute(sa.text("select get_lock(:k, 3600)"), key).scalar()) != 1:
            if got is None:
                raise RuntimeError(f"storage: GET_LOCK({key['k']!r}) failed on {dialect}")
        return sa.text("select release_lock(:k)"), key
    raise ValueError(f"storage: no cross-worker lock for {dialect!r} URLs (use PostgreSQL, MySQL, "
                     f"SQLite or a journal file)")


def last_beat(trial: optuna.trial.FrozenTrial) -> float:
    """Wall time of the trial's last heartbeat (its start when it never beat)."""
    beat = trial.system_attrs.get(attrs.HEARTBEAT)
    if beat is not None:
        return float(beat)
    return trial.datetime_start.timestamp() if trial.datetime_start is not None else 0.0


def resume_clock(study: optuna.Study, grace: float, *, earlier: float = 0.0, now: float | None = None) -> None:
    """Start the shared study's wall-time clock, or restart it when the study stood still.

    The clock is ``{"start": wall-clock seconds, "banked": seconds}``; ``study_elapsed`` is ``banked +
    now - start``. It mirrors a single ``sweep run``, whose wall time counts only while a run runs
    (resumed, it adds the earlier runs' seconds): when nothing happened in the study (no trial started,
    finished or beat) for ``grace`` seconds, no worker was alive (a live one beats its RUNNING trials
    every heartbeat), so the seconds up to that last activity are banked and the clock starts again
    now. Call it before reaping dead workers' trials: failing them now would make their ends look
    recent. Workers start the clock once their model is loaded, as a single run starts its clock after
    loading. The caller holds the storage lock.

    Args:
        study: The shared study.
        grace: The workers' grace period (``Sharing.grace``): this long without activity means stopped.
        earlier: Wall seconds of single-process runs of the study, banked when the clock starts.
        now: Wall-clock time (tests).
    """
    now = time.time() if now is None else now
    clock = study.user_attrs.get(attrs.CLOCK)
    if clock is None:
        study.set_user_attr(attrs.CLOCK, {"start": now, "banked": earlier})
        return
    last = max([clock["start"], *(_last_activity(t) for t in study.get_trials(deepcopy=False))])
    if now - last > grace:  # the study stood still
        study.set_user_attr(attrs.CLOCK, {"start": now, "banked": clock["banked"] + last - clock["start"]})


def _last_activity(trial: optuna.trial.FrozenTrial) -> float:
    """When the trial last showed life: its last heartbeat (or start), or its end."""
    done = trial.datetime_complete.timestamp() if trial.datetime_complete is not None else 0.0
    return max(done, last_beat(trial))


def study_elapsed(study: optuna.Study, now: float | None = None) -> float:
    """Wall seconds the shared study has run (``resume_clock``); 0 before its clock starts."""
    clock = study.user_attrs.get(attrs.CLOCK)
    if clock is None:
        return 0.0
    return float(clock["banked"]) + (time.time() if now is None else now) - float(clock["start"])
