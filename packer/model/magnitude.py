"""DoRA in a pack (torch path): every slot's per-column magnitude in preallocated buffers, and the DoRA layer term.

DoRA (https://arxiv.org/abs/2402.09353, PEFT's ``DoraLinearLayer``) rescales each output column of the adapted
weight to a trained magnitude m: ``y = b + (m / n) * (W + s B A) x`` with ``n = ||W + s B A||`` per output row,
detached (the paper's section 4.3). A pack mixes DoRA and plain slots over one base, so the term is written as the
plain slots' plus a correction that is zero for them:

    y = W x + b + lora + (ratio - 1) * (W x + lora),   ratio = m / n for a DoRA slot, 1 for any other,

with lora = s B A x. ``Magnitudes`` holds m for all C slots of every wrapped projection, ``(C, D_out)`` per layer,
in four flat buffers beside the store's (weights, gradients and the two AdamW moments), and per layer a per-slot
flag (1: a DoRA slot adapting that layer), so a refill writes data, never a shape. The optimizer takes m with B's
learning rate and decay (PEFT's LoRA+ groups every 1-d parameter with B). Magnitudes start at ``||W||`` per row, n
at B = 0. The Triton kernels do not read them: a DoRA slot trains on the torch path only (refused elsewhere).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from lora_sweep.kernels.reference import dora_norm

__all__ = ["Magnitudes", "base_weight", "dora_ratio"]


def base_weight(base: nn.Module) -> torch.Tensor:
    """The (D_out, D_in) weight of a wrapped projection (``nn.Linear``, or GPT-2's Conv1D stored (D_in, D_out)).

    Raises:
        ValueError: a projection whose weight is neither (a quantized or other module).
    """
    w = getattr(base, "weight", None)
    if type(base) is nn.Linear and isinstance(w, torch.Tensor):
        return w
    if type(base).__name__ == "Conv1D" and isinstance(w, torch.Tensor):
        return w.T
    raise ValueError(f"DoRA needs an nn.Linear or Conv1D projection, not {type(base).__name__}")


class Magnitudes:
    """Per-slot DoRA magnitudes of a store (module docstring).

    Args:
        layers: the store's wrapped projections by path (their ``out_features``).
        capacity: C, slots.
        device: where the buffers live.
    """

    def __init__(self, layers: Mapping[str, nn.Module], capacity: int, device: torch.device) -> None:
        self.capacity = capacity
        out_features = {p: int(layer.out_features) for p, layer in layers.items()}  # type: ignore[arg-type]
        self.path_of = {id(layer): p for p, layer in layers.items()}
        total = capacity * sum(out_features.values())
        self.flat, self.grad, self.exp_avg, self.exp_avg_sq = (torch.zeros(total, device=device) for _ in range(4))
        self.on = {p: torch.zeros(capacity, device=device) for p in out_features}
        """Path -> (C,) 1 where the slot is a DoRA slot adapting that layer (0 on a layer it does not target: its
        base output there stays the base's)."""
        self.slots: set[int] = set()
        """The DoRA slots, on the host: whether a step needs the DoRA branch at all."""
        self.m: dict[str, nn.Parameter] = {}
        self.offsets: dict[str, tuple[int, int]] = {}
        off = 0
        for p, d_out in out_features.items():
            self.offsets[p] = (off, d_out)
            leaf = nn.Parameter(self.flat[off:off + capacity * d_out].view(capacity, d_out))
            leaf.grad = self.grad[off:off + capacity * d_out].view(capacity, d_out)
            self.m[p] = leaf
            off += capacity * d_out

    def views(self, path: str) -> list[torch.Tensor]:
        """(C, D_out) views of the layer's magnitudes in the four buffers (weights, gradients, moments)."""
        off, d = self.offsets[path]
        return [buf[off:off + self.capacity * d].view(self.capacity, d)
                for buf in (self.flat, self.grad, self.exp_avg, self.exp_avg_sq)]

    @torch.no_grad()
    def reset_slot(self, slot: int, dora: bool) -> None:
        """Zero the slot's magnitudes, moments and flags everywhere; note whether it is a DoRA slot (``start`` then
        flags each layer it adapts)."""
        torch._foreach_zero_([v[slot] for p in self.offsets for v in self.views(p)])
        for on in self.on.values():
            on[slot] = 0.0
        (self.slots.add if dora else self.slots.discard)(slot)

    @torch.no_grad()
    def start(self, slot: int, path: str, weight: torch.Tensor) -> None:
        """Set the slot's magnitude of one layer it adapts to ``||W||`` per row, DoRA's start (B = 0, PEFT's
        ``update_layer``), and flag it."""
        self.m[path].data[slot] = torch.linalg.norm(weight.to(self.flat.dtype), dim=1)
        self.on[path][slot] = 1.0

    def slot(self, slot: int, path: str) -> torch.Tensor:
        """The slot's (D_out,) magnitude of one layer (a view of the buffer)."""
        return self.m[path].data[slot]

    def of_layer(self, layer: nn.Module, slots: tuple[int, ...]) -> list[torch.Tensor | None] | None:
        """Per slot of ``slots``, its magnitude of ``layer`` if it is a DoRA slot adapting it, else None; None when
        no slot is (the evaluation path's question: ``kernels.reference.dora_loop`` or the plain LoRA term)."""
        if not self.slots.intersection(slots):
            return None
        path = self.path_of[id(layer)]
        on = self.on[path].tolist()
        out = [self.m[path][s] if s in self.slots and on[s] > 0 else None for s in slots]
        return out if any(m is not None for m in out) else None

    def copy_slot_from(self, other: Magnitudes, slot: int) -> None:
        """Move a live slot's magnitudes, moments and flag from ``other`` (the store being replaced)."""
        with torch.no_grad():
            for p in self.offsets:
                for new, old in zip(self.views(p), other.views(p), strict=True):
                    new[slot] = old[slot]
                self.on[p][slot] = other.on[p][slot]
        if slot in other.slots:
            self.slots.add(slot)


def dora_ratio(weight: torch.Tensor, a: torch.Tensor, bt: torch.Tensor, scale: torch.Tensor, m: torch.Tensor,
               on: torch.Tensor) -> torch.Tensor:
    """Every slot's column factor ``m / ||W + s B A||`` (1 for a slot that is not DoRA), differentiable in m only.

    Args:
        weight: (D_out, D_in) base weight.
        a: (C, RB, D_in) the slots' A (rank padding zero); bt: (C, RB, D_out) their B^T.
        scale: (C,) the slots' scales.
        m: (C, D_out) magnitudes; on: (C,) 1 for a DoRA slot.

    Returns:
        (C, D_out).
    """
    with torch.no_grad():
        norm = torch.stack([dora_norm(weight, a[g], bt[g], scale[g]) for g in range(a.shape[0])])  # (C, D_out)
        norm = torch.where(on[:, None] > 0, norm, torch.ones_like(norm))
    return torch.where(on[:, None] > 0, m / norm, torch.ones_like(norm))
