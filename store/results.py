"""``ResultsStore``: typed reads and writes of results.db (the schema is in ``store.api``'s docstring)."""

from __future__ import annotations

import contextlib
import errno
import importlib.metadata
import sqlite3
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import sqlite_utils

from lora_sweep.store.schema import (
    SCHEMA_VERSION,
    STEP_WORDS,
    TABLES,
    EvalRow,
    ItemRow,
    PackRecord,
    PruneDecision,
    SlotSpan,
    StepRow,
    TrialRecord,
    columns,
    from_json,
    now_or,
    plain,
    to_json,
)

__all__ = ["ResultsStore"]


def _version() -> str:
    try:
        return importlib.metadata.version("lora-sweep")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"



SQLITE_ERRNO = {"database or disk is full": errno.ENOSPC, "attempt to write a readonly database": errno.EROFS,
                "unable to open database file": errno.EACCES}
"""SQLite's messages (sqlite3 and SQLAlchemy errors carry no errno, nor the file) for a full disk, a read-only
file and a folder it cannot create its file in."""


def _os_error(err: sqlite3.Error, path: Path) -> Exception:
    """A SQLite error of ``SQLITE_ERRNO`` as the ``OSError`` it is, naming ``path``; any other as it is."""
    code = next((c for text, c in SQLITE_ERRNO.items() if text in str(err)), None)
    return OSError(code, str(err), str(path)) if code is not None else err


def _open_readonly(path: Path, timeout: float) -> sqlite3.Connection:
    """A read-only connection that writes nothing beside the file when it cannot.

    ``mode=ro`` reads a WAL database (the last writer's -wal included) and creates its -shm index when the
    folder lets it; in a read-only folder without one that fails, and ``immutable=1`` then reads the file as
    it is, taking no lock (a study there is finished: a closed writer checkpoints its -wal into the file).
    """
    uri = path.absolute().as_uri()
    try:
        conn = sqlite3.connect(f"{uri}?mode=ro", uri=True, timeout=timeout, isolation_level=None)
        conn.execute("PRAGMA user_version").fetchone()
        return conn
    except sqlite3.OperationalError:
        return sqlite3.connect(f"{uri}?immutable=1", uri=True, timeout=timeout, isolation_level=None)


class ResultsStore:
    """Typed reads and writes of results.db (schema in the module docstring).

    Args:
        path: the results.db file.
        create: create the file and tables if missing; with False a missing file raises ``FileNotFoundError``,
            and an existing one is opened read-only (``_open_readonly``: a study on a read-only mount reads).
        timeout: seconds to wait for another process's lock before ``sqlite3.OperationalError``.

    Raises:
        sqlite3.DatabaseError: the file is not a SQLite database (the message names it).
    """

    def __init__(self, path: str | Path, *, create: bool = True, timeout: float = 30.0) -> None:
        self.path = Path(path)
        if not create and not self.path.is_file():
            raise FileNotFoundError(f"no results store at {self.path}")
        # isolation_level=None: no implicit transactions, every write runs in transaction() below.
        try:
            conn = (sqlite3.connect(self.path, timeout=timeout, isolation_level=None) if create
                    else _open_readonly(self.path, timeout))
            version = conn.execute("PRAGMA user_version").fetchone()[0]
        except sqlite3.DatabaseError as err:
            if type(err) is not sqlite3.DatabaseError:  # locked, unopenable: not about the file's content
                raise _os_error(err, self.path) from err
            raise sqlite3.DatabaseError(f"{self.path}: {err} (not a results store)") from None
        self.db = sqlite_utils.Database(conn, execute_plugins=False)
        if version < SCHEMA_VERSION and not create:  # an earlier version's file: its schema is upgraded in place
            conn.close()
            conn = sqlite3.connect(self.path, timeout=timeout, isolation_level=None)
            self.db = sqlite_utils.Database(conn, execute_plugins=False)
        if version > SCHEMA_VERSION:
            conn.close()
            raise RuntimeError(f"{self.path} has schema {version}; this lora-sweep reads up to {SCHEMA_VERSION}")
        if version < SCHEMA_VERSION:
            self._create_schema()

    def _create_schema(self) -> None:
        self.db.enable_wal()
        with self.transaction():
            for table, (_, pk) in TABLES.items():
                types = {c: "TEXT" if ty == "JSON" else ty for c, ty in columns(table).items()}
                t = self.db.table(table)
                t.create(types, pk=pk[0] if len(pk) == 1 else pk, not_null=pk, if_not_exists=True)
                for col in types.keys() - t.columns_dict.keys():  # a column added since the file's schema version
                    t.add_column(col, types[col])
            self.db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
            now = to_json(time.time())
            for key, value in (("created", now), ("lora_sweep_version", to_json(_version()))):
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
        try:
            conn.execute("BEGIN IMMEDIATE")
            try:
                yield
                conn.execute("INSERT OR REPLACE INTO study (key, value) VALUES ('updated', ?)",
                             [to_json(time.time())])
                conn.execute("COMMIT")
            except BaseException:
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
                raise
        except sqlite3.OperationalError as err:  # a full disk or a read-only file, named (the transaction is undone)
            raise _os_error(err, self.path) from err

    def _put(self, table: str, rows: Iterable[Mapping[str, Any]], *, upsert: bool = False) -> None:
        cols, pk = columns(table), TABLES[table][1]
        encoded = []
        for row in rows:
            if unknown := set(row) - set(cols):
                raise ValueError(f"unknown {table} columns: {sorted(unknown)}")
            encoded.append({c: to_json(v) if cols[c] == "JSON" else plain(v) for c, v in row.items()})
        with self.transaction():
            if upsert:  # update only the given columns of an existing row
                self.db.table(table).upsert_all(encoded, pk=pk)
            else:  # replace the whole row
                self.db.table(table).insert_all(encoded, pk=pk, replace=True)

    def _get(self, table: str, where: dict[str, Any] | None = None, order: str = "") -> list[Any]:
        cls, pk = TABLES[table]
        where = {k: v for k, v in (where or {}).items() if v is not None}
        clause = " AND ".join(f"[{k}] = :{k}" for k in where) or None
        rows = self.db.table(table).rows_where(clause, where, order_by=order or ", ".join(pk))
        cols = columns(table)
        return [cls(**{k: from_json(v) if cols[k] == "JSON" else v for k, v in r.items()}) for r in rows]

    # ------------------------------------------------------------ writes

    def set_meta(self, **values: Any) -> None:
        """Set study metadata (name, model, data, objectives, directions, ...); values are stored as JSON. Only
        values that change are written: a run that changes nothing (a finished study's rerun) leaves ``updated``."""
        held = self.meta()
        changed = [{"key": k, "value": v} for k, v in values.items() if k not in held or to_json(held[k]) != to_json(v)]
        if changed:
            self._put("study", changed)

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
        self.add_curves({trial: rows})

    def add_curves(self, curves: Mapping[int, Iterable[Mapping[str, Any]]]) -> None:
        """``add_steps`` of several trials (trial -> its rows) in one insert: a pack's 16 trials written one insert
        each spent most of it in sqlite-utils' table introspection, repeated per insert."""
        self._put("steps", [{**row, "trial": trial} for trial, rows in curves.items() for row in rows])

    def add_eval(
        self, trial: int, step: int, metrics: Mapping[str, float], *, kind: str = "rung", at: float | None = None
    ) -> None:
        """Record an evaluation of ``trial`` at its step ``step``: metric name -> value; ``kind`` 'rung' | 'final'."""
        t = now_or(at)
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
                [now_or(started), slots, device],
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
        step: str | None = None,
        fallback: str | None = None,
    ) -> None:
        """Close a pack: wall_s is finished - started; tokens_per_s defaults to tokens / wall_s; ``step`` is the
        training step it ran (``packer.step.train``'s ``TrainResult.step``), ``fallback`` why it ran eagerly on
        CUDA (``TrainResult.fallback``)."""
        with self.transaction():
            started = self.db.execute("SELECT started FROM packs WHERE pack_id = ?", [pack_id]).fetchone()
            if started is None:
                raise KeyError(f"no pack {pack_id}")
            end = now_or(finished)
            wall = end - started[0]
            if tokens_per_s is None and tokens is not None and wall > 0:
                tokens_per_s = tokens / wall
            row = {"pack_id": pack_id, "finished": end, "wall_s": wall, "status": status, "steps": steps,
                   "tokens": tokens, "peak_mem_bytes": peak_mem_bytes, "tokens_per_s": tokens_per_s,
                   "step": step, "fallback": fallback}  # fmt: skip
            self._put("packs", [{k: v for k, v in row.items() if v is not None}], upsert=True)

    def open_span(
        self, pack_id: int, slot: int, trial: int, *, start_step: int, start_time: float | None = None
    ) -> None:
        """Record that ``trial`` entered ``slot`` of ``pack_id`` at pack step ``start_step``."""
        row = {"pack_id": pack_id, "slot": slot, "trial": trial, "start_step": start_step,
               "start_time": now_or(start_time)}  # fmt: skip
        self._put("slot_spans", [row])

    def close_span(
        self, pack_id: int, slot: int, trial: int, *, end_step: int, end_reason: str, end_time: float | None = None
    ) -> None:
        """Record that ``trial`` left its slot at pack step ``end_step`` ('complete'|'pruned'|'failed'|'stopped')."""
        row = {"pack_id": pack_id, "slot": slot, "trial": trial, "end_step": end_step, "end_reason": end_reason,
               "end_time": now_or(end_time)}  # fmt: skip
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
               "rank": rank, "cohort_size": cohort_size, "reason": reason, "time": now_or(at)}  # fmt: skip
        self._put("prune_decisions", [row])

    # ------------------------------------------------------------ reads

    def data_version(self) -> int:
        """SQLite's ``data_version``: it changes whenever another connection (the run's, to this connection a
        reader's) commits; a reader polling the store skips a read that would find nothing new."""
        return int(self.db.execute("PRAGMA data_version").fetchone()[0])

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
        """Every pack in order; ``step`` in the current words (``STEP_WORDS``), whichever version wrote the row."""
        return [replace(p, step=STEP_WORDS.get(p.step, p.step)) if p.step else p for p in self._get("packs")]

    def spans(self, pack_id: int | None = None) -> list[SlotSpan]:
        return self._get("slot_spans", {"pack_id": pack_id}, order="pack_id, slot, start_step")

    def prune_decisions(self, pack_id: int | None = None) -> list[PruneDecision]:
        return self._get("prune_decisions", {"pack_id": pack_id})

