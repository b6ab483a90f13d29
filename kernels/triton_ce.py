"""Fused linear cross-entropy of a fixed-shape batch for a frozen output head: no fp32 logits, the input gradient in the
forward (Liger's fused linear cross-entropy, ``src/liger_kernel/ops/fused_linear_cross_entropy.py``, with per-slot
means and fixed shapes).

Math, for token row t of slot g = t // (T / C) with hidden state h_t, head W (V, H), bias b, target y_t:

    z_t    = h_t W^T + b                                   (V,), cuBLAS, in the model's dtype
    lse_t  = log sum_v exp(z_tv)                           fp32, online over blocks of V (one read of z_t)
    nll_t  = lse_t - z_t[y_t]                              0 where y_t = IGNORE_INDEX
    n_g    = #{t in g : y_t != IGNORE_INDEX},   loss_g = sum_{t in g} nll_t / max(n_g, 1)
    dz_t   = (softmax(z_t) - onehot(y_t)) / max(n_g, 1)    0 for an ignored row; written over z_t, in z's dtype
    dh_t   = dz_t W                                        (H,), the forward's second GEMM, kept for the backward
    backward: dL/dh_t = dh_t * dL/dloss_g                  fp32 product, rounded once to h's dtype

The head is frozen, so the gradient of every loss with respect to the hidden states is known as soon as the
logits are: the kernel turns the logits into their gradient in place, one GEMM maps it to (T, H), and the logits
die in the forward. The plain path instead keeps bf16 logits, an fp32 copy, and fp32 log-softmax forward and
backward tensors (1.2 GB each at 6,144 tokens x 49,152 vocabulary), over which torch runs several passes.

Shapes are fixed (C slots of T / C rows each, the layout of ``packer.model.store``), and nothing reads a value on the
host: the step that calls it can be captured as a CUDA graph. Shape legend: T token rows, H hidden features,
V vocabulary, C slots (groups of T / C consecutive rows), BV vocabulary columns per block. The kernel calls
Triton builtins only (``tl.reduce`` with Triton's own combines, ``_jit.SUM_COMBINE`` and ``MAX_COMBINE``,
``tl.exp``): see ``kernels.triton_segments``' docstring on the interpreter.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lora_sweep.kernels import _jit
from lora_sweep.kernels._jit import MAX_COMBINE, SUM_COMBINE, tl, triton

__all__ = ["IGNORE_INDEX", "LinearCE", "cross_entropy_rows", "linear_ce_triton"]

IGNORE_INDEX = -100
"""Target of a row without loss (torch's ``F.cross_entropy`` default, ``packer.data.batch.IGNORE_INDEX``)."""
_MAX_BLOCK = 4096  # vocabulary columns per block: 8 KB of bf16 logits per program and pass


@triton.jit(do_not_specialize=["n_rows", "rows_per_group"])
def _ce_rows_kernel(
    z_ptr,  # (T, V) logits, row-major; overwritten by their gradient when WRITE_GRAD
    y_ptr,  # (T,) int64 targets, IGNORE_INDEX for rows without loss
    scale_ptr,  # (T / rows_per_group,) fp32 factor of each group's gradient rows (1 / max(n_g, 1))
    nll_ptr,  # (T,) fp32 negative log-likelihood, 0 for an ignored row
    n_rows, V, rows_per_group, stride_z,
    IGNORE: tl.constexpr, WRITE_GRAD: tl.constexpr, BV: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    z_row = z_ptr + row * stride_z
    y = tl.load(y_ptr + row)
    ignored = y == IGNORE
    cols = tl.arange(0, BV)
    # pass 1: online logsumexp (running max m, sum d of exp(z - m)), fp32 whatever z's dtype
    m = float("-inf")
    d = 0.0
    for start in range(0, V, BV):
        z = tl.load(z_row + start + cols, mask=start + cols < V, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.reduce(z, 0, MAX_COMBINE))
        d = d * tl.exp(m - m_new) + tl.reduce(tl.exp(z - m_new), 0, SUM_COMBINE)
        m = m_new
    lse = m + tl.log(d)
    z_y = tl.load(z_row + tl.where(ignored, 0, y)).to(tl.float32)  # read before pass 2 overwrites it
    tl.store(nll_ptr + row, tl.where(ignored, 0.0, lse - z_y))
    if WRITE_GRAD:
        scale = tl.where(ignored, 0.0, tl.load(scale_ptr + row // rows_per_group))
        for start in range(0, V, BV):
            mask = start + cols < V
            z = tl.load(z_row + start + cols, mask=mask, other=0.0).to(tl.float32)
            p = tl.exp(z - lse)
            p = tl.where(start + cols == y, p - 1.0, p)  # never true for an ignored row (y < 0)
            tl.store(z_row + start + cols, (p * scale).to(z_ptr.dtype.element_ty), mask=mask)


def cross_entropy_rows(logits: torch.Tensor, targets: torch.Tensor, scale: torch.Tensor | None = None,
                       rows_per_group: int = 1, *, block: int | None = None) -> torch.Tensor:
    """Per-row NLL of ``logits``; with ``scale``, the logits are overwritten by their scaled gradient.

    Args:
        logits: (T, V) fp32 / bf16 / fp16, rows contiguous (stride 1 along V).
        targets: (T,) int64, ``IGNORE_INDEX`` where a row has no loss.
        scale: (T / rows_per_group,) fp32: row t's gradient is ``(softmax - onehot) * scale[t // rows_per_group]``
            (0 for an ignored row), written over row t in the logits' dtype; None: the logits are only read.
        rows_per_group: consecutive rows sharing one ``scale`` entry.
        block: vocabulary columns per block (None: up to 4,096; tests pass a small one to cross blocks).

    Returns:
        (T,) fp32 NLL, 0 for ignored rows.

    Raises:
        ValueError: shapes, dtypes or strides the kernel does not take.
    """
    if logits.dim() != 2 or logits.stride(1) != 1 or targets.shape != (logits.shape[0],):
        raise ValueError(f"cross_entropy_rows: logits (T, V) with unit column stride and targets (T,), got "
                         f"{tuple(logits.shape)} stride {logits.stride()} and {tuple(targets.shape)}")
    if targets.dtype != torch.int64 or not logits.is_floating_point():
        raise ValueError(f"cross_entropy_rows: float logits and int64 targets, got {logits.dtype}, {targets.dtype}")
    n_rows, vocab = logits.shape
    if scale is not None and (scale.dtype != torch.float32 or n_rows % rows_per_group
                              or scale.shape != (n_rows // rows_per_group,)):
        raise ValueError(f"cross_entropy_rows: scale must be fp32 ({n_rows} / {rows_per_group},), got "
                         f"{tuple(scale.shape)} {scale.dtype}")
    bv = block or min(_MAX_BLOCK, triton.next_power_of_2(vocab))
    nll = torch.empty(n_rows, dtype=torch.float32, device=logits.device)
    if n_rows:
        _jit.launch(_ce_rows_kernel, (n_rows,), logits, targets.contiguous(), nll if scale is None else scale, nll,
                    n_rows, vocab, rows_per_group, logits.stride(0), IGNORE=IGNORE_INDEX,
                    WRITE_GRAD=scale is not None, BV=bv, num_warps=8 if bv >= 2048 else 4)
    return nll


def _losses(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor,
            capacity: int, write_grad: bool, chunk: int | None = None
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(C,) losses, (C,) counts and, with ``write_grad``, dh (T, H) in the logits' dtype (module docstring).

    ``chunk``: the logits of at most this many rows exist at a time (fixed row ranges: a fixed shape, capturable);
    None: all T rows' at once."""
    n_rows = hidden.shape[0]
    counts = (targets != IGNORE_INDEX).view(capacity, -1).sum(dim=1).float()  # (C,)
    denom = counts.clamp(min=1.0)
    if chunk is None or chunk >= n_rows:
        logits = F.linear(hidden, weight, bias)  # (T, V), the model's dtype
        nll = cross_entropy_rows(logits, targets, 1.0 / denom if write_grad else None, n_rows // capacity)  # (T,)
        dh = torch.mm(logits, weight) if write_grad else None  # (T, H): logits now hold their gradient
        return nll.view(capacity, -1).sum(dim=1) / denom, counts, dh
    # per row: its slot's 1 / n_g, so that a chunk may start and end inside a slot's rows
    scale = (1.0 / denom).repeat_interleave(n_rows // capacity) if write_grad else None  # (T,)
    nll = torch.empty(n_rows, dtype=torch.float32, device=hidden.device)
    dh = torch.empty_like(hidden, dtype=hidden.dtype) if write_grad else None
    for i in range(0, n_rows, chunk):
        logits = F.linear(hidden[i:i + chunk], weight, bias)  # (chunk, V)
        nll[i:i + chunk] = cross_entropy_rows(logits, targets[i:i + chunk],
                                              None if scale is None else scale[i:i + chunk], 1)
        if dh is not None:
            torch.mm(logits, weight, out=dh[i:i + chunk])
        del logits  # freed before the next chunk's: one chunk of logits at a time
    return nll.view(capacity, -1).sum(dim=1) / denom, counts, dh


class LinearCE(torch.autograd.Function):
    """Per-slot mean cross-entropy of ``F.linear(hidden, weight, bias)``, the head frozen (module docstring).

    forward(hidden (T, H), weight (V, H), bias (V,) | None, targets (T,) shifted, capacity C, chunk rows | None) ->
    losses (C,) fp32, counts (C,) fp32 (not differentiable). Differentiable in ``hidden`` only.
    """

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor,
                capacity: int, chunk: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        losses, counts, dh = _losses(hidden, weight, bias, targets, capacity, ctx.needs_input_grad[0], chunk)
        ctx.mark_non_differentiable(counts)
        ctx.save_for_backward(dh)
        ctx.capacity, ctx.dtype = capacity, hidden.dtype
        return losses, counts

    @staticmethod
    def backward(ctx, grad_losses: torch.Tensor, _grad_counts: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        (dh,) = ctx.saved_tensors
        if dh is None:
            return None, None, None, None, None, None
        n_rows, h = dh.shape
        g = grad_losses.float()[:, None, None]  # (C, 1, 1): every row of slot g gets dloss_g's factor
        dx = (dh.view(ctx.capacity, -1, h).float() * g).to(ctx.dtype).view(n_rows, h)
        return dx, None, None, None, None, None


def linear_ce_triton(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                            targets: torch.Tensor, capacity: int, chunk: int | None = None
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """``kernels.ops.linear_ce(..., impl="triton")``: the autograd Function when ``hidden`` needs a gradient,
    else the forward alone (no gradient write, no second GEMM). ``chunk``: logits of at most that many rows at a
    time (the same losses and gradients; the bf16 logits' memory bounded by ``chunk`` x V).

    Raises:
        RuntimeError: on the CPU with the Triton interpreter off.
        ValueError: T is not a multiple of ``capacity``, shapes disagree, or the head requires a gradient.
    """
    _jit.check_device(hidden, "lora_sweep.kernels.triton_ce")
    if weight.requires_grad or (bias is not None and bias.requires_grad):
        raise ValueError("linear_ce: the head must be frozen (its weight gradient is not computed)")
    n_rows = hidden.shape[0]
    if hidden.dim() != 2 or weight.dim() != 2 or weight.shape[1] != hidden.shape[1] or capacity < 1 \
            or n_rows % capacity or targets.shape != (n_rows,):
        raise ValueError(f"linear_ce: hidden (T, H), weight (V, H), targets (T,), T a multiple of capacity; "
                         f"got {tuple(hidden.shape)}, {tuple(weight.shape)}, {tuple(targets.shape)}, {capacity}")
    hidden = hidden.contiguous()
    if torch.is_grad_enabled() and hidden.requires_grad:
        return LinearCE.apply(hidden, weight, bias, targets, capacity, chunk)
    losses, counts, _ = _losses(hidden, weight, bias, targets, capacity, write_grad=False, chunk=chunk)
    return losses, counts
