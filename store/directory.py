"""A study directory: its layout (``StudyDir``), its owner's lock, and atomic file writes; and the user's cache
(``cache_dir``).

The layout is documented in ``store.api``'s docstring.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import secrets
import shutil
import socket
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

__all__ = ["StudyDir", "DirectoryInUse", "DirectoryLock", "atomic_write_bytes", "atomic_write_text", "cache_dir",
           "scratch_directory"]


def cache_dir() -> Path:
    """What lora-sweep keeps between studies (calibrations, an empty MLflow store): ``$LORA_SWEEP_CACHE``, else
    ``$XDG_CACHE_HOME/lora-sweep``, else ``~/.cache/lora-sweep``."""
    if os.environ.get("LORA_SWEEP_CACHE"):
        return Path(os.environ["LORA_SWEEP_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "lora-sweep"


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so that readers see the old file or the new one, never a half-written file.

    Writes a temporary file in the same folder, fsyncs it, then ``os.replace``s it onto ``path``.
    """
    path = Path(path)
    # named before it is made (mkstemp names it after): a Ctrl-C or SIGTERM landing between the file's creation and
    # this frame holding its name would otherwise leave it behind
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(6)}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, path.stat().st_mode & 0o777 if path.exists() else 0o644)
        os.replace(tmp, path)
    except BaseException as err:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        if isinstance(err, OSError) and err.errno is not None and err.filename is None:  # a write names no file
            raise OSError(err.errno, err.strerror, str(path)) from err
        raise
    _fsync_dir(path.parent)


def atomic_write_text(path: str | Path, text: str, encoding: str = "utf-8") -> None:
    """Text version of :func:`atomic_write_bytes`."""
    atomic_write_bytes(path, text.encode(encoding))


@contextlib.contextmanager
def scratch_directory(beside: Path, prefix: str, mode: int = 0o777) -> Iterator[Path]:
    """A new directory ``<prefix><pid>-<random>`` in the folder ``beside``, for the caller to fill and rename into
    place; on exit, however the block ends (an error, Ctrl-C, SIGTERM), it is removed unless renamed away.

    Named before ``mkdir`` makes it (``tempfile.mkdtemp`` names it after): a signal landing between the two would
    leave a directory no name held. A name already taken carries this process's pid, so it is a dead process's
    leftover (pids are reused): another is drawn. ``mode`` is ``mkdir``'s, under the umask.
    """
    tmp: Path | None = None
    try:
        while True:
            tmp = beside / f"{prefix}{os.getpid()}-{secrets.token_hex(4)}"
            with contextlib.suppress(FileExistsError):
                tmp.mkdir(mode)
                break
        yield tmp
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


def _fsync_dir(folder: Path) -> None:
    # Makes the rename itself durable; not possible on Windows.
    with contextlib.suppress(OSError):
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)



class StudyDir:
    """Paths of one study directory; the only place that knows the layout (see the module docstring)."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self.optuna_log = self.root / "optuna.log"
        self.optuna_db = self.root / "optuna.db"
        self.results_db = self.root / "results.db"
        self.adapters = self.root / "adapters"
        self.report_html = self.root / "report.html"
        self.study_yaml = self.root / "study.yaml"
        self.lock = self.root / "lock"

    @classmethod
    def for_name(cls, name: str, runs: str | Path = "runs") -> StudyDir:
        """The default study directory ``runs/<name>/``."""
        return cls(Path(runs) / name)

    def __repr__(self) -> str:
        return f"StudyDir({str(self.root)!r})"

    @property
    def optuna_url(self) -> str:
        """The study's default Optuna storage: the journal file ``optuna.log``, or ``optuna.db`` (SQLite) in a
        directory an earlier version created, which keeps it.

        A journal (Optuna's ``JournalStorage``) appends each change to one file, synced; an ask-tell round trip
        through it takes a fraction of the time SQLite's ORM does (2.0 -> 0.5 s of storage in a 48-trial CPU
        sweep, BENCHMARKS.md), and ``sweep run`` waits for each with the GPU idle."""
        if self.optuna_db.is_file():
            return f"sqlite:///{self.optuna_db.resolve()}"
        return f"journal://{self.optuna_log.resolve()}"

    def adapter_dir(self, number: int) -> Path:
        """Adapter directory of trial ``number``: ``adapters/trial-<number>``."""
        return self.adapters / f"trial-{number}"

    def exists(self) -> bool:
        return self.root.is_dir()

    def is_study(self) -> bool:
        """True when the folder holds a study: results.db and study.yaml."""
        return self.results_db.is_file() and self.study_yaml.is_file()

    def create(self) -> StudyDir:
        """Create the folder and ``adapters/`` (existing ones are kept)."""
        self.adapters.mkdir(parents=True, exist_ok=True)
        return self

    def write_study_yaml(self, text: str) -> None:
        """Atomically write the resolved study file."""
        atomic_write_text(self.study_yaml, text)

    def acquire(self, **info: Any) -> DirectoryLock:
        """Take the directory's exclusive lock (created with the folder); release it with ``release()``.
        ``info`` is recorded beside the pid and host (a shared study's storage URL, without its password).

        Raises:
            DirectoryInUse: a live process holds it.
        """
        self.root.mkdir(parents=True, exist_ok=True)
        return DirectoryLock(self.lock, info)


class DirectoryInUse(RuntimeError):
    """The study directory's lock is held by another live process."""

    def __init__(self, path: Path, holder: dict[str, Any]) -> None:
        self.path, self.holder = path, holder
        super().__init__(f"{path.parent} is in use by pid {holder.get('pid', '?')} on host "
                         f"{holder.get('host', '?')} (lock {path})")


class DirectoryLock:
    """An exclusive ``flock`` on a study directory's lock file, holding the owner's pid and host.

    The kernel drops a flock when its process dies, however it dies, so a stale lock never blocks:
    the file may still name the dead owner (a kill leaves it), and the next owner takes it over
    (``taken_over`` is that owner's record). flock works on local file systems and on NFS (Linux
    emulates it with POSIX locks there).
    """

    def __init__(self, path: Path, info: Mapping[str, Any] | None = None) -> None:
        self.path = path
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(fd)
            os.close(fd)
            raise DirectoryInUse(path, holder) from None
        self._fd: int | None = fd
        self.taken_over = _holder(fd) or None
        record = json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "started": time.time(), **(info or {})})
        os.ftruncate(fd, 0)
        os.pwrite(fd, record.encode() + b"\n", 0)
        os.fsync(fd)

    def took_over(self) -> str | None:
        """The line saying whose lock this took over (an owner that ended without releasing it), or None."""
        if not self.taken_over:
            return None
        return (f"took over {self.path} from pid {self.taken_over.get('pid', '?')} on host "
                f"{self.taken_over.get('host', '?')}, which ended without releasing it")

    def release(self) -> None:
        """Empty the file (a clean exit leaves no owner behind) and drop the lock; idempotent."""
        if self._fd is None:
            return
        os.ftruncate(self._fd, 0)
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)
        self._fd = None

    def __enter__(self) -> DirectoryLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _holder(fd: int) -> dict[str, Any]:
    """The owner record in a lock file ({} when empty or unreadable: written by nothing we know)."""
    try:
        data = json.loads(os.pread(fd, 4096, 0) or b"{}")
    except ValueError:
        return {}
    return data if isinstance(data, dict) else {}

