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


@dataclass(frozen=True)
class ModelSpec:
    """The frozen base model."""

    path: str = rule(lambda v: isinstance(v, str) and v.strip() == v != "", "must be a hub id or path")
    gguf_file: str | None = rule(lambda v: v is None or (isinstance(v, str) and v.strip() != ""),
                                 "must be the name of a .gguf file inside model.path", None)
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    device: str = rule(lambda v: re.fullmatch(r"auto|cpu|cuda(:\d+)?", str(v)) is not None,
                       "must be auto, cpu, cuda or cuda:N", "auto")
    quantize: str | None = rule(lambda v: v is None or v in supported.QUANTIZE,
                                f"must be {' or '.join(supported.QUANTIZE)} or null", None)

    def __post_init__(self) -> None:
        check_fields(self)


@dataclass(frozen=True)
class DataSpec:
    """Training and evaluation data (JSON lines)."""

    train: Path
    eval: Path | None = None
    format: str = rule(lambda v: v in FORMATS, f"must be one of {', '.join(FORMATS)}", "auto")
    max_length: int = rule(whole(), "must be >= 1", 512)
    train_on_prompt: bool = False
    max_line_bytes: int | None = rule(whole(null=True), "must be a number of bytes >= 1", None)

    def __post_init__(self) -> None:
        check_fields(self)

    @property
    def line_bytes(self) -> int:
        """The row bound in force: ``max_line_bytes``, or ``packer.data.lines.line_bound(max_length)``."""
        return self.max_line_bytes if self.max_line_bytes is not None else supported.line_bound(self.max_length)
