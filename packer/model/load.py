"""Loading the frozen base the way a user's checkpoint loads: a hub id, a local checkpoint or a GGUF file
(``packer.model.gguf`` converts it once), its tokenizer, the dtype and the optional NF4 projections
(``packer.model.quant``); ``prepare_kernels`` starts Triton's compiler hash beside the load."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from lora_sweep.errors import ConfigError, UserError, first_line
from lora_sweep.kernels.ops import Impl, hash_compiler_early, resolve_impl
from lora_sweep.packer.model.quant import quantize_base

__all__ = ["load_base", "load_tokenizer", "resolve_base", "prepare_kernels", "DTYPES"]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_base(name_or_path: str, gguf_file: str | None = None, *,
                 log: Callable[[str], None] | None = None) -> str:
    """What ``from_pretrained`` loads for a study's ``model.path`` (and ``model.gguf_file``).

    Args:
        name_or_path: a hub id, a local checkpoint directory, a ``.gguf`` file, or the directory of ``gguf_file``.
        gguf_file: a GGUF file's name inside the directory ``name_or_path``.
        log: told when a GGUF file is converted (the first time only; ``packer.model.gguf``).

    Returns:
        The hub id, the local directory (``~`` expanded), or a GGUF source's cached checkpoint directory
        (converted on first use): the name adapters record as ``base_model_name_or_path``.

    Raises:
        UserError: a missing GGUF file or one transformers cannot read (``packer.model.gguf.convert``).
    """
    from lora_sweep.packer.model import gguf

    file = gguf.gguf_source(name_or_path, gguf_file)
    if file is not None:
        return str(gguf.checkpoint_dir(file, log=log))
    looks_local = name_or_path.startswith((".", "/", "~")) or Path(name_or_path).exists()
    return str(Path(name_or_path).expanduser()) if looks_local else name_or_path


def prepare_kernels(impl: Impl, device: str) -> None:
    """Call before loading the base a pack on ``device`` will wrap with ``impl``: where that means the Triton
    kernels, Triton's compiler hash starts on a thread beside the load (``kernels.ops.hash_compiler_early``)."""
    if resolve_impl(impl, torch.device(device)) == "triton":
        hash_compiler_early()


def load_base(name_or_path: str, *, gguf_file: str | None = None, dtype: str = "float32", device: str = "cpu",
              attn_implementation: str | None = None, quantize: str | None = None,
              log: Callable[[str], None] | None = None) -> tuple[nn.Module, object]:
    """Load a causal LM and its tokenizer the way a user's checkpoint is loaded.

    Args:
        name_or_path: a local directory saved with ``save_pretrained``, a hub id, a ``.gguf`` file, or the
            directory of ``gguf_file``; a GGUF source loads from its cached plain checkpoint (``resolve_base``).
        gguf_file: a GGUF file's name inside the directory ``name_or_path``.
        dtype: ``float32``, ``bfloat16``, ``float16`` or ``auto`` (the checkpoint's dtype).
        device: where the model goes (``cpu``, ``cuda``, ``cuda:1``).
        attn_implementation: passed to transformers (``sdpa``, ``eager``); None keeps its default.
        quantize: ``nf4``: the linear projections (not the output head) become NF4 weights on ``device``
            (``packer.model.quant``); None: as loaded.
        log: told when a GGUF file is converted (the first time only).

    Raises:
        UserError: the path does not exist or transformers cannot load it (one line).
        ConfigError: ``quantize`` is unknown or cannot hold a weight (``packer.model.quant.quantize_base``).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # the sweep shows its own progress; keep stderr for what matters
    if dtype != "auto" and dtype not in DTYPES:
        raise ConfigError(f"model.dtype: must be one of auto, {', '.join(DTYPES)} (got {dtype!r})")
    source = resolve_base(name_or_path, gguf_file, log=log)
    looks_local = source.startswith((".", "/", "~")) or Path(source).exists()
    if looks_local and not Path(source).is_dir():
        raise UserError(f"{name_or_path}: model directory not found")
    kwargs = {"dtype": "auto" if dtype == "auto" else DTYPES[dtype]}
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    try:
        model: nn.Module = AutoModelForCausalLM.from_pretrained(source, **kwargs)
        tokenizer = AutoTokenizer.from_pretrained(source)
    except (OSError, ValueError) as err:
        first = first_line(err)
        raise UserError(f"{name_or_path}: cannot load model: {first}") from err
    model = model.to(device)
    quantize_base(model, quantize)  # on the device: quantising on a GPU takes a fraction of the CPU's time
    return model, tokenizer


def load_tokenizer(name_or_path: str, *, gguf_file: str | None = None) -> object:
    """The tokenizer ``load_base`` would load, without the model (a plan from the calibration cache needs no weights).

    Raises:
        UserError: as ``load_base``.
    """
    from transformers import AutoTokenizer

    source = resolve_base(name_or_path, gguf_file)
    try:
        return AutoTokenizer.from_pretrained(source)
    except (OSError, ValueError) as err:
        first = first_line(err)
        raise UserError(f"{name_or_path}: cannot load tokenizer: {first}") from err
