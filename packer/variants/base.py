"""The adapter-variant seam: what a variant of LoRA changes in a pack, as one object of hooks the pack asks.

PEFT puts each variant behind ``LoraVariant`` (``init`` / ``merge`` / ``unmerge`` / ``forward``,
src/peft/tuners/lora/layer.py); a pack needs more of a variant than one layer does, because every slot's adapter
lives in the shared slot store and is stepped from device tables. A ``Variant`` is a frozen record of the hooks the
pack's call sites ask, each None where the variant leaves plain LoRA as it is:

======================  ===============================================  ========================================
hook                    asked by                                         built-in that fills it
======================  ===============================================  ========================================
``applies``, ``check``  ``AdapterSpec.__post_init__``: its fields' rules  every one
``whole_base``          ``StudySpec``: an NF4 or sharded base refused      ``principal``, ``dora``
``rows``                ``AdapterSpec.rows``: store and planner rows      ``principal`` (2r)
``init``                ``PackedModel``: a slot's A and B^T rows          ``lora`` (kaiming, gaussian), ``principal``
``state``, ``start``    ``SlotStore``: per-slot buffers of the store      ``dora`` (magnitudes), ``lorafa`` (gains)
``optimizer``           ``optimizer_row``: the slot's optimizer columns   ``loraplus`` (B's rate), ``lorafa``
``before_norm``,        ``adamw_step``: the pack's gradient before the    ``lorafa`` (A frozen, B's gradient
``before_step``         clip norm, then before the AdamW step             projected)
``peft_config``,        ``checkpoint``: ``adapter_config.json`` fields,   ``principal`` (rank 2r), ``dora``
``peft_tensors``        the extra tensors of the safetensors file         (``use_dora``, magnitude vectors)
``merge``               ``merge_adapter``: an export folding the adapter  ``dora`` (rows rescaled to magnitudes)
                        into its base, the extra tensors' share
======================  ===============================================  ========================================

A slot's variants are every built-in whose ``applies(spec)`` holds (``packer.variants.of``), so they compose: a DoRA
slot with PiSSA's init and LoRA+'s ratio asks three. The forward term and its kernel entry stay with the store's
state (DoRA's column rescale: ``packer.variants.magnitude``, ``kernels.triton_dora``); a variant whose forward is plain
LoRA's (LoRA+, LoRA-FA) needs none. This module and the variant modules import no torch at module level:
``AdapterSpec`` checks its fields with them while a study file loads; the torch halves are modules of their own
(``magnitude``: DoRA's buffers and term, ``decompose``: PiSSA's and OLoRA's factors, ``initial``: PEFT's draws of A),
imported by the hooks that run them. The variants import nothing else of the packer: ``packer.plan`` and
``packer.model`` import them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from lora_sweep.errors import ConfigError

if TYPE_CHECKING:
    import torch
    from torch import nn

__all__ = ["Variant", "SlotState", "require", "OPT_COLUMNS", "AdapterSpec", "PackedModel", "SlotStore",
           "ShapeBuffers"]

# The pack's types a hook receives, by name only: ``packer.plan`` and ``packer.model`` import this package (the
# specs' checks, the variants' buffers and terms), so importing them here would close an import circle.
AdapterSpec = Any
"""A slot's ``packer.plan.AdapterSpec``."""
PackedModel = Any
"""The pack, ``packer.model.packed.PackedModel``."""
SlotStore = Any
"""The pack's ``packer.model.store.SlotStore``."""
ShapeBuffers = Any
"""The step's ``packer.model.store.ShapeBuffers``."""

OPT_COLUMNS = ("decay_a", "w1", "b2", "w2", "bc2", "eps", "step_a", "clip", "keep", "decay_b", "step_b")
"""Names of the optimizer table's columns, in order (``kernels.triton_adamw.OPT_FIELDS`` of them): A's decay
``1 - lr wd``, ``1 - beta1``, ``beta2``, ``1 - beta2``, ``sqrt(1 - beta2^t)``, eps, A's step ``-lr / (1 - beta1^t)``,
the clip norm, whether the gradient is kept, B's decay and B's step (B's at its own learning rate)."""


class SlotState(Protocol):
    """Per-slot buffers a variant adds to the slot store (DoRA's magnitudes): made once per store by
    ``Variant.state`` when the first slot of the variant arrives, then kept for every slot of that store."""

    slots: set[int]
    """The slots that use the buffers now."""

    def reset_slot(self, slot: int, on: bool) -> None:
        """Zero ``slot``'s share; ``on``: the slot uses the variant (its ``start`` follows per layer)."""

    def copy_slot_from(self, other: Any, slot: int) -> None:
        """Take ``slot``'s share from the same variant's state of the store a bucket change replaces."""


def require(ok: bool, key: str, rule: str, value: object) -> None:
    """Raise the one-line ``ConfigError`` of a setting's rule, naming its key, unless ``ok``."""
    if not ok:
        raise ConfigError(f"{key}: {rule} (got {value!r})")


def _nothing(spec: AdapterSpec) -> None:
    """A variant without rules of its own."""


@dataclass(frozen=True, eq=False, repr=False)
class Variant:
    """One adapter variant's hooks (module docstring's table); None: plain LoRA's behaviour.

    Shapes: ``a`` (rows, D_in) and ``bt`` (rows, D_out) are a slot's rows of one layer in the store; the store's
    per-layer leaves are (C * RB, D), C slots of RB rows.
    """

    name: str
    """The name a study searches it by (a setting or a value of one)."""
    applies: Callable[[AdapterSpec], bool]
    """Whether a slot of ``spec`` is of this variant."""
    fields: tuple[str, ...] = ()
    """The ``AdapterSpec`` fields that select the variant or tune it (a study's settings of the same names)."""
    check: Callable[[AdapterSpec], None] = _nothing
    """Raise ``ConfigError`` naming the key of a value of the variant's fields it refuses (every spec is checked,
    applying or not: a field's value rule holds everywhere)."""
    whole_base: str = ""
    """What the variant does with the whole floating-point base weight of a layer (PiSSA decomposes it, DoRA reads its
    row norms), which a base that no process holds whole and in float (an NF4 base, an FSDP shard) cannot give: a
    study of such a base is refused at load with it; empty: any base serves."""
    rows: Callable[[AdapterSpec], int] | None = None
    """Rows of A and B^T the slot's forward reads per layer (default: its rank); the store's bucket and the
    planner's memory term size a slot by it."""
    init: Callable[[torch.Tensor, torch.Tensor, nn.Module, AdapterSpec, str, torch.Generator], None] | None = None
    """Fill a fresh slot's ``a`` and ``bt`` of one layer (``base``, at ``path``) from the slot's generator; exactly
    one variant of a slot has it."""
    state: Callable[[SlotStore], SlotState] | None = None
    """Make the variant's per-slot buffers for a store (``SlotStore.state_of``)."""
    start: Callable[[Any, int, AdapterSpec, str, nn.Module], None] | None = None
    """Start a fresh slot's share of the state for one layer: ``(state, slot, spec, path, base)``."""
    optimizer: Callable[[AdapterSpec, dict[str, float], float, int], None] | None = None
    """Change the slot's optimizer row (``OPT_COLUMNS`` -> value) in place, for its ``step``-th update (1-based) at
    learning rate ``lr``: ``(spec, row, lr, step)``."""
    before_norm: Callable[[SlotStore, ShapeBuffers], None] | None = None
    """Change the pack's gradients before the per-slot clip norm is taken (device ops only: the step is captured
    in a CUDA graph; slots are told apart by the variant's state, never by a host branch on a value)."""
    before_step: Callable[[SlotStore, ShapeBuffers], None] | None = None
    """Change the pack's gradients after the norm, before the AdamW step (a linear map commutes with clipping)."""
    peft_config: Callable[[AdapterSpec, dict[str, Any]], None] | None = None
    """Change the slot's ``adapter_config.json`` fields in place."""
    peft_tensors: Callable[[PackedModel, int], dict[str, torch.Tensor]] | None = None
    """The slot's extra PEFT tensors, module path -> tensor, each saved under ``f"{path}.{peft_key}"``."""
    peft_key: str = ""
    """PEFT's key suffix of ``peft_tensors``' tensors (``lora_magnitude_vector``)."""
    merge: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
    """Fold one module's ``peft_key`` tensor into its merged weight, PEFT's ``merge``: ``(merged, tensor)`` ->
    merged, with ``merged`` W + s·B·A as (D_out, D_in) and both in fp32; None with a ``peft_key``: not mergeable."""

    def __repr__(self) -> str:
        return f"Variant({self.name!r})"
