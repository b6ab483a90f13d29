"""``PackedLoRALinear``: a frozen base projection plus the LoRA weights of every slot that adapts it.

Composition, not inheritance: the wrapper calls the base module unchanged (``nn.Linear``, GPT-2's
``Conv1D``, anything mapping ``(..., D_in)`` to ``(..., D_out)``) and adds the packed LoRA term with
``kernels.packed_lora``. Each slot owns its own ``A`` (r, D_in) and ``B`` (D_out, r) parameters, the
layout PEFT saves, so per-slot optimizers, removal and refill are dictionary operations; the layer
concatenates the active slots' weights per forward (a few KB to MB, negligible next to the GEMMs).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from kernels import Impl, LayerRanks, PackLayout, packed_lora, packed_lora_linear

__all__ = ["PackState", "PackedLoRALinear"]


@dataclass
class PackState:
    """Shared by all layers of one packed model: what the current forward pass looks like."""

    impl: Impl = "torch"
    layout: PackLayout | None = None
    """Set by ``PackedModel`` around each forward; None means the base model alone."""
    scales: dict[int, float] = field(default_factory=dict)
    """Slot id -> LoRA scale s."""


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

    @property
    def state(self) -> PackState:
        return self._state[0]

    def add_slot(self, slot: int, a: torch.Tensor, b: torch.Tensor) -> tuple[nn.Parameter, nn.Parameter]:
        """Register slot's adapter weights A (r, D_in) and B (D_out, r).

        ``a`` and ``b`` are views into the slot's flat buffer (``PackedModel`` owns it); the
        parameters alias them, so an optimizer can update all of a slot's weights as one tensor.
        """
        pa, pb = nn.Parameter(a), nn.Parameter(b)
        self.lora_A[str(slot)] = pa
        self.lora_B[str(slot)] = pb
        return pa, pb

    def remove_slot(self, slot: int) -> None:
        key = str(slot)
        if key in self.lora_A:
            del self.lora_A[key]
            del self.lora_B[key]

    def has_slot(self, slot: int) -> bool:
        return str(slot) in self.lora_A

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (B, L, D_in) -> (B, L, D_out)."""
        layout = self.state.layout
        if layout is None or not any(str(s) in self.lora_A for s in layout.slots):
            return self.base(x)
        a_list, bt_list, rank, scale = [], [], [], []
        for s in layout.slots:
            key = str(s)
            if key in self.lora_A:
                a_list.append(self.lora_A[key])
                bt_list.append(self.lora_B[key].T)
                rank.append(self.lora_A[key].shape[0])
                scale.append(self.state.scales[s])
            else:
                rank.append(0)
                scale.append(0.0)
        ranks = LayerRanks(tuple(rank), tuple(scale), self.layer_id)
        a_cat = torch.cat(a_list, dim=0)  # (R, D_in)
        bt_cat = torch.cat(bt_list, dim=0)  # (R, D_out)
        if type(self.base) is nn.Linear:  # exactly nn.Linear (not a quantised subclass): its GEMM fuses with LoRA
            return packed_lora_linear(x, self.base.weight, self.base.bias, a_cat, bt_cat, layout, ranks,
                                      impl=self.state.impl)
        return packed_lora(x, self.base(x), a_cat, bt_cat, layout, ranks, impl=self.state.impl)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, slots={sorted(int(k) for k in self.lora_A)}"
