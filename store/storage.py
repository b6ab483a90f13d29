"""Shared Optuna storages: one backend object per URL scheme, to open a storage, lock it across workers, and keep
heartbeats in it.

Several ``sweep worker`` processes (on one host or many) share one study through its Optuna storage:
an RDB URL (``postgresql+psycopg2://...``, ``mysql+pymysql://...``, ``sqlite:///x.db``) or
a journal file (``journal:///abs/path.log``, or a plain ``*.log`` path) for processes on one host.

``BACKENDS`` lists a ``StorageBackend`` per scheme: the URL prefixes it takes, how it normalises a URL, how it opens
the Optuna storage, the one-owner lock that makes "count the trials that count + ask one" atomic across workers
(PostgreSQL ``pg_advisory_lock``, MySQL ``GET_LOCK``, an ``fcntl.flock`` on a file beside a SQLite database or
journal file), and the local file that holds it (a file storage is shared by the processes of one host; a server's
by any host that reaches it). Heartbeats are a trial system attr (``attrs.HEARTBEAT``,
wall-clock seconds, written by ``sweep.ledger``) that works on every storage; Optuna's own heartbeats run
only inside ``Study.optimize``. The study's wall-time clock is a study user attr
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
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import optuna
from optuna.storages import BaseStorage

from lora_sweep.errors import UserError, first_line
from lora_sweep.store import attrs
from lora_sweep.store._journal import JournalFlock, cut_torn_tail, first_bad_line
from lora_sweep.store._servers import answers, connect_timeout, driven_url
from lora_sweep.store.urls import redact_url

__all__ = ["Sharing", "StorageBackend", "BACKENDS", "backend_of", "JournalFlock", "cut_torn_tail", "normalize_url",
           "open_storage", "unopenable", "storage_lock", "check_directory", "claim_directory", "last_beat",
           "resume_clock", "study_elapsed"]

Log = Callable[[str], None]
Lock = Callable[[str, str], AbstractContextManager[None]]


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


def _same(url: str) -> str:
    return url


def _no_file(url: str) -> Path | None:
    return None


def _not_known(url: str) -> int | None:
    return None


@dataclass(frozen=True)
class StorageBackend:
    """One kind of Optuna storage, by the URLs it takes."""

    name: str
    """What the storage is, in messages."""
    prefixes: tuple[str, ...]
    """The URL prefixes it takes."""
    open: Callable[[str, Log], BaseStorage]
    """``(url, log) -> storage``: opens (creating when new) the Optuna storage; says what it repaired on ``log``."""
    lock: Lock
    """``(url, study name) -> context manager``: the study's one-owner lock in this storage, held by one process
    at a time (a second waits), taken whenever a process counts and asks trials."""
    file: Callable[[str], Path | None] = _no_file
    """The local file that holds the storage (None: a server). A file is shared by the processes of one host (its
    lock is an ``flock`` on a file beside it); a server by every host that reaches it."""
    suffixes: tuple[str, ...] = ()
    """A plain path (no ``://``) ending in one of these is this storage's too (``normalize`` makes it a URL)."""
    normalize: Callable[[str], str] = _same
    """A URL or plain path it takes -> the URL the study keeps."""
    damaged: Callable[[str], int | None] = _not_known
    """The first line of the storage that does not decode, for a storage that fails to open (None: not known)."""

    def takes(self, text: str) -> bool:
        """Whether ``text`` (a URL, or a plain path) is this backend's."""
        if text.startswith(self.prefixes):
            return True
        return bool(self.suffixes) and "://" not in text and text.endswith(self.suffixes)


def _stderr(message: str) -> None:
    print(message, file=sys.stderr)


# ---------------------------------------------------------------- the one-owner locks

_THREAD_LOCK = threading.Lock()  # threads of one process; the storage lock orders processes
_ENGINES: dict[str, Any] = {}


def _flock_beside(file: Callable[[str], Path | None]) -> Lock:
    """The lock of a file storage: an flock on ``<file>.sweep-lock`` (no file, as ``sqlite:///:memory:``: one
    process holds the storage, the thread lock orders it)."""

    @contextmanager
    def lock(url: str, study_name: str) -> Iterator[None]:
        path = file(url)
        if path is None:
            yield
            return
        with open(path.with_name(path.name + ".sweep-lock"), "a+") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)

    return lock


def _server_lock(take: Callable[[Any, str], tuple[Any, dict[str, Any]]]) -> Lock:
    """The lock of a database server: ``take(connection, study name)`` takes a session-level lock and returns the
    statement that gives it back."""

    @contextmanager
    def lock(url: str, study_name: str) -> Iterator[None]:
        import sqlalchemy as sa

        engine = _ENGINES.get(url)
        if engine is None:
            driven, args = answers(url)
            engine = _ENGINES[url] = sa.create_engine(driven, poolclass=sa.pool.NullPool, connect_args=args)
        with engine.connect() as conn:
            give = take(conn, study_name)
            try:
                yield
            finally:
                conn.execute(*give)

    return lock


def _lock_key(name: str) -> int:
    return int.from_bytes(hashlib.sha256(f"lora-sweep:{name}".encode()).digest()[:8], "big", signed=True)


def _pg_lock(conn: Any, study_name: str) -> tuple[Any, dict[str, Any]]:
    import sqlalchemy as sa

    key = {"k": _lock_key(study_name)}
    conn.execute(sa.text("select pg_advisory_lock(:k)"), key)
    return sa.text("select pg_advisory_unlock(:k)"), key


def _mysql_lock(conn: Any, study_name: str) -> tuple[Any, dict[str, Any]]:
    import sqlalchemy as sa

    key = {"k": f"lora-sweep:{study_name}"[:64]}  # MySQL lock names are at most 64 characters
    # MariaDB rejects a negative (infinite) timeout with NULL and a warning: wait an hour at a time.
    # GET_LOCK answers 1 (taken), 0 (timed out) or NULL (error): only 1 may go on.
    while (got := conn.execute(sa.text("select get_lock(:k, 3600)"), key).scalar()) != 1:
        if got is None:
            raise RuntimeError(f"storage: GET_LOCK({key['k']!r}) failed on {conn.dialect.name}")
    return sa.text("select release_lock(:k)"), key


# ---------------------------------------------------------------- opening each kind

_JOURNAL = "journal://"


def _journal_file(url: str) -> Path:
    return Path(url.removeprefix(_JOURNAL))


def _journal_url(text: str) -> str:
    """A plain ``*.log`` path as ``journal:///<absolute path>``."""
    return text if text.startswith(_JOURNAL) else _JOURNAL + str(Path(text).expanduser().absolute())


def _open_journal(url: str, log: Log) -> BaseStorage:
    """A journal file appended to under ``JournalFlock`` (not Optuna's symlink lock, which a killed process leaves
    behind), a torn last record set aside first (``cut_torn_tail``, said on ``log``)."""
    from optuna.storages.journal import JournalFileBackend

    path = _journal_file(url)
    path.parent.mkdir(parents=True, exist_ok=True)
    lock = JournalFlock(path)
    if path.is_file() and os.access(path, os.W_OK) and os.access(path.parent, os.W_OK):
        with lock.held():  # no other writer is mid-append: an unterminated tail is torn, not in progress
            cut_torn_tail(path, log)
    return optuna.storages.JournalStorage(JournalFileBackend(str(path), lock_obj=lock))


def _journal_damaged(url: str) -> int | None:
    return first_bad_line(_journal_file(url)) if _journal_file(url).is_file() else None


def _sqlite_file(url: str) -> Path | None:
    if url == "sqlite:///:memory:" or not url.startswith("sqlite:///"):
        return None
    return Path(url.removeprefix("sqlite:///").split("?", 1)[0])


def _open_sqlite(url: str, log: Log) -> BaseStorage:
    """A patient SQLite file (SQLite serialises writers: wait for the lock instead of failing, Optuna FAQ) in
    write-ahead-log mode."""
    db = _sqlite_file(url)
    if db is not None and "?" not in url and db.parent.is_dir():
        _wal(db)  # (a missing folder is left to Optuna's own error)
    return optuna.storages.RDBStorage(url, engine_kwargs={"connect_args": {"timeout": 60}}, skip_table_creation=False)


def _server_url(url: str) -> str:
    """A server's URL as given, once its driver is known to be installed and its connect timeout readable."""
    connect_timeout(url)  # the URL's own mistakes first, then whether a driver for it is installed
    driven_url(url)
    return url


def _open_server(url: str, log: Log) -> BaseStorage:
    """A database server's storage, once ``_answers`` saw it answer within the connect timeout."""
    driven, args = answers(url)
    return optuna.storages.RDBStorage(driven, engine_kwargs={"connect_args": args}, skip_table_creation=False)


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


BACKENDS: list[StorageBackend] = [
    StorageBackend("journal file", (_JOURNAL,), _open_journal, _flock_beside(_journal_file), file=_journal_file,
                   suffixes=(".log",), normalize=_journal_url, damaged=_journal_damaged),
    StorageBackend("SQLite", ("sqlite://",), _open_sqlite, _flock_beside(_sqlite_file), file=_sqlite_file),
    StorageBackend("PostgreSQL", ("postgresql",), _open_server, _server_lock(_pg_lock), normalize=_server_url),
    StorageBackend("MySQL", ("mysql", "mariadb"), _open_server, _server_lock(_mysql_lock), normalize=_server_url),
]
"""Every storage a study can use, by URL prefix; a new kind is one more ``StorageBackend`` here."""


def backend_of(text: str) -> StorageBackend:
    """The backend that takes ``text`` (a URL, or a plain ``*.log`` path).

    Raises:
        UserError: no backend takes it (one line).
    """
    for backend in BACKENDS:
        if backend.takes(text):
            return backend
    takes = ", ".join(p + "..." for b in BACKENDS for p in b.prefixes)
    raise UserError(f"storage: no storage takes {redact_url(text)!r} (expected {takes} or a path ending in .log)")


def normalize_url(text: str) -> str:
    """A storage URL, or a plain ``*.log`` path turned into ``journal:///<absolute path>``."""
    return backend_of(text).normalize(text)


def open_storage(url: str, log: Log | None = None) -> BaseStorage:
    """The Optuna storage behind ``url``, by its backend (``BACKENDS``); ``log`` hears what opening it repaired
    (a torn journal record set aside; default stderr).

    Raises:
        UserError: it cannot be opened (``unopenable``: one line).
    """
    backend = backend_of(url)
    try:
        return backend.open(url, log or _stderr)
    except Exception as err:  # SQLAlchemy and the drivers raise many types for an unreachable or malformed URL
        raise unopenable(url, err) from err


def unopenable(url: str, err: Exception) -> UserError:
    """The one-line error for a storage that cannot be opened (or locked): its URL and the first line of the
    cause (its type when it has no message), or the first record of a damaged journal."""
    if isinstance(err, UserError):
        return err
    cause = first_line(err)
    line = backend_of(url).damaged(url) if isinstance(err, ValueError) else None
    if line is not None:
        return UserError(f"storage: {backend_of(url).file(url)}:{line}: not a journal record ({cause}); the "
                         f"{line - 1} records before it are intact: keep a copy of the file, then cut it to them "
                         f"(head -n {line - 1}) to resume")
    password = _url_password(url)
    if password:  # a driver may quote the DSN back
        cause = cause.replace(password, "***")
    return UserError(f"storage: cannot open {redact_url(url)!r}: {cause}")


def _url_password(url: str) -> Any:
    """The password in an RDB URL, if any (None for journal paths and URLs without one)."""
    if "@" not in url:
        return None
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    try:
        return make_url(url).password
    except ArgumentError:
        return None


@contextmanager
def storage_lock(url: str, study_name: str) -> Iterator[None]:
    """Hold the study's lock in its storage (its backend's ``lock``): one worker at a time counts and asks."""
    with _THREAD_LOCK, backend_of(url).lock(url, study_name):
        yield


def check_directory(storage: BaseStorage, url: str, name: str, directory: Path) -> None:
    """Refuse a run without workers of study ``name`` in storage ``url`` (one outside the study directory: a study's
    ``storage:``) from ``directory`` when another study directory runs it (``claim_directory``). The caller holds
    the storage lock from here to ``claim_directory``, so of two runs started at once one is refused.

    Such a run takes every RUNNING trial of its study for one its own killed run left, and retries it; a run that
    failed before its first trial is deleted and started anew: two runs from two directories over one storage would
    each fail (or delete) the other's trials, and the first stop on its next tell (``UpdateFinishedTrialError``).
    Processes share a study as workers (``--workers``, ``--join``, ``sweep worker``), which tell a dead worker's
    trials from a live one's by their heartbeats.

    Raises:
        UserError: the study is recorded as run from another directory (one line naming both).
    """
    here = str(directory.absolute())
    try:
        owner = optuna.load_study(study_name=name, storage=storage).user_attrs.get(attrs.DIRECTORY)
    except KeyError:  # no such study yet
        return
    if owner is not None and owner != here:
        raise UserError(f"storage: study {name!r} in {redact_url(url)} is run from the study directory {owner}, not "
                        f"{here}: give --out {owner} to resume it there, or run it with --workers (--join to add "
                        "processes) to share it")


def claim_directory(study: optuna.Study, directory: Path) -> None:
    """Record ``directory`` as the study directory that runs ``study`` without workers (``check_directory``)."""
    here = str(directory.absolute())
    if study.user_attrs.get(attrs.DIRECTORY) != here:
        study.set_user_attr(attrs.DIRECTORY, here)


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
