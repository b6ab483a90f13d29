"""The packer's face: every name the floors above it (``evaluators/``, ``sweep/``) use, and what the packer is.

**What a pack is.** One training run of one frozen base causal LM in which N LoRA adapters train at once, each in
its own *slot*: N trials of a sweep for the price of one base. The base is loaded once and frozen; each slot adds
its LoRA weights to the projections it targets, with its own rank, targets, dropout, learning rate and schedule
(``AdapterSpec``). Slots come and go while the pack runs: a finished or pruned trial leaves its slot, the next
trial takes it (``SlotJob``, ``SlotEnd``).

**The model** (``packer.model``). ``load_base`` reads the base (a Hugging Face checkpoint, a hub id, a GGUF file:
``gguf_source``; NF4 quantization: ``QUANTIZE``), ``PackedModel`` wraps its target projections with the packed LoRA
layer (``resolve_targets`` expands ``ALL_LINEAR`` and named targets) and holds the slots; an ``AdapterWriter``
writes a slot as a PEFT adapter directory (``read_adapter`` reads one back). A base too large for one GPU is
sharded over the processes of a pack with FSDP2 and read by rows (``load_sharded``).

**The data** (``packer.data``). ``read_jsonl`` and ``tokenize_rows`` turn a JSON-lines file in one of ``FORMATS``
into ``Example`` rows (labels ``IGNORE_INDEX`` on the prompt); each slot draws from its own stream (``SlotStream``,
``adapter_stream``: sample packing puts several examples in one row; ``epoch_steps``, ``stream_tokens``: what it adds
up to); ``collate`` builds a ``PackBatch``.

**The step** (``packer.step``). ``train`` runs the pack: every step the rows of all slots go through the model
together in one step of fixed shape, each slot's loss is the mean over its own target tokens and the pack's loss
the sum of those means, so each slot's gradient is the one it would get training alone; each slot clips and takes
its own AdamW step. The same step runs eagerly on the CPU and is replayed as a CUDA graph on CUDA (``STEP_NAMES``
names the two). It reports every slot step (``StepReport``). ``eval_graph`` evaluates the slots on the same
machinery; ``slot_losses`` is the per-slot cross-entropy.

**Planning** (``packer.plan``, ``packer.probe``). ``MemoryModel`` predicts a pack's peak memory and time from its
slots (``slots_for``, ``pack_peak``: how many of a kind fit, and their step's peak); ``calibrate`` fits it by running
real packed steps at two sizes; ``BaseShape`` is what a plan needs of the base without its weights (``base_shape``
reads it, ``forward_seconds`` times a base forward).

The packer never sees a study object: the sweep builds plain values (``AdapterSpec``, paths, numbers) and calls
these names, and only those (a name no module above the packer imports is not here). Each name is imported from
its module on first use (``__getattr__``, PEP 562), so importing this module loads neither torch nor transformers: a
light command (``sweep status``, a cached ``sweep plan``) pays only for the names it touches.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lora_sweep.packer.data.batch import PackBatch, collate
    from lora_sweep.packer.data.lines import iter_lines, line_bound
    from lora_sweep.packer.data.rows import (
        ALPACA_PROMPT,
        ALPACA_PROMPT_NO_INPUT,
        FORMATS,
        IGNORE_INDEX,
        Example,
        SlotStream,
        json_error,
        load_examples,
        read_jsonl,
        tokenize_rows,
    )
    from lora_sweep.packer.data.stream import (
        adapter_stream,
        epoch_steps,
        row_lengths,
        stream_tokens,
        target_tokens,
    )
    from lora_sweep.packer.families import FAMILY_NAMES
    from lora_sweep.packer.loss import slot_losses
    from lora_sweep.packer.model import QUANTIZE
    from lora_sweep.packer.model.checkpoint import (
        CONFIG_NAME,
        WEIGHTS_NAME,
        AdapterWriter,
        discard_adapter,
        read_adapter,
    )
    from lora_sweep.packer.model.gguf import convert, gguf_source, packaged_gguf
    from lora_sweep.packer.model.inject import linear_shape, resolve_targets
    from lora_sweep.packer.model.load import load_base, load_tokenizer, prepare_kernels, resolve_base
    from lora_sweep.packer.model.packed import PackedModel
    from lora_sweep.packer.model.quant import dequantize_base, quantize_base
    from lora_sweep.packer.model.shard_load import load_sharded, meta_load_refusal
    from lora_sweep.packer.plan import ALL_LINEAR, AdapterSpec, BaseShape, MemoryModel
    from lora_sweep.packer.probe import (
        PROBE_STEPS,
        available_memory,
        base_shape,
        calibrate,
        forward_seconds,
        time_pack,
    )
    from lora_sweep.packer.step import eval_graph
    from lora_sweep.packer.step.isolation import check_sample_packing
    from lora_sweep.packer.step.shapes import length_buckets
    from lora_sweep.packer.step.train import STEP_NAMES, BatchSource, SlotEnd, SlotJob, StepReport, train
    from lora_sweep.packer.tiny.models import build_tiny_model

_WHERE: dict[str, tuple[str, ...]] = {
    "data.batch": ("PackBatch", "collate"),
    "data.rows": ("ALPACA_PROMPT", "ALPACA_PROMPT_NO_INPUT", "FORMATS", "IGNORE_INDEX", "Example", "SlotStream",
                  "json_error", "load_examples", "read_jsonl", "tokenize_rows"),
    "data.lines": ("iter_lines", "line_bound"),
    "data.stream": ("adapter_stream", "epoch_steps", "row_lengths", "stream_tokens", "target_tokens"),
    "families": ("FAMILY_NAMES",),
    "loss": ("slot_losses",),
    "model.checkpoint": ("CONFIG_NAME", "WEIGHTS_NAME", "AdapterWriter", "discard_adapter", "read_adapter"),
    "model.gguf": ("convert", "gguf_source", "packaged_gguf"),
    "model.inject": ("linear_shape", "resolve_targets"),
    "model.load": ("load_base", "load_tokenizer", "prepare_kernels", "resolve_base"),
    "model.packed": ("PackedModel",),
    "model": ("QUANTIZE",),
    "model.quant": ("dequantize_base", "quantize_base"),
    "model.shard_load": ("load_sharded", "meta_load_refusal"),
    "plan": ("ALL_LINEAR", "AdapterSpec", "BaseShape", "MemoryModel"),
    "probe": ("PROBE_STEPS", "available_memory", "base_shape", "calibrate", "forward_seconds", "time_pack"),
    "step": ("eval_graph",),
    "step.isolation": ("check_sample_packing",),
    "step.shapes": ("length_buckets",),
    "step.train": ("STEP_NAMES", "BatchSource", "SlotEnd", "SlotJob", "StepReport", "train"),
    "tiny.models": ("build_tiny_model",),
}  # fmt: skip
"""Module under ``lora_sweep.packer`` -> the names this face takes from it (the ``TYPE_CHECKING`` imports above,
for the type checker; tests/packer/test_packer_api.py keeps the two equal)."""
_MODULE = {name: module for module, names in _WHERE.items() for name in names}

__all__ = sorted(_MODULE)


def __getattr__(name: str) -> Any:
    """``name`` from its module, imported now (a submodule such as ``eval_graph`` is imported as itself)."""
    module = _MODULE.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    home = importlib.import_module(f"lora_sweep.packer.{module}")
    value = getattr(home, name) if hasattr(home, name) else importlib.import_module(f"{home.__name__}.{name}")
    globals()[name] = value  # the next lookup is a plain module attribute
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
