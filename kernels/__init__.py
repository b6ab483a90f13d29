"""Packed multi-adapter LoRA ops.

``packed_lora`` is the one entry point; the implementation is an explicit argument so the Triton
kernels drop in without touching the packer. Imports without triton.
"""

from __future__ import annotations

from typing import Literal

import torch

from kernels.meta import LayerRanks, PackLayout, dropout_seed
from kernels.reference import lora_loop, lora_masked_dense

__all__ = ["packed_lora", "PackLayout", "LayerRanks", "dropout_seed", "IMPLS", "Impl"]

Impl = Literal["torch", "loop"]
IMPLS: tuple[str, ...] = ("torch", "loop")
"""``torch``: masked-dense PyTorch (any device, a constant number of ops per layer); ``loop``: the
per-slot loop oracle."""


def packed_lora(x: torch.Tensor, base_out: torch.Tensor, a_cat: torch.Tensor, bt_cat: torch.Tensor,
                layout: PackLayout, ranks: LayerRanks, *, impl: Impl = "torch") -> torch.Tensor:
    """Add every slot's LoRA term to the base output of one layer.

    Args:
        x: (B, L, D_in) layer input, rows grouped by slot as ``layout`` says.
        base_out: (B, L, D_out) output of the frozen base layer on ``x``.
        a_cat: (R, D_in) every slot's A stacked by rows (R = sum of ``ranks.rank``).
        bt_cat: (R, D_out) every slot's B^T stacked the same way.
        layout: row segments of the packed batch.
        ranks: per-slot rank (0 = slot skips this layer) and scale of this layer.
        impl: which implementation computes it.

    Returns:
        (B, L, D_out) tensor; differentiable in x, a_cat and bt_cat.
    """
    if impl == "torch":
        return lora_masked_dense(x, base_out, a_cat, bt_cat, layout, ranks)
    if impl == "loop":
        return lora_loop(x, base_out, a_cat, bt_cat, layout, ranks)
    raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
