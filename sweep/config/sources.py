"""What a study trains on: the base model (``model:``) and the data (``data:``), each section one frozen dataclass
that validates itself (``ConfigError("key: rule (got value)")``; the loader adds the file, line and dotted key).
``sweep.config.spec`` re-exports both beside the rest of the study file."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from lora_sweep.packer.api import supported
from lora_sweep.sweep.config._params import check_fields, rule
from lora_sweep.sweep.config.settings import whole

__all__ = ["ModelSpec", "DataSpec", "FORMATS"]

FORMATS = ("auto", *supported.FORMATS)
_FORMAT_ALIASES = {"messages": "chat", "sharegpt": "chat", "completion": "prompt_completion"}


@dataclass(frozen=True)
class ModelSpec:
    """The frozen base model."""

    path: str = rule(lambda v: isinstance(v, str) and v.strip() == v != "", "must be a hub id or path")
    """Hub id (``openai-community/gpt2``), local directory, or local ``.gguf`` file (stored absolute); a GGUF
    checkpoint is dequantized once into a cached plain checkpoint (``packer.model.gguf``)."""
    gguf_file: str | None = rule(lambda v: v is None or (isinstance(v, str) and v.strip() != ""),
                                 "must be the name of a .gguf file inside model.path", None)
    """A GGUF file inside the directory ``path`` (transformers' ``gguf_file``); None: ``path`` is the model."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Dtype of the frozen base weights; ``auto``: bfloat16 on CUDA, float32 on CPU."""
    device: str = rule(lambda v: re.fullmatch(r"auto|cpu|cuda(:\d+)?", str(v)) is not None,
                       "must be auto, cpu, cuda or cuda:N", "auto")
    """``auto`` (CUDA if available), ``cpu``, ``cuda`` or ``cuda:N``."""
    quantize: str | None = rule(lambda v: v is None or v in supported.QUANTIZE,
                                f"must be {' or '.join(supported.QUANTIZE)} or null", None)
    """``nf4``: QLoRA, the base's linear projections held as 4-bit NF4 weights shared by every slot
    (``packer.model.quant``; needs the ``qlora`` extra); None: the base in ``dtype``."""

    def __post_init__(self) -> None:
        check_fields(self)


@dataclass(frozen=True)
class DataSpec:
    """Training and evaluation data (JSON lines)."""

    train: Path
    """Training file; relative paths in a study file are taken from the study file's folder."""
    eval: Path | None = None
    """Held-out file the evaluators score; required by those that declare they score it (every built-in one but
    ``lm_eval``: ``Evaluator.needs_eval_data``)."""
    format: str = rule(lambda v: v in FORMATS, f"must be one of {', '.join(FORMATS)}", "auto")
    """Row format: ``auto`` (from the first row's keys), alpaca ``{instruction, input, output}``, chat
    ``{messages}`` (alias ``messages``), ``prompt_completion`` ``{prompt, completion}``, ``text``."""
    max_length: int = rule(whole(), "must be >= 1", 512)
    """Truncate tokenized examples to this many tokens."""
    train_on_prompt: bool = False
    """Also train on prompt tokens (default: labels masked to the response, as Axolotl)."""
    max_line_bytes: int | None = rule(whole(null=True), "must be a number of bytes >= 1", None)
    """The longest row (line) of the data files, in bytes: a longer one is refused by ``file:line`` before it is
    parsed; null: 1 MiB, or 32 bytes a token of ``max_length`` when that is more (``line_bytes``)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "format", _FORMAT_ALIASES.get(self.format, self.format))
        check_fields(self)

    @property
    def line_bytes(self) -> int:
        """The row bound in force: ``max_line_bytes``, or ``packer.data.lines.line_bound(max_length)``."""
        return self.max_line_bytes if self.max_line_bytes is not None else supported.line_bound(self.max_length)
