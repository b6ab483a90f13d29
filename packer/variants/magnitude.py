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
at B = 0. The torch path adds the term with autograd (``torch_term``); the Triton path rescales the packed output by
r in one kernel each way (``kernels.triton_dora``, ``triton_rescale``), which adds m's gradient into ``grad`` itself,
and the Triton AdamW steps m as one more B-like segment per layer (``segs``).

With dropout d, PEFT's DoRA term takes the dropped input: ``(ratio - 1) * (W d(x) + lora)``, lora on d(x) too. The
pack's base GEMM ran on x, so a DoRA slot with dropout subtracts ``W (x - d(x))``, one more GEMM over its own tokens
(``stage_dropout`` names those slots for the step).
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from lora_sweep.kernels import ops
from lora_sweep.kernels.ops import SEG_FLT_COL, SegmentMeta

__all__ = ["Magnitudes", "base_weight", "dora_norms", "dora_ratio", "torch_term", "triton_factors", "triton_rescale"]


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
        self.segs = torch.tensor([(o, d, 1) for o, d in self.offsets.values()], dtype=torch.int64, device=device)
        self.drop_slots: tuple[int, ...] = ()
        self.drop_sel = torch.zeros(capacity, dtype=torch.int64, device=device)
        self.drop_pos = torch.full((capacity,), -1, dtype=torch.int32, device=device)
        """The DoRA slots with dropout of the step being run (``stage_dropout``), on the host; on the device, those
        slots in order (``drop_sel[:k]``) and each slot's place among them, -1 for any other (``drop_pos``)."""
        self.wsq: dict[str, torch.Tensor] = {}
        with torch.no_grad():  # W is frozen: its row norms once, for the Triton path's factors (``kernels.ops``)
            for p, layer in layers.items():
                with contextlib.suppress(ValueError):  # a projection DoRA cannot adapt (``base_weight``): no entry
                    self.wsq[p] = base_weight(layer.base).to(self.flat.dtype).square().sum(dim=1)  # type: ignore[attr-defined]
        """(layers, 3) the Triton AdamW's segment table (``kernels.triton_adamw``): per layer a block of one row of
        D_out per slot, stepped at B's learning rate and decay. ``wsq``: path -> (D_out,) ``||W||^2`` per row, for
        every projection DoRA can adapt."""

    def stage_dropout(self, dropout: Sequence[float]) -> int:
        """Note the step's DoRA slots with dropout (p per slot, ``dropout``) in ``drop_slots`` and the device tables,
        which are written only when they change, before the step runs (a captured step reads them, as its other
        tables). Returns their count k: part of the step's graph key (the shape of their extra GEMM)."""
        sel = tuple(g for g in sorted(self.slots) if dropout[g] > 0)
        if sel != self.drop_slots:
            pos = [-1] * self.capacity
            for i, g in enumerate(sel):
                pos[g] = i
            self.drop_sel[:len(sel)].copy_(torch.tensor(sel, dtype=torch.int64))
            self.drop_pos.copy_(torch.tensor(pos, dtype=torch.int32))
            self.drop_slots = sel
        return len(sel)

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


def dora_norms(weight: torch.Tensor, a: torch.Tensor, bt: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Every slot's row norm ``||W + s B A||`` at once (``kernels.reference.dora_norm``'s expansion, batched over slots:
    a few ops per layer whatever C is), detached.

    Args:
        weight: (D_out, D_in) base weight.
        a: (C, RB, D_in) the slots' A (rank padding zero); bt: (C, RB, D_out) their B^T.
        scale: (C,) the slots' scales.

    Returns:
        (C, D_out) in ``a``'s dtype.
    """
    with torch.no_grad():
        w = weight.to(a.dtype)
        s = scale.to(a.dtype)[:, None]  # (C, 1)
        wa = torch.matmul(a, w.T)  # (C, RB, D_out): (A W^T)^T per slot
        quad = torch.matmul(torch.matmul(a, a.transpose(1, 2)), bt)  # (C, RB, D_out): (A A^T) B^T
        sq = w.square().sum(dim=1) + 2 * s * (bt * wa).sum(dim=1) + s.square() * (bt * quad).sum(dim=1)
        return sq.clamp(min=0).sqrt()


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
    dora = on[:, None] > 0
    with torch.no_grad():
        norm = torch.where(dora, dora_norms(weight, a, bt, scale), torch.ones_like(m))
    return torch.where(dora, m / norm, torch.ones_like(norm))


def torch_term(mag: Magnitudes, path: str, base: nn.Module, base_out: torch.Tensor, lora: torch.Tensor,
               x: torch.Tensor, masks: torch.Tensor | None, a: torch.Tensor, bt: torch.Tensor,
               scale: torch.Tensor) -> torch.Tensor:
    """What DoRA adds for its slots on the torch path, ``(ratio - 1) * (W d(x) + lora)``, d a slot's dropout: zero on
    every other slot's rows; differentiable in x, the LoRA term and m.

    Args:
        mag: the store's magnitudes; path: the layer's; base: its frozen projection.
        base_out: (B, L, D_out) ``base(x)``; lora: (B, L, D_out) the slots' LoRA term (on the dropped input).
        x: (B, L, D_in); masks: (B, L, D_in) every slot's dropout multiplier (ones without), or None.
        a: (C, RB, D_in) the slots' A; bt: (C, RB, D_out) their B^T; scale: (C,) their scales.

    Returns:
        (B, L, D_out).
    """
    weight, bias = base_weight(base), getattr(base, "bias", None)
    wx = base_out if bias is None else base_out - bias  # (B, L, D_out)
    if masks is not None and mag.drop_slots:  # W d(x) = W x - W (x - d(x)): PEFT's DoRA term sees d(x)
        wx = wx - F.linear((x * (1 - masks.to(x.dtype))).to(weight.dtype), weight).to(wx.dtype)
    ratio = dora_ratio(weight, a, bt, scale, mag.m[path], mag.on[path])  # (C, D_out)
    b, seq, d_out = wx.shape
    per_row = (ratio - 1).to(wx.dtype)[:, None, None, :]  # (C, 1, 1, D_out): slot g's rows are a block
    return (per_row * (wx + lora).view(mag.capacity, b // mag.capacity, seq, d_out)).view(b, seq, d_out)


def triton_factors(mag: Magnitudes, path: str, weight: torch.Tensor, a: torch.Tensor, bt: torch.Tensor,
                   a_op: torch.Tensor | None, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``dora_ratio`` on the Triton path, detached, with its derivative in m (``1 / ||W + s B A||``, 0 for a slot
    that is not DoRA): ``kernels.ops.dora_factors`` given every slot's
    ``A W^T`` in one GEMM (a bf16 base on CUDA: the kernels' bf16 copy of A, fp32 out; else in A's dtype) and
    ``A A^T`` in one batched product.

    Args:
        mag: the store's magnitudes; path: the layer's.
        weight: (D_out, D_in) base weight.
        a: (C, RB, D_in) the slots' A; bt: (C * RB, D_out) their B^T.
        a_op: (C * RB, D_in) A in the kernels' operand dtype, or None.
        scale: (C,) the slots' scales.

    Returns:
        (C, D_out) fp32 each.
    """
    flat = a.reshape(-1, a.shape[-1])
    if weight.dtype == a.dtype:
        wa = flat @ weight.T
    elif weight.is_cuda and a_op is not None and a_op.dtype == weight.dtype:
        wa = torch.mm(a_op, weight.T, out_dtype=torch.float32)  # type: ignore[call-arg]
    else:
        wa = flat @ weight.to(a.dtype).T
    return ops.dora_factors(wa, bt, torch.bmm(a, a.transpose(1, 2)), mag.wsq[path], mag.m[path].detach(),
                            mag.on[path], scale)


def triton_rescale(mag: Magnitudes, path: str, base: nn.Module, x: torch.Tensor, y: torch.Tensor,
                   bits: torch.Tensor | None, meta: SegmentMeta, a: torch.Tensor, bt: torch.Tensor,
                   a_op: torch.Tensor | None) -> torch.Tensor:
    """A projection's packed output with every DoRA slot's columns rescaled, on the Triton kernels
    (``kernels.ops.dora_scale``), the factors from ``triton_factors``. With dropout (``bits``, the layer call's, and
    ``mag.drop_slots``), the DoRA slots with dropout also subtract ``e = W (x - drop(x))`` from their base term: one
    GEMM over those slots' tokens only (PEFT's DoRA takes ``W drop(x)``, a second base GEMM).

    Args:
        mag: the store's magnitudes; path: the layer's; base: its frozen projection.
        x: (T, D_in) the layer input; y: (T, D_out) ``kernels.ops.packed_lora``'s output on it.
        bits: ``kernels.ops.dropout_bits(meta, x)`` (those the packed LoRA applied), or None without dropout.
        meta: the layer call's tables; a: (C, RB, D_in) the slots' A; bt: (C * RB, D_out) their B^T;
        a_op: (C * RB, D_in) A in the kernels' operand dtype, or None.

    Returns:
        (T, D_out), differentiable in y and x.
    """
    weight = base_weight(base)
    ratio, gain = triton_factors(mag, path, weight, a, bt, a_op, meta.seg_flt[:, SEG_FLT_COL.scale])
    res = None
    if bits is not None and mag.drop_slots:
        part = ops.dropped_part(x, bits, meta, mag.drop_sel[:len(mag.drop_slots)], mag.capacity)  # (k * T / C, D_in)
        res = (F.linear(part, weight.to(part.dtype)), mag.drop_pos)
    return ops.dora_scale(y, ratio, gain, getattr(base, "bias", None), mag.m[path].grad, res)
