"""The packer's face: what the floors above it (``evaluators/``, ``sweep/``, the entry points) use, and what the
packer is.

**What a pack is.** One training run of one frozen base causal LM in which N LoRA adapters train at once, each in
its own *slot*: N trials of a sweep for the price of one base. The base is loaded once and frozen; each slot adds
its LoRA weights to the projections it targets, with its own rank, targets, dropout, learning rate and schedule
(``AdapterSpec``). Slots come and go while the pack runs: a finished or pruned trial leaves its slot, the next
trial takes it (``SlotJob`` in, ``StepReport`` and ``SlotEnd`` out).

**The object.** ``open_base(path, ...)`` loads the base once and returns a ``Packer``; the sweep asks it for
everything a base is needed for, by verb (``packer.base``):

- *open*: ``open_base``; ``Packer.examples`` tokenizes a data file with the base's tokenizer (``tiny_base`` builds a
  tiny random-init base to open);
- *plan*: ``Packer.shape`` (a ``BaseShape``), ``Packer.calibrate`` (a measured ``MemoryModel``: how many slots of a
  kind fit and their step's peak, per GPU of a sharded base too), its probes' options for a space
  (``Packer.probe_options``) and what its measurement depends on (``Packer.measured_on``),
  ``Packer.sharded_load_peak``, ``Packer.forward_seconds``, ``Packer.check_sample_packing``;
- *train*: ``Packer.train(capacity, next_job, on_step=..., should_stop=..., on_end=...)``: every step the rows of
  all slots go through the model together, each slot's loss is the mean over its own target tokens, so each
  slot's gradient is the one it would get training alone; each slot clips and takes its own AdamW step;
- *evaluate*: ``Packer.model`` (a ``PackedModel``) is what an evaluator scores, with ``evaluation.row_losses`` and
  ``evaluation.greedy_decode`` (on the pack's fixed shapes where they serve, else per adapter);
- *save / export*: ``Packer.save`` writes slots as PEFT adapter directories off the caller's path;
  ``Packer.read_adapter``, ``Packer.write_adapter`` and ``Packer.discard_adapter`` work on written ones, and
  ``Packer.merge_base`` loads the base an export merges one into.

**Values and namespaces.** Twelve names: the object and its two builders (``Packer``, ``open_base``,
``tiny_base``), the three values a plan or a slot is made of (``AdapterSpec``, ``BaseShape``, ``MemoryModel``), and
six namespaces, each a light module: ``jobs``: what ``Packer.train`` takes and gives back (``SlotJob`` in,
``StepReport``, ``SlotEnd`` and ``TrainResult`` out, ``STEP_NAMES``: what ``TrainResult.step`` means);
``supported``: what a study file is checked against (``FORMATS``, ``line_bound``, ``QUANTIZE``, ``ALL_LINEAR``,
``FAMILY_NAMES``); ``data``: reading and streaming rows (``read_jsonl``, ``load_examples``, ``Example``,
``SlotStream``, ``adapter_stream``, ``epoch_steps`` ...); ``evaluation``: scoring on the pack; ``gguf``: GGUF sources
and their conversion (``gguf_source``, ``packaged_gguf``, ``convert``); ``variants``: the adapter variants
(``FIELDS``: the ``AdapterSpec`` fields they own, which a study's settings table reads).

The packer never sees a study object: the sweep builds plain values (``AdapterSpec``, paths, numbers) and calls
these names, and only those (a name no module above the packer imports is not here). Every module imported here is
light (no torch, no transformers); the object's methods import the modules they run when called, so loading a
study file, ``sweep status`` or a cached ``sweep plan`` loads no torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lora_sweep.packer import data, evaluation, jobs, supported, variants
from lora_sweep.packer.base import Packer, open_base, tiny_base
from lora_sweep.packer.model import gguf
from lora_sweep.packer.plan import AdapterSpec, BaseShape, MemoryModel

if TYPE_CHECKING:  # a type for annotations only: a PackedModel is built by open_base
    from lora_sweep.packer.model.packed import PackedModel

__all__ = ["AdapterSpec", "BaseShape", "MemoryModel", "Packer", "data", "evaluation", "gguf", "jobs", "open_base",
           "supported", "tiny_base", "variants"]
TYPE_NAMES = ("PackedModel",)
"""Names the face gives the type checker only (under ``TYPE_CHECKING``): annotations, never built above the packer."""
