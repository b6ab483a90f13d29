"""``PackedLoRALinear``: a frozen base projection plus the LoRA weights of every slot that adapts it.

Composition, not inheritance: the wrapper calls the base module unchanged (``nn.Linear``, GPT-2's
``Conv1D``, anything mapping ``(..., D_in)`` to ``(..., D_out)``) and adds the packed LoRA term. Each slot's
``A`` (r, D_in) and ``B`` (D_out, r), the layout PEFT saves, are views of the slot's rows of the pack's slot store
(``packer.model.store``: ``PackedModel`` owns it, the step's optimizer updates it).

While the training step (or an evaluation forward on its shapes) runs, the layer hands its input to the store,
which adds every slot's term from the step's tables (``SlotStore.forward``, ``kernels.ops.packed_lora``). Outside
the step, a forward under a ``PackLayout`` is evaluation's per-adapter path: the layer concatenates the weights of
the slots it adapts into one ``a_cat`` / ``bt_cat`` (a copy of a few MB) and adds their term with
``kernels.ops.packed_lora_eval`` (for an exact ``nn.Linear``, ``kernels.ops.packed_lora_eval_linear``, which fuses
the base GEMM with it). The slots' weights are constants there: that path computes no gradient of them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from torch import nn

from lora_sweep.kernels.ops import Impl, LayerRanks, PackLayout, packed_lora_eval, packed_lora_eval_linear
from lora_sweep.kernels.reference import dora_loop
from lora_sweep.packer.variants.magnitude import base_weight

__all__ = ["PackState", "PackedLoRALinear", "as_rows"]


@dataclass
class PackState:
    """Shared by all layers of one packed model: what the current forward pass looks like."""

    impl: Impl = "auto"
    layout: PackLayout | None = None
    """Set by ``PackedModel`` around each forward; None means the base model alone."""
    scales: dict[int, float] = field(default_factory=dict)
    """Slot id -> LoRA scale s."""
    store: Any = None
    """While a fixed-shape step runs (``packer.model.store.SlotStore.stepping``), the store whose tables every
    wrapped layer reads instead of ``layout``; None otherwise."""
    mag: Any = None
    """While the pack has a slot store, its DoRA magnitudes (``packer.variants.magnitude.Magnitudes``), which the
    per-batch path applies to DoRA slots; None otherwise."""


class _SlotWeights(NamedTuple):
    a: torch.Tensor
    """(r, D_in) view of the slot's rows of the store."""
    bt: torch.Tensor
    """(r, D_out) B^T, contiguous in the store (the kernels' row layout)."""
    grad_a: torch.Tensor
    grad_bt: torch.Tensor


class _Gathered(NamedTuple):
    """What one layout needs from this layer, cached until the slots change."""

    ranks: LayerRanks
    a: list[torch.Tensor]
    bt: list[torch.Tensor]


class PackedLoRALinear(nn.Module):
    """A frozen projection with per-slot LoRA adapters.

    Args:
        base: the original module; its parameters are not copied or modified.
        in_features: D_in.
        out_features: D_out.
        layer_id: stable integer id of this layer (seeds its dropout masks).
        state: the pack's shared ``PackState``.
    """

    def __init__(self, base: nn.Module, in_features: int, out_features: int, layer_id: int, state: PackState) -> None:
        super().__init__()
        self.base = base
        self.in_features = in_features
        self.out_features = out_features
        self.layer_id = layer_id
        self.lora_A = nn.ParameterDict()  # str(slot) -> (r, D_in)
        self.lora_B = nn.ParameterDict()  # str(slot) -> (D_out, r)
        self._state = [state]  # a list keeps the shared object out of nn.Module's attribute machinery
        self._slots: dict[int, _SlotWeights] = {}
        self._cache: tuple[tuple[int, ...], _Gathered] | None = None

    @property
    def state(self) -> PackState:
        return self._state[0]

    def add_slot(self, slot: int, a: torch.Tensor, bt: torch.Tensor, grad_a: torch.Tensor,
                 grad_bt: torch.Tensor, trained: int | None = None) -> tuple[nn.Parameter, nn.Parameter]:
        """Register slot's adapter: A (rows, D_in) and B^T (rows, D_out), and their gradient buffers.

        All four are views of the slot's rows of the store (``PackedModel`` owns it); the forward reads every row.
        Returns the parameters A (r, D_in) and B (D_out, r) of the first ``trained`` rows (None: all), which alias the
        weights, their ``grad`` the gradients; rows past them are a frozen term (``packer.variants.decompose``).
        """
        r = a.shape[0] if trained is None else trained
        pa, pb = nn.Parameter(a[:r]), nn.Parameter(bt[:r].T)
        pa.grad, pb.grad = grad_a[:r], grad_bt[:r].T
        self.lora_A[str(slot)] = pa
        self.lora_B[str(slot)] = pb
        self._slots[slot] = _SlotWeights(a, bt, grad_a, grad_bt)
        self._forget()
        return pa, pb

    def remove_slot(self, slot: int) -> None:
        key = str(slot)
        if key in self.lora_A:
            del self.lora_A[key]
            del self.lora_B[key]
            del self._slots[slot]
            self._forget()

    def _forget(self) -> None:
        """The slots changed: drop the cached gathers (views of slot weights)."""
        self._cache = None

    def slot_weights(self, slot: int) -> _SlotWeights:
        """The slot's A, B^T and their gradient buffers (views of its rows of the store): every row the forward reads,
        a frozen principal correction's included."""
        return self._slots[slot]

    def _gathered(self, slots: tuple[int, ...]) -> _Gathered:
        """This layer's ranks for the slots of a layout, and the weights of those it adapts, in layout order."""
        if self._cache is not None and self._cache[0] == slots:
            return self._cache[1]
        here = [self._slots[s] for s in slots if s in self._slots]
        rank = tuple(self._slots[s].a.shape[0] if s in self._slots else 0 for s in slots)
        scale = tuple(self.state.scales[s] if s in self._slots else 0.0 for s in slots)
        g = _Gathered(LayerRanks(rank, scale, self.layer_id), [w.a for w in here], [w.bt for w in here])
        self._cache = (slots, g)
        return g

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (B, L, D_in) -> (B, L, D_out); an input of other rank whose leading dims flatten row-major to the pack's
        B·L tokens (OPT feeds its MLP (B·L, D_in)) keeps its leading shape: the packed term sees (B, L, D_in)."""
        if x.dim() != 3:
            rows = self._pack_rows()
            if rows is not None:
                return self.forward(as_rows(x, rows)).reshape(*x.shape[:-1], self.out_features)  # hooks run once
        if self.state.store is not None:
            return self.state.store.forward(self, x)
        layout = self.state.layout  # the per-adapter path (evaluation off the fixed shapes)
        g = None if layout is None else self._gathered(layout.slots)
        if g is None or not g.a:
            return self.base(x)
        with torch.no_grad():  # the slots' weights as constants: evaluation's path, no adapter gradient
            a_cat = torch.cat(g.a) if len(g.a) > 1 else g.a[0].detach()  # (R, D_in)
            bt_cat = torch.cat(g.bt) if len(g.bt) > 1 else g.bt[0].detach()  # (R, D_out)
            mags = None if self.state.mag is None else self.state.mag.of_layer(self, layout.slots)  # (D_out,) each
        if mags is not None:  # a DoRA slot: the reference's loop
            return dora_loop(x, base_weight(self.base), self.base.bias, a_cat, bt_cat, mags, layout, g.ranks)
        return self._with_lora(x, a_cat, bt_cat, layout, g.ranks, self.state.impl)

    def _pack_rows(self) -> int | None:
        """The rows B of the batch running now: the step's C x rows, else the layout's; None outside a pack."""
        store, layout = self.state.store, self.state.layout
        if store is not None and store.shape is not None:
            return store.capacity * store.shape.rows
        return None if layout is None else sum(layout.n_rows)

    def _with_lora(self, x: torch.Tensor, a_cat: torch.Tensor, bt_cat: torch.Tensor, layout: PackLayout,
                   ranks: LayerRanks, impl: Impl) -> torch.Tensor:
        """The base projection of x (B, L, D_in) plus the packed LoRA term: (B, L, D_out)."""
        if type(self.base) is nn.Linear:  # exactly nn.Linear (not a quantised subclass): its GEMM fuses with LoRA
            return packed_lora_eval_linear(x, self.base.weight, self.base.bias, a_cat, bt_cat, layout, ranks, impl=impl)
        return packed_lora_eval(x, self.base(x), a_cat, bt_cat, layout, ranks, impl=impl)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, slots={sorted(self._slots)}"


def as_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    """x (..., D) viewed as (B, L, D), B = ``rows``, the pack's rows: the rows of a (B·L, D) input flattened row-major
    from the batch (OPT's decoder does so before fc1/fc2) are back where the layout's row segments say.

    Raises:
        ValueError: x's tokens do not split into B rows (not the pack's tokens, e.g. a subset routed to an expert).
    """
    tokens = x.shape[:-1].numel()
    if x.dim() < 2 or rows == 0 or tokens % rows:
        raise ValueError(f"a packed projection got input of shape {tuple(x.shape)}, which is not the pack's "
                         f"{rows} rows of tokens; LoRA slots cannot be routed through it")
    return x.reshape(rows, tokens // rows, x.shape[-1])

