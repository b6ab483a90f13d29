"""What every evaluator shares: the data it scores, the result it returns, and slot routing.

An evaluator is ``(model, slots, data, **options) -> EvalResult``: ``model`` is a ``PackedModel`` holding
the adapters, ``slots`` the slot ids to score, ``data`` the held-out rows (``EvalData``). Every slot is
scored on the same items in the same order, so ``EvalResult.per_item`` lists line up across slots and a
paired test (``store.stats.paired_bootstrap``) can compare two adapters item by item.

Routing: a batch holds the rows of several slots, grouped by slot as ``kernels.ops.PackLayout`` says; the
packed LoRA layers read the layout from the pack's shared state on every forward, so one forward (or
one decoding step) applies each row's own adapter.
"""

from __future__ import annotations

import json
import math
import numbers
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol

from lora_sweep.errors import ConfigError, DataError, UserError
from lora_sweep.evaluators.cost import EvalCost
from lora_sweep.kernels.meta import PackLayout
from lora_sweep.packer.api import data as packer_data
from lora_sweep.packer.api import supported

if TYPE_CHECKING:
    from lora_sweep.packer.api import PackedModel

__all__ = ["MC_FORMAT", "TEXT_FORMATS", "Evaluator", "Score", "EvalData", "EvalResult", "SlotEvalError",
           "load_eval_data", "make_options", "check_format", "routed", "slot_layout", "chunks", "pad_id", "finite",
           "Batched", "check_batched", "uses_batched", "check_result"]

Batched = bool | Literal["auto"]
"""An evaluator's ``batched`` option (alias ``static_shapes``): ``"auto"``, ``True`` or ``False`` (``uses_batched``)."""

MC_FORMAT = "multiple_choice"
"""Row format of multiple-choice data: ``{"prompt": str, "choices": [str, ...], "label": int}``."""


class SlotEvalError(UserError):
    """One slot's evaluation failed (e.g. a custom metric raised); the other slots are still scored.

    The caller marks that trial FAIL with ``str(err)`` as the reason.

    Attributes:
        slot: the slot whose evaluation failed.
        reason: one line saying why.
    """

    def __init__(self, slot: int, reason: str) -> None:
        self.slot = slot
        self.reason = " ".join(reason.split())  # one line, whatever the callable put in its message
        super().__init__(f"slot {slot}: {self.reason}")


@dataclass(frozen=True)
class EvalData:
    """The held-out rows every slot is scored on.

    Attributes:
        rows: JSON rows, in file order.
        fmt: ``packer.data.rows`` format of the rows (``alpaca``, ``prompt_completion``, ``chat``, ``text``) or
            ``multiple_choice``.
        tokenizer: the base model's Hugging Face tokenizer.
        source: file name used in error messages.
        max_length: truncation of held-out-loss rows, as in training.
        train_on_prompt: held-out loss over every token, as in training with ``train_on_prompt``.
        work_dir: a study-given directory; lm-eval keeps its Hugging Face cache under ``work_dir/hf_home``.
    """

    rows: list[dict[str, Any]]
    fmt: str
    tokenizer: Any
    source: str = "<rows>"
    max_length: int = 512
    train_on_prompt: bool = False
    work_dir: Path | None = None


@dataclass
class EvalResult:
    """What an evaluator returns.

    Attributes:
        metrics: slot -> metric name -> value (slots listed in ``errors`` may be missing).
        per_item: slot -> metric name -> one value per item, same items and order for every slot.
        samples: slot -> one record per item (prompt, generation, reference, scores; evaluator-specific).
        errors: slot -> why its evaluation failed; the caller fails that trial.
    """

    metrics: dict[int, dict[str, float]] = field(default_factory=dict)
    per_item: dict[int, dict[str, list[float]]] = field(default_factory=dict)
    samples: dict[int, list[dict[str, Any]]] = field(default_factory=dict)
    errors: dict[int, SlotEvalError] = field(default_factory=dict)

    def merge(self, other: EvalResult) -> EvalResult:
        """Add another evaluator's result for the same slots into this one (in place); returns self."""
        for slot, values in other.metrics.items():
            self.metrics.setdefault(slot, {}).update(values)
        for slot, items in other.per_item.items():
            self.per_item.setdefault(slot, {}).update(items)
        for slot, records in other.samples.items():
            self.samples.setdefault(slot, []).extend(records)
        for slot, err in other.errors.items():
            self.errors.setdefault(slot, err)
        return self


class Score(Protocol):
    """Scores slots of a packed model on the same items; returns ``EvalResult`` (``metrics[slot][name]``)."""

    def __call__(self, model: PackedModel, slots: Sequence[int], data: EvalData, **options: Any) -> EvalResult: ...


def _no_families(opts: Any) -> dict[str, Callable[[str], str]]:
    return {}


def _no_check(opts: Any) -> None:
    return None


def _untimed(opts: Any) -> EvalCost | None:
    return None


@dataclass(frozen=True)
class Evaluator:
    """One evaluator: what an ``evaluators: [{name, options}]`` entry of a study file names.

    ``evaluators.registry.EVALUATORS`` lists the built-in ones; a study may name a user's own as
    ``path/to/file.py:OBJECT`` or ``package.module:OBJECT`` (``evaluators.registry.find``).
    """

    name: str
    """The name a study file uses."""
    options: type
    """Its options dataclass: each field an option (its docstring is the reference's text); ``__post_init__``
    raises ``ConfigError`` naming the key; a ``ClassVar`` ``ALIASES`` maps old option names to fields."""
    score: Score
    """``(model, slots, data, **options) -> EvalResult``: scores every slot on the same items."""
    metrics: Callable[[Any], Mapping[str, str]]
    """Options object -> metric name -> ``minimize`` / ``maximize``: the metrics an entry reports whose names its
    options fix (what objectives, constraints and ``pruning.proxy`` may name)."""
    reports: str
    """The metric names in words, one line of the study-file reference (``docs/study_reference.py``)."""
    families: Callable[[Any], Mapping[str, Callable[[str], str]]] = _no_families
    """Options object -> name prefix -> direction of a metric under it, for names known only when it runs
    (lm-eval's ``<task>.<metric>``)."""
    check: Callable[[Any], None] = _no_check
    """A load-time check beyond the options dataclass (``custom``: its function imports); raises ``ConfigError``."""
    needs_eval_data: bool = True
    """Whether it scores the study's held-out rows (``data.eval``): a study that lists it without them is refused at
    load, naming the key. False for one that brings its own data (``lm_eval``'s tasks)."""
    cost: Callable[[Any], EvalCost | None] = _untimed
    """Options object -> what one evaluation of a slot costs in packed forwards (``EvalCost``), which ``sweep plan``
    times; None: not timed (the plan names it as such)."""
    curve: str | None = None
    """The metric it reports that ``train.eval_every`` records as a learning curve during training (``heldout_loss``:
    ``eval_loss``); None: it serves no curve. A study's first entry that serves one scores the curve
    (``evaluators.registry.curve_entry``)."""

    def load(self, options: Mapping[str, Any] | None = None) -> Any:
        """The options object of an entry, checked; errors name ``<name>.options.<key>`` (one line).

        Raises:
            ConfigError: unknown option, a value the options reject, or a failed ``check``.
        """
        opts = make_options(self.options, dict(options or {}), self.name)
        self.check(opts)
        return opts

    def direction(self, metric: str, opts: Any) -> str | None:
        """``minimize`` / ``maximize`` of ``metric`` when an entry with options ``opts`` reports it, else None."""
        fixed = self.metrics(opts)
        if metric in fixed:
            return fixed[metric]
        for prefix, direction in self.families(opts).items():
            if metric.startswith(prefix):
                return direction(metric)
        return None


def load_eval_data(path: str | Path, tokenizer: Any, *, fmt: str = "auto", max_length: int = 512,
                   train_on_prompt: bool = False, work_dir: str | Path | None = None,
                   max_line_bytes: int | None = None) -> EvalData:
    """Read a held-out JSONL file.

    Args:
        path: JSONL file.
        tokenizer: the base model's tokenizer.
        fmt: one of ``packer.data.rows.FORMATS``, ``multiple_choice``, or ``auto`` (rows with ``choices`` are
            multiple choice; otherwise ``packer.data.rows`` detects the format).
        max_length: see ``EvalData``.
        train_on_prompt: see ``EvalData``.
        work_dir: see ``EvalData``.
        max_line_bytes: the longest row read (``packer.data.lines.iter_lines``); None: ``line_bound(max_length)``.

    Raises:
        DataError: missing file, invalid JSON, a row over the bound or without the format's fields (names
            ``file:line``).
    """
    bound = supported.line_bound(max_length) if max_line_bytes is None else max_line_bytes
    if fmt == MC_FORMAT or (fmt == "auto" and _first_row_has(path, "choices", bound)):
        fmt, rows = MC_FORMAT, _read_choice_rows(path, bound)
    else:
        fmt, rows = packer_data.read_jsonl(path, fmt, bound)
    return EvalData(rows, fmt, tokenizer, str(path), max_length, train_on_prompt,
                    Path(work_dir) if work_dir is not None else None)


def _first_row_has(path: str | Path, key: str, bound: int) -> bool:
    try:
        line = next((ln for _, ln in packer_data.iter_lines(path, bound) if ln.strip()), "")
        return isinstance(row := json.loads(line), dict) and key in row
    except (DataError, json.JSONDecodeError):
        return False  # read_jsonl reports it with file:line


def _read_choice_rows(path: str | Path, bound: int) -> list[dict[str, Any]]:
    rows = [_check_choice_row(line, f"{path}:{lineno}") for lineno, line in packer_data.iter_lines(path, bound)
            if line.strip()]
    if not rows:
        raise DataError(f"{path}: no rows")
    return rows


def _check_choice_row(line: str, where: str) -> dict[str, Any]:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as err:
        raise packer_data.json_error(err, where) from None
    ok = (isinstance(row, dict) and isinstance(row.get("prompt"), str) and isinstance(row.get("choices"), list)
          and len(row["choices"]) > 0 and all(isinstance(c, str) and c for c in row["choices"]))
    if not ok:
        raise DataError(f"{where}: a {MC_FORMAT} row needs 'prompt' (string) and 'choices' (non-empty strings)")
    label = row.get("label")
    if not (isinstance(label, int) and not isinstance(label, bool) and 0 <= label < len(row["choices"])):
        raise DataError(f"{where}: field 'label' must be an index into 'choices' (got {label!r})")
    return row


def check_format(data: EvalData, allowed: Sequence[str], evaluator: str) -> None:
    """Raise ``DataError`` unless ``data.fmt`` is one ``evaluator`` can score."""
    if data.fmt not in allowed:
        raise DataError(f"{data.source}: the {evaluator} evaluator needs rows of format "
                        f"{' or '.join(allowed)}, got {data.fmt}")


TEXT_FORMATS = tuple(f for f in supported.FORMATS if f != "text")
"""Formats with a prompt and a response (generation and custom evaluators)."""


def make_options(cls: type[Any], options: Mapping[str, Any], evaluator: str) -> Any:
    """Build an evaluator's options dataclass; errors name ``<evaluator>.options.<key>``.

    Raises:
        ConfigError: unknown option, or a value the dataclass rejects.
    """
    options = dict(options)
    for alias, key in getattr(cls, "ALIASES", {}).items():  # an option's former name still reads
        if alias in options:
            if key in options:
                raise ConfigError(f"{evaluator}.options.{alias}: is an alias of {key}; give one of them")
            options[key] = options.pop(alias)
    known = sorted(f.name for f in fields(cls))
    unknown = sorted(set(options) - set(known))
    if unknown:
        raise ConfigError(f"{evaluator}.options: unknown option {unknown[0]!r} (expected: {', '.join(known)})")
    missing = [f.name for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING
               and f.name not in options]
    if missing:
        raise ConfigError(f"{evaluator}.options.{missing[0]}: is required")
    try:
        return cls(**options)
    except ConfigError as err:
        raise ConfigError(f"{evaluator}.options.{err}") from None


def slot_layout(slots: Sequence[int], rows_per_slot: int, seq_len: int) -> PackLayout:
    """Layout of a batch where each slot owns ``rows_per_slot`` consecutive rows, dropout off."""
    n = len(slots)
    return PackLayout(slots=tuple(slots), row_start=tuple(g * rows_per_slot for g in range(n)),
                      n_rows=(rows_per_slot,) * n, own_len=(seq_len,) * n, dropout=(0.0,) * n, seed=(0,) * n)


@contextmanager
def routed(model: PackedModel, layout: PackLayout | None) -> Iterator[None]:
    """Route every forward of ``model.model`` inside the block through ``layout``."""
    model.state.layout = layout
    try:
        yield
    finally:
        model.state.layout = None


def check_batched(value: object) -> None:
    """Raise ``ConfigError`` unless ``value`` is a valid ``batched`` option: true, false or "auto"."""
    if not (isinstance(value, bool) or value == "auto"):
        raise ConfigError(f"batched: must be true, false or auto (got {value!r})")


def uses_batched(option: Batched, model: PackedModel) -> bool:
    """Whether an evaluator scores all slots' adapters together on the training pack's fixed shapes
    (``packer.step.eval_graph``; it still needs the slot store and a shape that fits) rather than on the
    per-adapter path. ``"auto"``: on CUDA, where one captured graph per shape replays each forward; not on the CPU,
    where nothing replays and each fixed-shape forward holds a full pack of rows padded to a multiple of 16 tokens,
    while the per-adapter path's forwards hold only the scored adapters' rows at their own length."""
    if option == "auto":
        return model.device.type == "cuda"
    return bool(option)


def chunks(n: int, size: int) -> Iterator[range]:
    """Consecutive index ranges of at most ``size`` covering ``range(n)``."""
    for start in range(0, n, size):
        yield range(start, min(n, start + size))


def pad_id(tokenizer: Any) -> int:
    """The tokenizer's padding id (EOS when it has none; padded positions are masked anyway)."""
    pid = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return int(pid) if pid is not None else 0


def finite(value: float, what: str) -> float:
    """``value`` as a float; raises ``ValueError`` naming ``what`` if it is not a finite number."""
    try:
        out = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{what} must be a number, got {type(value).__name__}") from None
    if not math.isfinite(out):
        raise ValueError(f"{what} must be finite, got {out}")
    return out


def check_result(result: object, slots: Sequence[int], who: str) -> EvalResult:
    """A user evaluator's return value, checked: an ``EvalResult`` whose metrics are finite numbers.

    What is wrong fails the slot it concerns (``errors``, one line naming ``who``) and leaves the others: a result of
    another type (a dict) fails every slot; a metric that is not a number (a string, a bool) or not finite fails its
    slot, as does a per-item list that is not all finite numbers.
    """
    if not isinstance(result, EvalResult):
        error = f"{who} returned a {type(result).__name__}, not an EvalResult"
        return EvalResult(errors={s: SlotEvalError(s, error) for s in slots})
    checked = EvalResult(samples={s: list(v) for s, v in result.samples.items() if s in slots},
                         errors={s: e for s, e in result.errors.items() if s in slots})
    for slot in slots:
        if slot in checked.errors:
            continue
        reason = _bad_values(result.metrics.get(slot, {}), result.per_item.get(slot, {}))
        if reason is not None:
            checked.errors[slot] = SlotEvalError(slot, f"{who}: {reason}")
            continue
        if slot in result.metrics:
            checked.metrics[slot] = {k: float(v) for k, v in result.metrics[slot].items()}
        if slot in result.per_item:
            checked.per_item[slot] = {k: [float(x) for x in v] for k, v in result.per_item[slot].items()}
    return checked


def _bad_values(metrics: object, per_item: object) -> str | None:
    """Why a slot's metrics or per-item values are unusable, or None."""
    if not isinstance(metrics, Mapping) or not isinstance(per_item, Mapping):
        return f"metrics must map names to numbers, got a {type(metrics).__name__}"
    for name, value in metrics.items():
        if not _is_number(value):
            return f"metric {name!r} is a {type(value).__name__} ({str(value)[:40]!r}), not a number"
        if not math.isfinite(value):
            return f"metric {name!r} is not finite ({value})"
    for name, items in per_item.items():
        if not isinstance(items, Sequence) or not all(_is_number(x) and math.isfinite(x) for x in items):
            return f"per-item values of {name!r} must be a list of finite numbers"
    return None


def _is_number(x: object) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)  # numbers.Real: NumPy's floats too
