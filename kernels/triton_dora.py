"""DoRA's per-slot column rescale of a packed projection's output: one kernel forward, two backward, and one for
the factors.

A DoRA slot (``packer.variants.magnitude``, PEFT's ``DoraLinearLayer``) rescales each output column of its adapted
weight to a trained magnitude m. On the pack's output ``y = W x + b + s B A x`` (``kernels.triton_lora``), with
``r = m / ||W + s B A||`` per slot and column (the norm detached, DoRA's section 4.3; r = 1 for a plain slot):

    out     = y + (r - 1) * (y - b)                    (= b + r (W + s B A) x)
    dy      = r * dout                                 (into the packed LoRA's backward: dx, dA, dB)
    dm[g]  += (1 / n_g) * sum over slot g's tokens of dout * (y - b)

A DoRA slot with dropout (PEFT's ``DoraLinearLayer`` given ``dropout(x)``: ``W x + b + (r - 1) W drop(x) +
r s B A drop(x)``, where y's LoRA term already saw ``drop(x)``) also subtracts what dropout removed from its base
term, ``e = W (x - drop(x))`` (``resid``, computed by the caller over those slots' tokens only):

    out     = y + (r - 1) * (y - b - e)
    de      = (1 - r) * dout
    dm[g]  += (1 / n_g) * sum over slot g's tokens of dout * (y - b - e)

A plain slot's rows come out bit for bit as y and its dy as dout (r - 1 = 0, r = 1): mixing DoRA slots into a pack
changes nothing for the others. Slot g owns the contiguous tokens ``g * T / C ..`` (the pack's fixed shape).

Grid (C, D / BN, SPLIT): a program holds its slot's (BN,) block of r (and b) in registers and walks the slot's rows
with stride SPLIT * BM. The backward writes one partial column sum per program, (C, SPLIT, D); a second kernel adds
``gain * sum`` of them, in a fixed order, into the magnitudes' gradient buffer (deterministic, no atomics). As with
the LoRA weights' gradients (``PackedLoRAFunction``'s ``grads``), the kernel writes that buffer itself: autograd
never adds into it, so a ``precompile`` pass (launches replaced by warm-ups) leaves it as it was.

The factors (``dora_factors``): r = m / n and ``gain = 1 / n`` for every slot and column of one projection in one
kernel, from ``n^2 = ||W||^2 + 2 s B . (A W^T) + s^2 B (A A^T) B^T`` per column (``kernels.reference.dora_norm``'s
expansion), given the slots' ``A W^T`` (one GEMM over all slots, done by the caller), ``A A^T`` and the cached
``||W||^2``: a few launches per projection instead of the thirty-odd small torch ops of the same formula, which
dominated a DoRA step of a small model.

Cost: one pass over the DoRA projection's output each way (read y, write out; read dout and y, write dy), and y
kept for the backward while the pack holds a DoRA slot; with dropout, e read each way and de written (e and its
GEMM cover only the DoRA slots with dropout).
"""

from __future__ import annotations

import torch

from lora_sweep.kernels import _jit
from lora_sweep.kernels._jit import SUM_COMBINE, tl, triton

__all__ = ["DoraScaleFunction", "dora_scale_triton", "dora_scale_fwd", "dora_scale_bwd", "dora_factors_triton"]

_BM, _BN = 32, 128  # a (32, 128) tile: 8 KB of bf16 per operand
_SPLIT = 8  # programs per slot and column block, at most (fewer for a short slot)


@triton.jit
def _resid(e_ptr, pos_ptr, g, rows, rr, cols, mask, D):
    """(BM, BN) fp32 rows ``rr`` of slot g's block of e (zero for a slot without one)."""
    pos = tl.load(pos_ptr + g) + rr * 0  # (BM,): a vector, as the interpreter takes no scalar in a mask
    ptr = (tl.maximum(pos, 0).to(tl.int64) * rows + rr)[:, None] * D + cols[None, :]
    return tl.load(e_ptr + ptr, mask=mask & (pos >= 0)[:, None], other=0.0).to(tl.float32)


@triton.jit
def _fwd_kernel(
    y_ptr,  # (T, D) the packed projection's output, T = C * rows
    r_ptr,  # (C, D) fp32 per-slot column factor m / n (1 for a plain slot)
    b_ptr,  # (D,) bias, read when HAS_BIAS
    e_ptr,  # (k * rows, D) W (x - drop(x)) of the slots with a block in it, read when HAS_RES
    pos_ptr,  # (C,) int32 the slot's block of e, -1 for none; read when HAS_RES
    out_ptr,  # (T, D) result
    rows,  # tokens per slot, T / C
    D,
    split,
    HAS_BIAS: tl.constexpr,
    HAS_RES: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
):
    g = tl.program_id(0)
    cols = tl.program_id(1) * BN + tl.arange(0, BN)
    part = tl.program_id(2)
    cmask = cols < D
    r = tl.load(r_ptr + g * D + cols, mask=cmask, other=1.0)
    if HAS_BIAS:
        b = tl.load(b_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
    else:
        b = tl.full((BN,), 0.0, tl.float32)
    first = g.to(tl.int64) * rows
    for start in range(part * BM, rows, split * BM):
        rr = start + tl.arange(0, BM)
        mask = (rr < rows)[:, None] & cmask[None, :]
        ptr = (first + rr)[:, None] * D + cols[None, :]
        y = tl.load(y_ptr + ptr, mask=mask, other=0.0).to(tl.float32)
        yb = y - b[None, :]
        if HAS_RES:
            yb -= _resid(e_ptr, pos_ptr, g, rows, rr, cols, mask, D)
        tl.store(out_ptr + ptr, (y + (r - 1.0)[None, :] * yb).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _bwd_kernel(
    dout_ptr,  # (T, D) gradient of out
    y_ptr,  # (T, D) the forward's y
    r_ptr,  # (C, D) fp32
    b_ptr,  # (D,)
    e_ptr,  # (k * rows, D), read when HAS_RES
    pos_ptr,  # (C,) int32, read when HAS_RES
    dy_ptr,  # (T, D) gradient of y
    de_ptr,  # (k * rows, D) gradient of e, written when HAS_RES
    part_ptr,  # (C, split, D) fp32 partial sums of dout * (y - b - e)
    rows,
    D,
    split,
    HAS_BIAS: tl.constexpr,
    HAS_RES: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
):
    g = tl.program_id(0)
    cols = tl.program_id(1) * BN + tl.arange(0, BN)
    part = tl.program_id(2)
    cmask = cols < D
    r = tl.load(r_ptr + g * D + cols, mask=cmask, other=1.0)
    if HAS_BIAS:
        b = tl.load(b_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
    else:
        b = tl.full((BN,), 0.0, tl.float32)
    first = g.to(tl.int64) * rows
    acc = tl.full((BN,), 0.0, tl.float32)
    for start in range(part * BM, rows, split * BM):
        rr = start + tl.arange(0, BM)
        mask = (rr < rows)[:, None] & cmask[None, :]
        ptr = (first + rr)[:, None] * D + cols[None, :]
        dout = tl.load(dout_ptr + ptr, mask=mask, other=0.0).to(tl.float32)
        y = tl.load(y_ptr + ptr, mask=mask, other=0.0).to(tl.float32)
        tl.store(dy_ptr + ptr, (dout * r[None, :]).to(dy_ptr.dtype.element_ty), mask=mask)
        yb = y - b[None, :]
        if HAS_RES:
            yb -= _resid(e_ptr, pos_ptr, g, rows, rr, cols, mask, D)
            pos = tl.load(pos_ptr + g) + rr * 0
            tl.store(de_ptr + (tl.maximum(pos, 0).to(tl.int64) * rows + rr)[:, None] * D + cols[None, :],
                     (dout * (1.0 - r)[None, :]).to(de_ptr.dtype.element_ty), mask=mask & (pos >= 0)[:, None])
        # the builtin reduce with tl.sum's combine (_jit.SUM_COMBINE): tl.sum is itself jit'd
        acc += tl.reduce(dout * yb, 0, SUM_COMBINE)
    tl.store(part_ptr + (g * split + part) * D + cols, acc, mask=cmask)


@triton.jit
def _grad_kernel(
    part_ptr,  # (C, split, D) fp32
    gain_ptr,  # (C, D) fp32: 1 / n for a DoRA slot adapting the layer, 0 for any other
    grad_ptr,  # (C, D) fp32 the magnitudes' gradient, added to
    D,
    split,
    BN: tl.constexpr,
):
    g = tl.program_id(0)
    cols = tl.program_id(1) * BN + tl.arange(0, BN)
    cmask = cols < D
    total = tl.full((BN,), 0.0, tl.float32)
    for k in range(0, split):
        total += tl.load(part_ptr + (g * split + k) * D + cols, mask=cmask, other=0.0)
    gain = tl.load(gain_ptr + g * D + cols, mask=cmask, other=0.0)
    grad = tl.load(grad_ptr + g * D + cols, mask=cmask, other=0.0)
    tl.store(grad_ptr + g * D + cols, grad + gain * total, mask=cmask)


@triton.jit
def _factors_kernel(
    wa_ptr,  # (C * RB, D) fp32 the slots' A W^T (slot g's rows g * RB ..)
    bt_ptr,  # (C * RB, D) fp32 their B^T (rank padding zero)
    aat_ptr,  # (C, RB, RB) fp32 their A A^T
    wsq_ptr,  # (D,) fp32 ||W||^2 per output row of the base weight
    m_ptr,  # (C, D) magnitudes
    on_ptr,  # (C,) 1 for a DoRA slot adapting the layer
    scale_ptr,  # (C,) fp32 the slots' scales
    ratio_ptr,  # (C, D) fp32 out: m / n, 1 elsewhere
    gain_ptr,  # (C, D) fp32 out: 1 / n, 0 elsewhere
    D,
    RB: tl.constexpr,
    BN: tl.constexpr,
):
    g = tl.program_id(0)
    cols = tl.program_id(1) * BN + tl.arange(0, BN)
    cmask = cols < D
    k = tl.arange(0, RB)
    tile = (g * RB + k).to(tl.int64)[:, None] * D + cols[None, :]
    bt = tl.load(bt_ptr + tile, mask=cmask[None, :], other=0.0)  # (RB, BN)
    wa = tl.load(wa_ptr + tile, mask=cmask[None, :], other=0.0)
    aat = tl.load(aat_ptr + g * RB * RB + k[:, None] * RB + k[None, :])  # (RB, RB)
    quad = tl.dot(aat, bt, input_precision="ieee")  # (RB, BN): (A A^T) B^T
    s = tl.load(scale_ptr + g)
    n2 = (tl.load(wsq_ptr + cols, mask=cmask, other=1.0) + 2.0 * s * tl.reduce(bt * wa, 0, SUM_COMBINE)
          + s * s * tl.reduce(bt * quad, 0, SUM_COMBINE))
    n = tl.sqrt(tl.maximum(n2, 0.0))
    dora = tl.load(on_ptr + g) > 0
    m = tl.load(m_ptr + g * D + cols, mask=cmask, other=0.0).to(tl.float32)
    tl.store(ratio_ptr + g * D + cols, tl.where(dora, m / n, 1.0), mask=cmask)
    tl.store(gain_ptr + g * D + cols, tl.where(dora, 1.0 / n, 0.0), mask=cmask)


def dora_factors_triton(wa: torch.Tensor, bt: torch.Tensor, aat: torch.Tensor, wsq: torch.Tensor, m: torch.Tensor,
                        on: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``kernels.ops.dora_factors``: (ratio, gain), (C, D) fp32 each (module docstring).

    Args:
        wa: (C * RB, D) fp32 the slots' A W^T; bt: (C * RB, D) fp32 their B^T; aat: (C, RB, RB) fp32 their A A^T.
        wsq: (D,) fp32 squared row norms of W; m: (C, D) magnitudes; on: (C,) DoRA flags; scale: (C,) scales.
    """
    _jit.check_device(wa, "lora_sweep.kernels.triton_dora")
    capacity, rb = aat.shape[0], aat.shape[1]
    d = wa.shape[1]
    ratio = torch.empty((capacity, d), dtype=torch.float32, device=wa.device)
    gain = torch.empty_like(ratio)
    _jit.launch(_factors_kernel, (capacity, triton.cdiv(d, 64)), wa.contiguous(), bt.contiguous(), aat.contiguous(),
                wsq.float().contiguous(), m.contiguous(), on.float().contiguous(), scale.float().contiguous(), ratio,
                gain, d, RB=rb, BN=64, num_warps=4)
    return ratio, gain


def _split(rows: int) -> int:
    return max(1, min(_SPLIT, triton.cdiv(rows, _BM)))


def dora_scale_fwd(y: torch.Tensor, ratio: torch.Tensor, bias: torch.Tensor | None,
                   res: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """``y + (r - 1) (y - b - e)`` per slot block: y (T, D) contiguous, ratio (C, D) fp32 contiguous, res (e, pos)
    or None (e = 0) -> (T, D)."""
    capacity, d = ratio.shape
    out = torch.empty_like(y)
    rows = y.shape[0] // capacity
    e, pos = res if res is not None else (y, ratio)  # placeholders: unread without HAS_RES
    if y.numel():
        split = _split(rows)
        _jit.launch(_fwd_kernel, (capacity, triton.cdiv(d, _BN), split), y, ratio, bias if bias is not None else y,
                    e, pos, out, rows, d, split, HAS_BIAS=bias is not None, HAS_RES=res is not None, BM=_BM, BN=_BN,
                    num_warps=4)
    return out


def dora_scale_bwd(dout: torch.Tensor, y: torch.Tensor, ratio: torch.Tensor, bias: torch.Tensor | None,
                   gain: torch.Tensor, grad: torch.Tensor, res: tuple[torch.Tensor, torch.Tensor] | None = None,
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(dy (T, D), de (k * rows, D) or None) from dout and the forward's y, ratio, bias and res; adds
    ``gain * sum dout (y - b - e)`` per slot into ``grad`` (C, D) fp32 in place."""
    capacity, d = ratio.shape
    dy = torch.empty_like(y)
    rows = y.shape[0] // capacity
    e, pos = res if res is not None else (y, ratio)
    de = torch.empty_like(e) if res is not None else None
    if y.numel():
        split = _split(rows)
        parts = torch.empty((capacity, split, d), dtype=torch.float32, device=y.device)
        cols = triton.cdiv(d, _BN)
        _jit.launch(_bwd_kernel, (capacity, cols, split), dout, y, ratio, bias if bias is not None else y, e, pos,
                    dy, de if de is not None else dy, parts, rows, d, split, HAS_BIAS=bias is not None,
                    HAS_RES=res is not None, BM=_BM, BN=_BN, num_warps=4)
        _jit.launch(_grad_kernel, (capacity, cols), parts, gain, grad, d, split, BN=_BN, num_warps=4)
    return dy, de


class DoraScaleFunction(torch.autograd.Function):
    """``out = y + (r - 1) (y - b - e)``, differentiable in y and e; the magnitudes' gradient goes into ``grad``
    (module docstring), not to autograd."""

    @staticmethod
    def forward(ctx, y: torch.Tensor, ratio: torch.Tensor, gain: torch.Tensor, bias: torch.Tensor | None,
                grad: torch.Tensor, e: torch.Tensor | None = None, pos: torch.Tensor | None = None) -> torch.Tensor:
        """y: (T, D) contiguous, T a multiple of C; ratio, gain: (C, D) fp32 contiguous, constants of the step;
        bias: (D,) or None; grad: (C, D) fp32, the layer's magnitude gradients; e: (k * rows, D) contiguous
        ``W (x - drop(x))`` of the slots with a block (or None: 0), pos: (C,) int32 each slot's block, -1 for none
        -> (T, D)."""
        ctx.save_for_backward(y, ratio, gain, bias, e, pos)
        ctx.grad = grad  # a view of a buffer that outlives the step
        ctx.warming = _jit.warm_context()
        return dora_scale_fwd(y, ratio, bias, None if e is None else (e, pos))

    @staticmethod
    def backward(ctx, dout: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        y, ratio, gain, bias, e, pos = ctx.saved_tensors
        res = None if e is None else (e, pos)
        dy, de = _jit.run_in(ctx.warming, dora_scale_bwd, dout.contiguous(), y, ratio, bias, gain, ctx.grad, res)
        return dy, None, None, None, None, de, None


def dora_scale_triton(y: torch.Tensor, ratio: torch.Tensor, gain: torch.Tensor, bias: torch.Tensor | None,
                      grad: torch.Tensor, res: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """``kernels.ops.dora_scale``.

    Raises:
        RuntimeError: on the CPU with the Triton interpreter off.
        ValueError: y's tokens do not split into ratio's C slots, or the widths differ.
    """
    _jit.check_device(y, "lora_sweep.kernels.triton_dora")
    capacity, d = ratio.shape
    if y.dim() != 2 or y.shape[1] != d or y.shape[0] % capacity or gain.shape != ratio.shape \
            or grad.shape != ratio.shape:
        raise ValueError(f"dora_scale: y {tuple(y.shape)} must be (C * rows, D) for ratio, gain and grad "
                         f"{tuple(ratio.shape)}, {tuple(gain.shape)}, {tuple(grad.shape)}")
    e, pos = res if res is not None else (None, None)
    if e is not None and (pos is None or e.dim() != 2 or e.shape[1] != d or e.shape[0] % (y.shape[0] // capacity)
                          or pos.shape != (capacity,)):
        raise ValueError(f"dora_scale: e {tuple(e.shape)} must be (k * {y.shape[0] // capacity}, {d}) with a "
                         f"({capacity},) block index")
    return DoraScaleFunction.apply(y.contiguous(), ratio.float().contiguous(), gain.float().contiguous(), bias, grad,
                                   None if e is None else e.contiguous(),
                                   None if pos is None else pos.to(torch.int32).contiguous())
