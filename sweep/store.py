"""The results store: the layout of a study directory and the flat results tables of one study.

A study directory (default ``runs/<name>/``, see :class:`StudyDir`) holds::

    optuna.db            Optuna RDB storage, the source of truth for trials (``optuna-dashboard sqlite:///...``);
                         ``storage:`` in study.yaml may point to any other Optuna RDB URL instead
    results.db           the tables below, for SQL queries and the HTML report
    study.yaml           the resolved study the last run used (overrides and aliases applied; also meta ``spec``)
    adapters/trial-<n>/  each completed trial's adapter in PEFT format (``PeftModel.from_pretrained``)
    report.html          the static HTML report
    lock                 flock'ed by the one ``sweep run`` that owns the directory; holds its pid and host (JSON).
                         A second run finds it held and stops; a dead holder's lock is released by the kernel
                         and the next run takes it over (``StudyDir.acquire``)

Tables of results.db (open with ``sqlite3 runs/<name>/results.db`` or ``sqlite-utils``):

``study`` (PK key): key/value metadata; ``value`` is JSON. Keys: name (also the Optuna study name), storage (the
Optuna storage URL), model, data, objectives (list of metric names), directions (list of "minimize"/"maximize"),
spec (the resolved study as plain data, compared on resume: ``sweep.resume.spec_changes``), constraints (list of
{metric, op ("<=" or ">="), value}; a trial is feasible when its metrics meet them all, see ``is_feasible``),
created, updated (time of the last write), lora_sweep_version.

``trials`` (PK number): one row per Optuna trial.
    number            Optuna trial number.
    state             Optuna state name: RUNNING, COMPLETE, PRUNED, FAIL or WAITING.
    params            JSON object, hyperparameter name -> value.
    objective_values  JSON list, one value per objective, in the order of ``study.objectives``.
    metrics           JSON object, metric name -> final value (every evaluator metric, objectives included).
    user_attrs        JSON object, Optuna user attributes.
    adapter_path      The trial's adapter directory, relative to the study directory (adapters/trial-<n>).
    pack_id, slot     The pack and slot the trial trained in last.
    steps_done        Optimizer steps the trial completed.
    tokens            Training tokens the trial consumed.
    device_seconds    Device time attributed to the trial (its share of its packs' wall time).
    started, finished Start and end times.
    reason            Why the trial was pruned or failed (prune reason or exception text).

``steps`` (PK trial, step): per-step training curves; a resumed run rewriting a step replaces the row.
    trial, step       Trial number and the trial's own optimizer step (not the pack step).
    loss              Training loss of the step.  tokens: cumulative training tokens of the trial after it.
    lr, grad_norm     Learning rate used and gradient norm before clipping.  time: when the step ended.

``evals`` (PK trial, kind, step, metric): evaluations during (kind 'rung') and after (kind 'final') training.
    trial, step       Trial number and the trial step evaluated at.  time: when the evaluation ended.
    kind              'rung' (pruning evaluation) or 'final'.
    metric, value     Metric name and value.

``items`` (PK trial, evaluator, item): per-item results of the final evaluation, for paired statistics
(the same item index means the same example for every trial).
    trial, evaluator  Trial number and evaluator name.  item: index of the example in the evaluation set.
    score             Numeric per-item score (loss, 0/1 correctness, ...).  detail: JSON, anything else; a
                      generative evaluator's item keeps {prompt, output, reference} (the item is the prompt's id).

``packs`` (PK pack_id): one row per packed training run.
    pack_id           Number of the pack, assigned by the store (1, 2, ...).
    started, finished Start and end times.  wall_s: finished - started.
    slots             Number of slots (adapters trained at once).  device: device name.
    steps, tokens     Pack steps run and training tokens over all slots.  tokens_per_s: throughput.
    peak_mem_bytes    Peak device memory allocated.
    status            'running', 'finished', 'failed' or 'oom'; a pack left 'running' was killed.

``slot_spans`` (PK pack_id, slot, trial): the pack timeline, which trial sat in which slot when.
    pack_id, slot, trial      Pack, slot index and the trial in it.
    start_step, end_step      Pack steps at which the trial entered and left the slot.
    start_time, end_time      The same as times.
    end_reason                'finished' (max_steps reached), 'stopped' (pruned) or 'interrupted'; NULL while it trains.

``prune_decisions`` (PK pack_id, rung_step, trial): each decision of the cohort pruner.
    pack_id, rung_step, trial Pack, the trial step of the rung, and the trial decided on.
    decision                  'prune' or 'keep'.
    value, rank, cohort_size  The trial's rung value, its rank in the cohort (1 = best) and the cohort size.
    reason, time              Human-readable reason and decision time.

Conventions. Times are Unix epoch seconds (REAL; ``datetime(started, 'unixepoch')`` in SQL). JSON columns hold
JSON text: ``json_extract(params, '$.lr')``. Non-finite floats: inside JSON columns NaN, inf and -inf are written as
the strings "NaN", "Infinity" and "-Infinity" (JSON has no such numbers) and read back as floats, so a string
with one of those spellings is also read back as a float; in REAL columns inf and -inf are stored as SQLite's
native infinities and NaN as NULL (SQLite has no NaN), read back as None.

Concurrency. results.db runs in WAL mode; writes are short ``BEGIN IMMEDIATE`` transactions and connections wait
up to ``timeout`` seconds for a lock, so several processes of one host may write to one results.db. SQLite over a
network file system is unsafe: multi-host runs keep one results.db per host, or treat the Optuna RDB (PostgreSQL
or MySQL) as the truth and rebuild results from it.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.metadata
import json
import math
import os
import socket
import sqlite3
import tempfile
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import sqlite_utils

__all__ = [
    "DirectoryInUse", "DirectoryLock", "EvalRow", "ItemRow", "constraint_text", "constraint_violation",
    "is_feasible", "pareto_front", "redact_url", "strip_password", "PackRecord", "PruneDecision", "ResultsStore",
    "SlotSpan", "StepRow", "StudyDir",
    "TrialRecord", "atomic_write_bytes", "atomic_write_text",
]  # fmt: skip

SCHEMA_VERSION = 1
_NONFINITE = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}


def _encode(obj: Any) -> Any:
    if isinstance(obj, float) and not math.isfinite(obj):
        return "NaN" if math.isnan(obj) else ("Infinity" if obj > 0 else "-Infinity")
    if isinstance(obj, Mapping):
        return {k: _encode(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_encode(v) for v in obj]
    return _encode(obj.item()) if hasattr(obj, "item") else obj  # numpy / torch scalars


def _plain(value: Any) -> Any:
    """A numpy / torch scalar as a Python number (sqlite3 would store it as a BLOB); anything else unchanged."""
    return value.item() if hasattr(value, "item") else value


def _decode(obj: Any) -> Any:
    if isinstance(obj, str):
        return _NONFINITE.get(obj, obj)
    if isinstance(obj, dict):
        return {k: _decode(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_decode(v) for v in obj]
    return obj


def _dumps(obj: Any) -> str | None:
    return None if obj is None else json.dumps(_encode(obj), allow_nan=False)


def _loads(text: str | None) -> Any:
    return None if text is None else _decode(json.loads(text))


def _now(t: float | None) -> float:
    return time.time() if t is None else t


# ---------------------------------------------------------------- constraints


def constraint_violation(op: str, bound: float, x: Any) -> float:
    """Optuna's constraint value of metric value ``x`` against ``op bound``: feasible iff <= 0.

    A missing (None) or non-finite value violates by inf in both directions: a trial that did not
    measure the metric, or measured NaN, has not shown that it meets the bound.
    """
    if x is None or isinstance(x, bool) or not isinstance(x, int | float) or not math.isfinite(x):
        return math.inf
    return float(x) - bound if op == "<=" else bound - float(x)


def is_feasible(metrics: Mapping[str, Any] | None, constraints: Iterable[Mapping[str, Any]]) -> bool:
    """Whether ``metrics`` meet every constraint (``{metric, op, value}`` as in the ``constraints`` meta key)."""
    return all(constraint_violation(c["op"], float(c["value"]), (metrics or {}).get(c["metric"])) <= 0
               for c in constraints)


def pareto_front(points: Iterable[tuple[int, Sequence[float]]], directions: Sequence[str]) -> list[int]:
    """The keys of the points that no other point dominates, in input order: the one Pareto front that the
    status, the export, the run's summary and the report all show.

    Args:
        points: (trial number, its objective values), finite values only, one per direction.
        directions: ``minimize`` or ``maximize`` per objective.
    """
    signs = [1.0 if d == "minimize" else -1.0 for d in directions]
    pts = [(n, [s * v for s, v in zip(signs, vals, strict=True)]) for n, vals in points]

    def dominates(a: list[float], b: list[float]) -> bool:
        return all(x <= y for x, y in zip(a, b, strict=True)) and a != b

    return [n for n, v in pts if not any(dominates(w, v) for _, w in pts)]


def constraint_text(c: Mapping[str, Any]) -> str:
    """``metric <= value`` of one constraint."""
    return f"{c['metric']} {c['op']} {c['value']:g}"


# ---------------------------------------------------------------- storage URLs


def strip_password(url: str) -> str:
    """``url`` without its password, to be kept or shown (a journal path or a URL without one unchanged).

    The password of a PostgreSQL storage can come from ``PGPASSWORD`` or ``~/.pgpass`` instead (libpq
    reads both when the URL has none), of a MySQL one from ``?read_default_file=~/.my.cnf``.
    """
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    try:
        parsed = make_url(url)
    except ArgumentError:
        return url
    # URL.set(password=None) leaves the password as it is: None means "unchanged" there
    return url if parsed.password is None else parsed._replace(password=None).render_as_string(hide_password=False)


def redact_url(url: str) -> str:
    """``url`` with its password shown as ``***`` (SQLAlchemy's ``hide_password``), for messages and logs."""
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    try:
        parsed = make_url(url)
    except ArgumentError:
        return url
    return url if parsed.password is None else parsed.render_as_string(hide_password=True)


# ---------------------------------------------------------------- atomic writes


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so that readers see the old file or the new one, never a half-written file.

    Writes a temporary file in the same folder, fsyncs it, then ``os.replace``s it onto ``path``.
    """
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, path.stat().st_mode & 0o777 if path.exists() else 0o644)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    _fsync_dir(path.parent)


def atomic_write_text(path: str | Path, text: str, encoding: str = "utf-8") -> None:
    """Text version of :func:`atomic_write_bytes`."""
    atomic_write_bytes(path, text.encode(encoding))


def _fsync_dir(folder: Path) -> None:
    # Makes the rename itself durable; not possible on Windows.
    with contextlib.suppress(OSError):
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


# ---------------------------------------------------------------- study directory


class StudyDir:
    """Paths of one study directory; the only place that knows the layout (see the module docstring)."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self.optuna_db = self.root / "optuna.db"
        self.optuna_url = f"sqlite:///{self.optuna_db.resolve()}"  # the default Optuna storage
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


# ---------------------------------------------------------------- rows; the tables are derived from these


@dataclass(frozen=True)
class _MetaRow:
    key: str
    value: Any


@dataclass(frozen=True)
class TrialRecord:
    number: int
    state: str | None = None
    params: dict[str, Any] | None = None
    objective_values: list[float | None] | None = None
    metrics: dict[str, Any] | None = None
    user_attrs: dict[str, Any] | None = None
    adapter_path: str | None = None
    pack_id: int | None = None
    slot: int | None = None
    steps_done: int | None = None
    tokens: int | None = None
    device_seconds: float | None = None
    started: float | None = None
    finished: float | None = None
    reason: str | None = None


@dataclass(frozen=True)
class StepRow:
    trial: int
    step: int
    loss: float | None = None
    tokens: int | None = None
    lr: float | None = None
    grad_norm: float | None = None
    time: float | None = None


@dataclass(frozen=True)
class EvalRow:
    trial: int
    kind: str
    step: int
    metric: str
    value: float | None = None
    time: float | None = None


@dataclass(frozen=True)
class ItemRow:
    trial: int
    evaluator: str
    item: int
    score: float | None = None
    detail: Any = None


@dataclass(frozen=True)
class PackRecord:
    pack_id: int
    started: float | None = None
    finished: float | None = None
    slots: int | None = None
    steps: int | None = None
    tokens: int | None = None
    tokens_per_s: float | None = None
    peak_mem_bytes: int | None = None
    device: str | None = None
    wall_s: float | None = None
    status: str | None = None


@dataclass(frozen=True)
class SlotSpan:
    pack_id: int
    slot: int
    trial: int
    start_step: int | None = None
    end_step: int | None = None
    start_time: float | None = None
    end_time: float | None = None
    end_reason: str | None = None


@dataclass(frozen=True)
class PruneDecision:
    pack_id: int
    rung_step: int
    trial: int
    decision: str
    value: float | None = None
    rank: int | None = None
    cohort_size: int | None = None
    reason: str | None = None
    time: float | None = None


# table -> (row class, primary key). Column types follow the field annotations; other types are JSON (TEXT).
_TABLES: dict[str, tuple[type, tuple[str, ...]]] = {
    "study": (_MetaRow, ("key",)),
    "trials": (TrialRecord, ("number",)),
    "steps": (StepRow, ("trial", "step")),
    "evals": (EvalRow, ("trial", "kind", "step", "metric")),
    "items": (ItemRow, ("trial", "evaluator", "item")),
    "packs": (PackRecord, ("pack_id",)),
    "slot_spans": (SlotSpan, ("pack_id", "slot", "trial")),
    "prune_decisions": (PruneDecision, ("pack_id", "rung_step", "trial")),
}
_SQL_TYPES = {"int": "INTEGER", "float": "REAL", "str": "TEXT"}


def _columns(table: str) -> dict[str, str]:
    """Column -> SQL type of ``table``, or "JSON" for columns holding JSON text."""
    return {f.name: _SQL_TYPES.get(str(f.type).removesuffix(" | None"), "JSON") for f in fields(_TABLES[table][0])}


def _version() -> str:
    try:
        return importlib.metadata.version("lora-sweep")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


class ResultsStore:
    """Typed reads and writes of results.db (schema in the module docstring).

    Args:
        path: the results.db file.
        create: create the file and tables if missing; with False a missing file raises ``FileNotFoundError``.
        timeout: seconds to wait for another process's lock before ``sqlite3.OperationalError``.
    """

    def __init__(self, path: str | Path, *, create: bool = True, timeout: float = 30.0) -> None:
        self.path = Path(path)
        if not create and not self.path.is_file():
            raise FileNotFoundError(f"no results store at {self.path}")
        # isolation_level=None: no implicit transactions, every write runs in transaction() below.
        conn = sqlite3.connect(self.path, timeout=timeout, isolation_level=None)
        self.db = sqlite_utils.Database(conn, execute_plugins=False)
        version = conn.execute("PRAGMA user_version").fetchone()[0]
        if version > SCHEMA_VERSION:
            conn.close()
            raise RuntimeError(f"{self.path} has schema {version}; this lora-sweep reads up to {SCHEMA_VERSION}")
        if version < SCHEMA_VERSION:
            self._create_schema()

    def _create_schema(self) -> None:
        self.db.enable_wal()
        with self.transaction():
            for table, (_, pk) in _TABLES.items():
                types = {c: "TEXT" if ty == "JSON" else ty for c, ty in _columns(table).items()}
                self.db.table(table).create(types, pk=pk[0] if len(pk) == 1 else pk, not_null=pk, if_not_exists=True)
            self.db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
            now = _dumps(time.time())
            for key, value in (("created", now), ("lora_sweep_version", _dumps(_version()))):
                self.db.execute("INSERT OR IGNORE INTO study (key, value) VALUES (?, ?)", [key, value])

    def close(self) -> None:
        self.db.close()

    def __enter__(self) -> ResultsStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @contextlib.contextmanager
    def transaction(self) -> Iterator[None]:
        """Group writes into one transaction (nested calls join the outer one); sets ``study.updated``."""
        conn = self.db.conn
        if conn.in_transaction:
            yield
            return
        # IMMEDIATE takes the write lock up front, so a busy database waits (timeout) instead of failing on upgrade.
        conn.execute("BEGIN IMMEDIATE")
        try:
            yield
            conn.execute("INSERT OR REPLACE INTO study (key, value) VALUES ('updated', ?)", [_dumps(time.time())])
            conn.execute("COMMIT")
        except BaseException:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise

    def _put(self, table: str, rows: Iterable[Mapping[str, Any]], *, upsert: bool = False) -> None:
        cols, pk = _columns(table), _TABLES[table][1]
        encoded = []
        for row in rows:
            if unknown := set(row) - set(cols):
                raise ValueError(f"unknown {table} columns: {sorted(unknown)}")
            encoded.append({c: _dumps(v) if cols[c] == "JSON" else _plain(v) for c, v in row.items()})
        with self.transaction():
            if upsert:  # update only the given columns of an existing row
                self.db.table(table).upsert_all(encoded, pk=pk)
            else:  # replace the whole row
                self.db.table(table).insert_all(encoded, pk=pk, replace=True)

    def _get(self, table: str, where: dict[str, Any] | None = None, order: str = "") -> list[Any]:
        cls, pk = _TABLES[table]
        where = {k: v for k, v in (where or {}).items() if v is not None}
        clause = " AND ".join(f"[{k}] = :{k}" for k in where) or None
        rows = self.db.table(table).rows_where(clause, where, order_by=order or ", ".join(pk))
        cols = _columns(table)
        return [cls(**{k: _loads(v) if cols[k] == "JSON" else v for k, v in r.items()}) for r in rows]

    # ------------------------------------------------------------ writes

    def set_meta(self, **values: Any) -> None:
        """Set study metadata (name, model, data, objectives, directions, ...); values are stored as JSON."""
        self._put("study", [{"key": k, "value": v} for k, v in values.items()])

    def upsert_trial(
        self,
        number: int,
        *,
        state: str | None = None,
        params: Mapping[str, Any] | None = None,
        objective_values: Iterable[float] | None = None,
        metrics: Mapping[str, Any] | None = None,
        user_attrs: Mapping[str, Any] | None = None,
        adapter_path: str | None = None,
        pack_id: int | None = None,
        slot: int | None = None,
        steps_done: int | None = None,
        tokens: int | None = None,
        device_seconds: float | None = None,
        started: float | None = None,
        finished: float | None = None,
        reason: str | None = None,
    ) -> None:
        """Insert trial ``number`` or update it; arguments left None keep their stored value."""
        fields = dict(locals())
        del fields["self"]
        if objective_values is not None:
            fields["objective_values"] = list(objective_values)
        self._put("trials", [{k: v for k, v in fields.items() if v is not None}], upsert=True)

    def add_steps(self, trial: int, rows: Iterable[Mapping[str, Any]]) -> None:
        """Record training steps of ``trial``: mappings with ``step`` and any of loss, tokens, lr, grad_norm, time.

        A step written again (resume) replaces the earlier row.
        """
        self._put("steps", [{**row, "trial": trial} for row in rows])

    def add_eval(
        self, trial: int, step: int, metrics: Mapping[str, float], *, kind: str = "rung", at: float | None = None
    ) -> None:
        """Record an evaluation of ``trial`` at its step ``step``: metric name -> value; ``kind`` 'rung' | 'final'."""
        t = _now(at)
        rows = [
            {"trial": trial, "kind": kind, "step": step, "metric": m, "value": v, "time": t} for m, v in metrics.items()
        ]
        self._put("evals", rows)

    def add_items(
        self, trial: int, evaluator: str, scores: Iterable[float | None], details: Iterable[Any] = ()
    ) -> None:
        """Record per-item results of the final evaluation: item i gets ``scores[i]`` and ``details[i]`` (if given)."""
        scores, details = list(scores), list(details)
        if details and len(details) != len(scores):
            raise ValueError(f"{len(scores)} scores but {len(details)} details")
        rows = [
            {"trial": trial, "evaluator": evaluator, "item": i, "score": s, "detail": details[i] if details else None}
            for i, s in enumerate(scores)
        ]
        self._put("items", rows)

    def start_pack(self, *, slots: int, device: str | None = None, started: float | None = None) -> int:
        """Open a pack record with status 'running'; returns its ``pack_id``."""
        with self.transaction():
            cur = self.db.execute(
                "INSERT INTO packs (started, slots, device, status) VALUES (?, ?, ?, 'running')",
                [_now(started), slots, device],
            )
            return int(cur.lastrowid or 0)

    def finish_pack(
        self,
        pack_id: int,
        *,
        status: str = "finished",
        steps: int | None = None,
        tokens: int | None = None,
        peak_mem_bytes: int | None = None,
        tokens_per_s: float | None = None,
        finished: float | None = None,
    ) -> None:
        """Close a pack: wall_s is finished - started; tokens_per_s defaults to tokens / wall_s."""
        with self.transaction():
            started = self.db.execute("SELECT started FROM packs WHERE pack_id = ?", [pack_id]).fetchone()
            if started is None:
                raise KeyError(f"no pack {pack_id}")
            end = _now(finished)
            wall = end - started[0]
            if tokens_per_s is None and tokens is not None and wall > 0:
                tokens_per_s = tokens / wall
            row = {"pack_id": pack_id, "finished": end, "wall_s": wall, "status": status, "steps": steps,
                   "tokens": tokens, "peak_mem_bytes": peak_mem_bytes, "tokens_per_s": tokens_per_s}  # fmt: skip
            self._put("packs", [{k: v for k, v in row.items() if v is not None}], upsert=True)

    def open_span(
        self, pack_id: int, slot: int, trial: int, *, start_step: int, start_time: float | None = None
    ) -> None:
        """Record that ``trial`` entered ``slot`` of ``pack_id`` at pack step ``start_step``."""
        row = {"pack_id": pack_id, "slot": slot, "trial": trial, "start_step": start_step,
               "start_time": _now(start_time)}  # fmt: skip
        self._put("slot_spans", [row])

    def close_span(
        self, pack_id: int, slot: int, trial: int, *, end_step: int, end_reason: str, end_time: float | None = None
    ) -> None:
        """Record that ``trial`` left its slot at pack step ``end_step`` ('complete'|'pruned'|'failed'|'stopped')."""
        row = {"pack_id": pack_id, "slot": slot, "trial": trial, "end_step": end_step, "end_reason": end_reason,
               "end_time": _now(end_time)}  # fmt: skip
        self._put("slot_spans", [row], upsert=True)

    def add_prune_decision(
        self,
        pack_id: int,
        rung_step: int,
        trial: int,
        decision: str,
        *,
        value: float | None = None,
        rank: int | None = None,
        cohort_size: int | None = None,
        reason: str | None = None,
        at: float | None = None,
    ) -> None:
        """Record one cohort-pruner decision ('prune' | 'keep'); deciding the same rung again replaces it."""
        if decision not in ("prune", "keep"):
            raise ValueError(f"decision must be 'prune' or 'keep', got {decision!r}")
        row = {"pack_id": pack_id, "rung_step": rung_step, "trial": trial, "decision": decision, "value": value,
               "rank": rank, "cohort_size": cohort_size, "reason": reason, "time": _now(at)}  # fmt: skip
        self._put("prune_decisions", [row])

    # ------------------------------------------------------------ reads

    def meta(self) -> dict[str, Any]:
        return {r.key: r.value for r in self._get("study")}

    def trials(self, state: str | None = None) -> list[TrialRecord]:
        return self._get("trials", {"state": state})

    def trial(self, number: int) -> TrialRecord | None:
        found = self._get("trials", {"number": number})
        return found[0] if found else None

    def curves(self, trials: Iterable[int] | None = None) -> dict[int, list[StepRow]]:
        """Training curves: trial number -> steps in order (all trials, or those in ``trials``)."""
        rows = self._get("steps") if trials is None else [r for t in trials for r in self._get("steps", {"trial": t})]
        out: dict[int, list[StepRow]] = {}
        for row in rows:
            out.setdefault(row.trial, []).append(row)
        return out

    def evals(self, trial: int | None = None, kind: str | None = None) -> list[EvalRow]:
        return self._get("evals", {"trial": trial, "kind": kind})

    def items(self, evaluator: str | None = None, trial: int | None = None) -> list[ItemRow]:
        return self._get("items", {"evaluator": evaluator, "trial": trial})

    def packs(self) -> list[PackRecord]:
        return self._get("packs")

    def spans(self, pack_id: int | None = None) -> list[SlotSpan]:
        return self._get("slot_spans", {"pack_id": pack_id}, order="pack_id, slot, start_step")

    def prune_decisions(self, pack_id: int | None = None) -> list[PruneDecision]:
        return self._get("prune_decisions", {"pack_id": pack_id})
