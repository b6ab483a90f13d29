"""Loading the frozen base the way a user's checkpoint loads: a hub id, a local checkpoint or a GGUF file
(``packer.model.gguf`` converts it once), its tokenizer, the dtype and the optional NF4 projections
(``packer.model.quant``); ``prepare_kernels`` starts Triton's compiler hash beside the load."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import TypeVar

import torch
from torch import nn

from lora_sweep.errors import ConfigError, UserError, first_line
from lora_sweep.kernels.ops import Impl, hash_compiler_early, resolve_impl, use_kernel_cache
from lora_sweep.packer.model.quant import quantize_base

__all__ = ["load_base", "load_tokenizer", "resolve_base", "check_checkpoint", "prepare_kernels", "DTYPES",
           "LOAD_PARTS"]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
T = TypeVar("T")


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


def prepare_kernels(impl: Impl, device: str, cache_root: Path | None = None) -> Path | None:
    """Call before loading the base a pack on ``device`` will wrap with ``impl``: where that means the Triton
    kernels, compiled kernels are kept under ``cache_root`` across runs (``kernels.ops.use_kernel_cache``: keyed by
    Triton's version and the device; the user's ``TRITON_CACHE_DIR`` wins) and Triton's compiler hash starts on a
    thread beside the load (``kernels.ops.hash_compiler_early``).

    Returns:
        The kernel cache folder in use (None: not the Triton path, or no ``cache_root`` and none set by the user).
    """
    if resolve_impl(impl, torch.device(device)) != "triton":
        return None
    folder = use_kernel_cache(cache_root, torch.device(device)) if cache_root is not None else None
    hash_compiler_early()
    return folder


LOAD_PARTS = ("model", "tokenizer")
"""The parts of ``load_base``'s seconds (``split``): the model, read onto its device by ``from_pretrained``; the
tokenizer, loaded on a thread beside it (the two overlap: their sum is more than the load's wall)."""


def load_base(name_or_path: str, *, gguf_file: str | None = None, dtype: str = "float32", device: str = "cpu",
              attn_implementation: str | None = None, quantize: str | None = None,
              log: Callable[[str], None] | None = None,
              split: dict[str, float] | None = None) -> tuple[nn.Module, object]:
    """Load a causal LM and its tokenizer the way a user's checkpoint is loaded.

    The weights go straight onto ``device`` in ``dtype`` (``from_pretrained`` with ``device_map``: the module built
    on the meta device, each safetensors tensor read memory-mapped, cast once and placed; no weight the checkpoint
    holds is initialised, no copy of the model waits on the CPU), while the tokenizer loads on a thread.

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
        split: filled with the seconds of each of ``LOAD_PARTS`` (``benchmarks.load_bench``).

    Raises:
        UserError: the path does not exist or transformers cannot load it (one line).
        ConfigError: ``quantize`` is unknown or cannot hold a weight (``packer.model.quant.quantize_base``).
    """
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # the sweep shows its own progress; keep stderr for what matters
    if dtype != "auto" and dtype not in DTYPES:
        raise ConfigError(f"model.dtype: must be one of auto, {', '.join(DTYPES)} (got {dtype!r})")
    source = resolve_base(name_or_path, gguf_file, log=log)
    looks_local = source.startswith((".", "/", "~")) or Path(source).exists()
    if looks_local and not Path(source).is_dir():
        raise UserError(f"{name_or_path}: model directory not found")
    if looks_local:
        check_checkpoint(source, name_or_path)
    kwargs: dict[str, object] = {"dtype": "auto" if dtype == "auto" else DTYPES[dtype],
                                 "device_map": torch.device(device)}
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    times = split if split is not None else {}
    with ThreadPoolExecutor(1, thread_name_prefix="tokenizer") as pool:  # its exit waits for the tokenizer
        tokenizer = pool.submit(_timed, times, "tokenizer", _tokenizer, source, name_or_path)
        with _timer(times, "model"):
            try:
                model: nn.Module = AutoModelForCausalLM.from_pretrained(source, **kwargs)
            except (OSError, ValueError) as err:
                raise UserError(f"{name_or_path}: cannot load model: {first_line(err)}") from err
            except Exception as err:  # a damaged checkpoint fails anywhere in transformers: a RuntimeError of a
                raise UserError(f"{name_or_path}: cannot load model: {_named(err)}") from err  # size, a KeyError...
        # whole on one device, as a load then .to() left it: PEFT and accelerate take a model with a device map for
        # one dispatched over devices (and re-dispatch it when an adapter loads)
        model.__dict__.pop("hf_device_map", None)
    quantize_base(model, quantize)  # on the device: quantising on a GPU takes a fraction of the CPU's time
    return model, tokenizer.result()


def check_checkpoint(source: str, name_or_path: str) -> None:
    """Read a local checkpoint's ``config.json`` as transformers does and hold its layer count to the layers its
    safetensors weights hold, before any model is built from it.

    A damaged or hand-edited config otherwise fails deep inside transformers' config classes (a TypeError, a
    ZeroDivisionError, their own validation errors: a traceback), and a layer count far above the weights' builds and
    initialises every missing layer (minutes, or all the memory there is).

    Raises:
        UserError: one line naming ``name_or_path``: the config cannot be read, a weights file's header cannot, or
            ``num_hidden_layers`` is below 1 or above the weights' layers.
    """
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(source)
    except (OSError, ValueError) as err:  # no config.json, not JSON: transformers' own sentence
        raise UserError(f"{name_or_path}: cannot load model: {first_line(err)}") from None
    except Exception as err:  # noqa: BLE001  (its config classes' checks raise any type)
        raise UserError(f"{name_or_path}: cannot load model: config.json: {_named(err)}") from None
    layers = getattr(config.get_text_config(), "num_hidden_layers", None)
    held = _weight_layers(Path(source), name_or_path)
    if isinstance(layers, int) and (layers < 1 or (held and layers > held)):
        why = f", but the weights hold {held}" if layers >= 1 else ": a model has at least 1 layer"
        raise UserError(f"{name_or_path}: cannot load model: config.json: num_hidden_layers is {layers}{why}")


def _weight_layers(folder: Path, name_or_path: str) -> int:
    """How many layers the safetensors weights of ``folder`` hold (their names' largest block index, plus one; of
    any tower, in a model of several); 0: no safetensors weights, or no numbered block in them."""
    from safetensors import safe_open

    index = folder / "model.safetensors.index.json"
    try:
        if index.is_file():
            names = list(json.loads(index.read_text())["weight_map"])
        else:
            names = []
            for file in sorted(folder.glob("*.safetensors")):
                with safe_open(str(file), framework="pt") as weights:  # its header alone
                    names += list(weights.keys())
    except Exception as err:  # noqa: BLE001  (a torn header, an index that is no JSON mapping)
        raise UserError(f"{name_or_path}: cannot load model: its weights' header: {_named(err)}") from None
    blocks = [int(m[1]) for name in names if (m := re.search(r"\.(\d+)\.", str(name)))]
    return max(blocks) + 1 if blocks else 0


def _named(err: BaseException) -> str:
    """``Type: message`` on one line (transformers' validation errors put their reason on the lines after the
    first), at most 300 characters."""
    text = " ".join(str(err).split())
    return f"{type(err).__name__}: {text[:300]}" if text else type(err).__name__


def _tokenizer(source: str, name_or_path: str) -> object:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(source)
    except (OSError, ValueError) as err:
        raise UserError(f"{name_or_path}: cannot load tokenizer: {first_line(err)}") from err


@contextmanager
def _timer(times: dict[str, float], part: str) -> Iterator[None]:
    """Add the block's seconds to ``times[part]``."""
    t0 = time.perf_counter()
    try:
        yield
    finally:
        times[part] = times.get(part, 0.0) + time.perf_counter() - t0


def _timed(times: dict[str, float], part: str, fn: Callable[..., T], *args: object) -> T:
    with _timer(times, part):
        return fn(*args)


def load_tokenizer(name_or_path: str, *, gguf_file: str | None = None) -> object:
    """The tokenizer ``load_base`` would load, without the model (a plan from the calibration cache needs no weights).

    Raises:
        UserError: as ``load_base``.
    """
    return _tokenizer(resolve_base(name_or_path, gguf_file), name_or_path)
