"""Training data: JSONL rows -> tokenized, prompt-masked examples -> one seeded batch stream per slot.

Row formats (one JSON object per line; blank lines are skipped):

- ``alpaca``: ``{"instruction", "input" (optional, may be empty), "output"}`` in the Stanford Alpaca prompt
  template (https://github.com/tatsu-lab/stanford_alpaca, ``PROMPT_DICT``).
- ``prompt_completion``: ``{"prompt", "completion"}`` (TRL's standard prompt-completion rows).
- ``chat``: ``{"messages": [{"role": "system" | "user" | "assistant", "content": str}, ...]}``, rendered with the
  tokenizer's chat template, or with ``packer.data.chat.PLAIN_CHAT_TEMPLATE`` when the tokenizer has none.
- ``text``: ``{"text"}``, plain language modelling: every token is trained.

Labels are aligned with ``input_ids`` (``labels[t]`` is ``input_ids[t]`` or -100), the Hugging Face causal-LM
convention: the loss shifts them by one, so ``labels[0]`` is never a target. Only the response is trained by
default (completion, output, assistant turns), as in Axolotl's ``train_on_inputs: false``; ``train_on_prompt``
trains every token without changing ``input_ids``, so a sweep over it compares the same token sequences.
"""

from __future__ import annotations

import json
import logging
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lora_sweep.errors import DataError
from lora_sweep.packer.data.chat import Piece, chat_pieces, encode, eos_id
from lora_sweep.packer.data.lines import MAX_LINE_BYTES, iter_lines, line_bound

__all__ = [
    "FORMATS",
    "IGNORE_INDEX",
    "ALPACA_PROMPT",
    "ALPACA_PROMPT_NO_INPUT",
    "Example",
    "read_jsonl",
    "json_error",
    "tokenize_rows",
    "load_examples",
    "SlotStream",
]

logger = logging.getLogger(__name__)

FORMATS = ("alpaca", "prompt_completion", "chat", "text")
"""Row formats; ``fmt="auto"`` picks one from the first row's keys."""

IGNORE_INDEX = -100
"""Label of a token that takes no loss (``torch.nn.CrossEntropyLoss``'s default ``ignore_index``)."""

ROLES = ("system", "user", "assistant")

ALPACA_PROMPT = (
    "Below is an instruction that describes a task, paired with an input that provides further context. "
    "Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
)
"""Alpaca prompt for rows with a non-empty ``input``."""

ALPACA_PROMPT_NO_INPUT = (
    "Below is an instruction that describes a task. "
    "Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Response:\n"
)
"""Alpaca prompt for rows without ``input`` (missing, null or empty)."""

# Required string fields of each format; "auto" picks the first format whose first field the row has.
_FIELDS = {
    "chat": ("messages",),
    "alpaca": ("instruction", "output"),
    "prompt_completion": ("prompt", "completion"),
    "text": ("text",),
}

@dataclass(frozen=True)
class Example:
    """One tokenized training row."""

    input_ids: tuple[int, ...]
    """Token ids, special tokens included."""
    labels: tuple[int, ...]
    """Same length as ``input_ids``: the token id where loss is taken, ``IGNORE_INDEX`` (-100) elsewhere."""

    def __post_init__(self) -> None:
        if len(self.input_ids) != len(self.labels):
            raise ValueError(f"input_ids and labels differ in length ({len(self.input_ids)} vs {len(self.labels)})")


def read_jsonl(path: str | Path, fmt: str = "auto", max_line_bytes: int = MAX_LINE_BYTES
               ) -> tuple[str, list[dict[str, Any]]]:
    """Read and validate the rows of a JSONL dataset.

    Args:
        path: JSONL file, one JSON object per line.
        fmt: One of ``FORMATS``, or ``"auto"`` to detect it from the first row's keys.
        max_line_bytes: The longest row read (``iter_lines``); a longer one is refused by ``file:line``.

    Returns:
        The resolved format and the rows, in file order.

    Raises:
        DataError: The file is missing or empty, the format is unknown, or a row is invalid JSON or lacks a
            field of the format; the message names ``file:line``.
    """
    fmt, rows, _ = _read(path, fmt, max_line_bytes)
    return fmt, rows


def tokenize_rows(
    rows: list[dict[str, Any]],
    fmt: str,
    tokenizer: Any,
    *,
    max_length: int = 512,
    train_on_prompt: bool = False,
    source: str = "<rows>",
) -> list[Example]:
    """Tokenize rows into prompt-masked examples.

    The prompt is tokenized with the tokenizer's special tokens (e.g. BOS), the response without, and EOS is
    appended to alpaca, prompt_completion and text rows so the model learns to stop; a chat template writes its
    own special tokens and turn ends. Rows are cut to ``max_length`` tokens (keeping the start); a row left with
    no trained token is dropped with a warning.

    Args:
        rows: Rows of format ``fmt`` (validated again here); row ``i`` is reported as ``source:i`` (1-based).
        fmt: One of ``FORMATS``, or ``"auto"`` to detect it from the first row.
        tokenizer: A Hugging Face tokenizer (``PreTrainedTokenizerBase``).
        max_length: Maximum tokens per example, >= 1.
        train_on_prompt: Train on every token instead of the response only.
        source: Name used in error messages.

    Returns:
        One example per kept row, in row order.

    Raises:
        DataError: A row is invalid, the chat template cannot be split into turns, or no row is left.
        UserError: The tokenizer has no EOS token and the format needs one.
        ValueError: ``max_length`` < 1.
    """
    return _tokenize(rows, range(1, len(rows) + 1), fmt, tokenizer, max_length, train_on_prompt, source)


def load_examples(
    path: str | Path,
    tokenizer: Any,
    *,
    fmt: str = "auto",
    max_length: int = 512,
    train_on_prompt: bool = False,
    max_line_bytes: int | None = None,
) -> list[Example]:
    """Read a JSONL dataset and tokenize it: ``read_jsonl`` + ``tokenize_rows``, errors naming ``file:line``.

    Arguments, result and errors are those of ``read_jsonl`` and ``tokenize_rows``; ``max_line_bytes`` None:
    ``line_bound(max_length)``.
    """
    bound = line_bound(max_length) if max_line_bytes is None else max_line_bytes
    fmt, rows, lines = _read(path, fmt, bound)
    return _tokenize(rows, lines, fmt, tokenizer, max_length, train_on_prompt, str(path))


class SlotStream:
    """Endless stream of micro-batches for one slot: its own seeded order, reshuffled every epoch.

    Epoch ``e`` visits the examples in a permutation drawn by ``random.Random`` seeded with ``(seed, e)``, so
    the batches depend on nothing but the seed (no global RNG), and a stream can resume at any epoch without
    replaying the earlier ones.

    Args:
        examples: The slot's examples, at least one.
        micro_batch: Examples per batch, >= 1.
        seed: Seed of the order.

    Attributes:
        epoch: Completed passes over the examples.
        position: Examples of the current epoch already served, in ``[0, len(examples))``.

    Raises:
        ValueError: No examples or ``micro_batch`` < 1.
    """

    def __init__(self, examples: Sequence[Example], micro_batch: int, seed: int) -> None:
        if len(examples) == 0:
            raise ValueError("SlotStream needs at least one example")
        if micro_batch < 1:
            raise ValueError(f"micro_batch must be >= 1, got {micro_batch}")
        self.examples = examples
        self.micro_batch = micro_batch
        self.seed = seed
        self.epoch = 0
        self.position = 0
        self._order_epoch = -1
        self._order: list[int] = []

    def next_batch(self) -> list[Example]:
        """Return the next ``micro_batch`` examples; a batch crossing an epoch end continues in the next order."""
        batch: list[Example] = []
        while len(batch) < self.micro_batch:
            order = self._epoch_order()
            end = min(len(order), self.position + self.micro_batch - len(batch))
            batch.extend(self.examples[i] for i in order[self.position : end])
            self.position = end
            if self.position == len(order):
                self.epoch += 1
                self.position = 0
        return batch

    def state_dict(self) -> dict[str, Any]:
        """Return the stream's position (plain ints, JSON-serialisable)."""
        return {"seed": self.seed, "epoch": self.epoch, "position": self.position, "num_examples": len(self.examples)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from ``state_dict()``.

        Raises:
            ValueError: The state belongs to another seed or number of examples, or is out of range.
        """
        if state["seed"] != self.seed or state["num_examples"] != len(self.examples):
            raise ValueError(
                f"stream state is for seed {state['seed']} over {state['num_examples']} examples, "
                f"this stream has seed {self.seed} over {len(self.examples)}"
            )
        if state["epoch"] < 0 or not 0 <= state["position"] < len(self.examples):
            raise ValueError(f"stream state out of range: epoch {state['epoch']}, position {state['position']}")
        self.epoch = state["epoch"]
        self.position = state["position"]

    def _epoch_order(self) -> list[int]:
        if self._order_epoch != self.epoch:
            self._order = list(range(len(self.examples)))
            # A str seed is hashed with SHA-512, not hash(), so the order is the same in every process
            # (PYTHONHASHSEED does not matter) and distinct for every (seed, epoch), negative seeds included.
            random.Random(f"{self.seed}:{self.epoch}").shuffle(self._order)
            self._order_epoch = self.epoch
        return self._order


def _read(path: str | Path, fmt: str, max_line_bytes: int = MAX_LINE_BYTES
          ) -> tuple[str, list[dict[str, Any]], list[int]]:
    """``read_jsonl`` that also returns each row's 1-based line number."""
    _check_format_name(fmt, str(path))
    rows: list[dict[str, Any]] = []
    lines: list[int] = []
    for lineno, line in iter_lines(path, max_line_bytes):
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise json_error(err, where) from None
        except RecursionError:
            raise DataError(f"{where}: nested deeper than {MAX_DEPTH} levels") from None
        _check_plain(row, where)
        if fmt == "auto":
            fmt = _detect(row, where)
        _check_row(row, fmt, where)
        rows.append(row)
        lines.append(lineno)
    if not rows:
        raise DataError(f"{path}: no rows")
    return fmt, rows, lines


def json_error(err: json.JSONDecodeError, where: str) -> DataError:
    """``where: invalid JSON: <json's reason> (column N)``, N counted in the line from 1. Where json's reason names a
    place (``Unterminated string starting at``, ``Invalid control character at``) it reads ``... at column N``; a
    byte-order mark inside the file (files joined together) is named as such, not as json's advice to its caller.
    Parse the line without its line break: a cut-off row then reads "Unterminated string starting at column N"
    (where its last string starts), not "Invalid control character" at the break."""
    if err.msg.startswith("Unexpected UTF-8 BOM"):
        return DataError(f"{where}: invalid JSON: a byte-order mark (U+FEFF) starts the line (files joined "
                         f"together?); remove it")
    if err.msg.endswith(" at"):
        return DataError(f"{where}: invalid JSON: {err.msg} column {err.colno}")
    return DataError(f"{where}: invalid JSON: {err.msg} (column {err.colno})")


MAX_DEPTH = 64
"""How deep a data row may nest lists and objects (a chat row needs 4): deeper is refused by file:line."""


def _check_plain(row: Any, where: str) -> None:
    """Refuse a row nested deeper than ``MAX_DEPTH`` or holding a string that is not text (a lone UTF-16
    surrogate such as ``\\ud800``, which JSON escapes allow and no tokenizer encodes); iterative, so a
    hostile row meets the bound, not Python's recursion limit."""
    stack = [(row, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError as err:
                raise DataError(f"{where}: a string holds a lone surrogate ({value[err.start]!r}): not text") from None
        elif isinstance(value, dict | list):
            if depth > MAX_DEPTH:
                raise DataError(f"{where}: nested deeper than {MAX_DEPTH} levels")
            items = [*value.keys(), *value.values()] if isinstance(value, dict) else value
            stack.extend((v, depth + 1) for v in items)


def _tokenize(
    rows: list[dict[str, Any]],
    lines: Sequence[int],
    fmt: str,
    tokenizer: Any,
    max_length: int,
    train_on_prompt: bool,
    source: str,
) -> list[Example]:
    """``tokenize_rows`` with the line number of each row."""
    _check_format_name(fmt, source)
    if max_length < 1:
        raise ValueError(f"max_length must be >= 1, got {max_length}")
    if not rows:
        raise DataError(f"{source}: no rows")
    if fmt == "auto":
        fmt = _detect(rows[0], f"{source}:{lines[0]}")
    examples = []
    for row, line in zip(rows, lines, strict=True):
        where = f"{source}:{line}"
        _check_row(row, fmt, where)
        ids: list[int] = []
        labels: list[int] = []
        for piece, trained in _pieces(row, fmt, tokenizer, train_on_prompt, where):
            ids += piece
            labels += piece if trained or train_on_prompt else [IGNORE_INDEX] * len(piece)
        ids, labels = ids[:max_length], labels[:max_length]
        # labels[0] is never a target after the causal shift, so it does not make a row trainable.
        if any(label != IGNORE_INDEX for label in labels[1:]):
            examples.append(Example(tuple(ids), tuple(labels)))
    if not examples:
        raise DataError(f"{source}: no row has a trained token within max_length={max_length}")
    if len(examples) < len(rows):
        dropped = len(rows) - len(examples)
        logger.warning("%s: rows dropped (no trained token within max_length=%d): %d", source, max_length, dropped)
    return examples


def _pieces(row: dict[str, Any], fmt: str, tokenizer: Any, train_on_prompt: bool, where: str) -> list[Piece]:
    """Tokenize one valid row as (ids, is_response) pieces whose concatenation is the example."""
    if fmt == "chat":
        return chat_pieces(row["messages"], tokenizer, train_on_prompt, where)
    eos = [eos_id(tokenizer)]
    if fmt == "text":
        return [(encode(tokenizer, row["text"], special=True) + eos, True)]
    if fmt == "alpaca":
        if row.get("input"):
            prompt = ALPACA_PROMPT.format(instruction=row["instruction"], input=row["input"])
        else:
            prompt = ALPACA_PROMPT_NO_INPUT.format(instruction=row["instruction"])
        response = row["output"]
    else:
        prompt, response = row["prompt"], row["completion"]
    return [(encode(tokenizer, prompt, special=True), False), (encode(tokenizer, response) + eos, True)]


def _check_format_name(fmt: str, source: str) -> None:
    if fmt != "auto" and fmt not in FORMATS:
        raise DataError(f"{source}: unknown format {fmt!r} (expected one of: auto, {', '.join(FORMATS)})")


def _detect(row: Any, where: str) -> str:
    """Return the format of a row from its keys."""
    _check_object(row, where)
    for fmt, fields in _FIELDS.items():
        if fields[0] in row:
            return fmt
    expected = ", ".join(f"'{fields[0]}' ({fmt})" for fmt, fields in _FIELDS.items())
    raise DataError(f"{where}: cannot detect the format from keys {sorted(row)}; expected one of {expected}")


def _check_row(row: Any, fmt: str, where: str) -> None:
    """Raise ``DataError`` unless ``row`` has the fields of ``fmt`` with the right types."""
    _check_object(row, where)
    for key in _FIELDS[fmt]:
        if key not in row:
            raise DataError(f"{where}: missing field '{key}' ({fmt} format)")
    if fmt == "chat":
        _check_messages(row["messages"], where)
        return
    for key in _FIELDS[fmt]:
        if not isinstance(row[key], str):
            raise DataError(f"{where}: field '{key}' must be a string ({fmt} format)")
    if fmt == "alpaca" and not isinstance(row.get("input", ""), str | None):  # missing and null mean no input
        raise DataError(f"{where}: field 'input' must be a string ({fmt} format)")


def _check_object(row: Any, where: str) -> None:
    if not isinstance(row, dict):
        raise DataError(f"{where}: row must be a JSON object, got {type(row).__name__}")


def _check_messages(messages: object, where: str) -> None:
    def is_message(m: object) -> bool:
        return isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)

    if not isinstance(messages, list) or not messages or not all(is_message(m) for m in messages):
        raise DataError(f"{where}: field 'messages' must be a list of {{role, content}}")
    for i, message in enumerate(messages):
        if message["role"] not in ROLES:
            raise DataError(
                f"{where}: messages[{i}] has unknown role {message['role']!r} (expected one of: {', '.join(ROLES)})"
            )
