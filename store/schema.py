"""The rows of results.db and how values travel through SQLite: the tables are derived from the row classes.

The tables, their columns and the JSON conventions are documented in ``store.api``'s docstring.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

from lora_sweep.store.attrs import BASELINE, DEFAULT

__all__ = ["SCHEMA_VERSION", "STEP_WORDS", "TrialRecord", "StepRow", "EvalRow", "ItemRow", "PackRecord", "SlotSpan",
           "PruneDecision", "TABLES", "columns", "to_json", "from_json", "plain", "now_or", "reference_trial"]

SCHEMA_VERSION = 3
"""2: ``packs.step`` (the training step a pack ran); 3: ``packs.fallback`` (why a CUDA pack's step ran eagerly). An
older file gains the missing columns when opened."""
STEP_WORDS = {"static-eager": "eager"}
"""``packs.step`` values stores hold under another word -> the word the reading API returns (``ResultsStore.packs``):
the training step run eagerly was named ``static-eager``."""
_NONFINITE = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}


def _encode(obj: Any) -> Any:
    if isinstance(obj, float) and not math.isfinite(obj):
        return "NaN" if math.isnan(obj) else ("Infinity" if obj > 0 else "-Infinity")
    if isinstance(obj, Mapping):
        return {k: _encode(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_encode(v) for v in obj]
    return _encode(obj.item()) if hasattr(obj, "item") else obj  # numpy / torch scalars


def plain(value: Any) -> Any:
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


def to_json(obj: Any) -> str | None:
    """A value as JSON text, non-finite floats spelled as strings (None stays NULL)."""
    return None if obj is None else json.dumps(_encode(obj), allow_nan=False)


def from_json(text: str | None) -> Any:
    """The inverse of ``to_json``."""
    return None if text is None else _decode(json.loads(text))


def now_or(t: float | None) -> float:
    """``t``, or the current time when it is None."""
    return time.time() if t is None else t


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

    @property
    def is_default(self) -> bool:
        """Whether this is the community-default trial or a retry of it (user attr ``attrs.DEFAULT``)."""
        return bool((self.user_attrs or {}).get(DEFAULT))

    @property
    def is_baseline(self) -> bool:
        """Whether this is the trial of the config's own hyperparameters or a retry of it (``attrs.BASELINE``)."""
        return bool((self.user_attrs or {}).get(BASELINE))

    @property
    def role(self) -> str:
        """' (default)', ' (config baseline)', both, or '': how status and the report name the trial."""
        names = [n for n, on in (("default", self.is_default), ("config baseline", self.is_baseline)) if on]
        return f" ({', '.join(names)})" if names else ""


def reference_trial(trials: Sequence[TrialRecord]) -> tuple[TrialRecord, str] | None:
    """The trial the best is measured against, and its name: the config's own hyperparameters (``config
    baseline``) when the study has that trial (an Axolotl or torchtune config, a ``baseline:``), else the
    community ``default``; its latest complete retry, else its latest. None when the study has neither."""
    for name, pick in (("config baseline", lambda t: t.is_baseline), ("default", lambda t: t.is_default)):
        found = [t for t in trials if pick(t)]
        done = [t for t in found if t.state == "COMPLETE"]
        if found:
            return (done or found)[-1], name
    return None


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
    step: str | None = None
    """The training step the pack ran (``packer.step.train``'s ``TrainResult.step``: cuda-graph or eager)."""
    fallback: str | None = None
    """Why a CUDA pack's step ran eagerly although graphs were asked for (``TrainResult.fallback``), else None."""


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
TABLES: dict[str, tuple[type, tuple[str, ...]]] = {
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


def columns(table: str) -> dict[str, str]:
    """Column -> SQL type of ``table``, or "JSON" for columns holding JSON text."""
    return {f.name: _SQL_TYPES.get(str(f.type).removesuffix(" | None"), "JSON") for f in fields(TABLES[table][0])}

