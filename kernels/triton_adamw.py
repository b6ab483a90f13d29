"""Triton kernels for the pack's optimizer: per-slot sum of squares and a fused clip + AdamW + zero-grad
(or keep-grad: a slot accumulating gradients over micro-batches takes a no-op step and keeps its gradient).

The pack (``packer.model.store``) keeps every adapted layer's weights for all C slots in one fp32 buffer,
layer-major: segment k (one layer's A or B^T) holds C blocks of ``RB * d_k`` values (RB rows of the rank
bucket, d_k features), slot g's block at ``off_k + g * RB * d_k``. Only the first ``rank[g] * d_k`` values of a
block can be non-zero (the rest is rank padding, zero forever: ``packer.model.store``'s docstring), so both kernels
touch only those: their traffic follows the slots' real ranks, not the bucket, and a free slot (rank 0) costs
nothing. Every per-slot number (rank, clip coefficient, decay, betas, bias corrections, step size) is read
from device tensors, so a captured CUDA graph serves any mix of slots. A segment is an A or a B^T (the segment
table's third column): B^T takes its own decay and step size, the slot's learning rate times its LoRA+ ratio
(PEFT's ``create_loraplus_optimizer``: B in a parameter group of ``lr * loraplus_lr_ratio``).

Grid (segment, slot, split): a program walks its block with stride ``split * BLOCK``. The sum of squares writes
one partial per program (``out[g, k, split]``, every entry written), which torch sums in a fixed order:
deterministic, no atomics. The update reproduces ``torch.optim.AdamW``'s foreach arithmetic (torch's
``_multi_tensor_adam`` with decoupled weight decay), with IEEE division and square root.
"""

from __future__ import annotations

import torch

from lora_sweep.kernels import _jit
from lora_sweep.kernels._jit import SUM_COMBINE, tl, triton

__all__ = ["OPT_FIELDS", "segmented_sumsq", "segmented_adamw_"]

OPT_FIELDS = 11
"""Columns of the per-slot optimizer table: decay (1 - lr * wd), 1 - beta1, beta2, 1 - beta2, sqrt of beta2's
bias correction, eps, -lr / beta1's bias correction, max grad norm (inf: no clipping), keep (1: the gradient
stays for the next micro-batch, 0: it is zeroed), then B's decay and step size (columns 0 and 6 at B's learning
rate, LoRA+)."""
_NO: tl.constexpr = tl.constexpr(OPT_FIELDS)
_BLOCK = 1024
_SPLIT = 8


@triton.jit
def _sumsq_kernel(g_ptr, segs_ptr, rank_ptr, out_ptr, RB, n_seg, SPLIT: tl.constexpr, BLOCK: tl.constexpr):
    k = tl.program_id(0)
    s = tl.program_id(1)
    part = tl.program_id(2)
    off = tl.load(segs_ptr + 3 * k)
    d = tl.load(segs_ptr + 3 * k + 1)
    n = tl.load(rank_ptr + s) * d
    base = off + s.to(tl.int64) * RB * d
    acc = tl.full((BLOCK,), 0.0, tl.float32)
    for start in range(part * BLOCK, n, SPLIT * BLOCK):
        idx = start + tl.arange(0, BLOCK)
        x = tl.load(g_ptr + base + idx, mask=idx < n, other=0.0)
        acc += x * x
    # the builtin reduce with tl.sum's combine (_jit.SUM_COMBINE): tl.sum is itself jit'd
    tl.store(out_ptr + (s * n_seg + k) * SPLIT + part, tl.reduce(acc, 0, SUM_COMBINE))


@triton.jit
def _adamw_kernel(p_ptr, g_ptr, m_ptr, v_ptr, segs_ptr, rank_ptr, coef_ptr, opt_ptr, RB, SPLIT: tl.constexpr,
                  BLOCK: tl.constexpr):
    k = tl.program_id(0)
    s = tl.program_id(1)
    part = tl.program_id(2)
    off = tl.load(segs_ptr + 3 * k)
    d = tl.load(segs_ptr + 3 * k + 1)
    is_b = tl.load(segs_ptr + 3 * k + 2)  # 0: an A segment, 1: a B^T segment (its own learning rate)
    n = tl.load(rank_ptr + s) * d
    base = off + s.to(tl.int64) * RB * d
    coef = tl.load(coef_ptr + s)
    decay = tl.load(opt_ptr + s * _NO + is_b * 9)  # column 0, or B's decay at 9
    w1 = tl.load(opt_ptr + s * _NO + 1)
    b2 = tl.load(opt_ptr + s * _NO + 2)
    w2 = tl.load(opt_ptr + s * _NO + 3)
    bc2 = tl.load(opt_ptr + s * _NO + 4)
    eps = tl.load(opt_ptr + s * _NO + 5)
    step = tl.load(opt_ptr + s * _NO + 6 + is_b * 4)  # column 6, or B's step size at 10
    keep = tl.load(opt_ptr + s * _NO + 8)
    for start in range(part * BLOCK, n, SPLIT * BLOCK):
        idx = start + tl.arange(0, BLOCK)
        mask = idx < n
        ptr = base + idx
        g_in = tl.load(g_ptr + ptr, mask=mask, other=0.0)
        g = g_in * coef
        p = tl.load(p_ptr + ptr, mask=mask, other=0.0) * decay
        m = tl.load(m_ptr + ptr, mask=mask, other=0.0)
        m = tl.where(w1 < 0.5, m + w1 * (g - m), g - (g - m) * (1.0 - w1))  # torch.lerp's two branches
        v = tl.load(v_ptr + ptr, mask=mask, other=0.0) * b2 + (g * w2) * g
        denom = tl.div_rn(tl.sqrt_rn(v), bc2) + eps
        p = p + tl.div_rn(m, denom) * step
        tl.store(p_ptr + ptr, p, mask=mask)
        tl.store(m_ptr + ptr, m, mask=mask)
        tl.store(v_ptr + ptr, v, mask=mask)
        tl.store(g_ptr + ptr, tl.where(keep != 0.0, g_in, 0.0), mask=mask)


def segmented_sumsq(grad: torch.Tensor, segs: torch.Tensor, rank: torch.Tensor, rank_bucket: int) -> torch.Tensor:
    """Per-slot sum of squares of ``grad`` over every segment.

    Args:
        grad: (total,) fp32 flat gradients, layer-major (module docstring).
        segs: (S, 3) int64 per segment: offset into ``grad``, feature width d_k, and 1 for a B^T segment (0: A).
        rank: (C,) int64 rank of each slot (0: free).
        rank_bucket: RB, rows per slot in every segment.

    Returns:
        (C,) fp32.
    """
    n_seg, capacity = segs.shape[0], rank.shape[0]
    out = torch.empty((capacity, n_seg, _SPLIT), dtype=torch.float32, device=grad.device)
    _jit.launch(_sumsq_kernel, (n_seg, capacity, _SPLIT), grad, segs, rank, out, rank_bucket, n_seg,
                SPLIT=_SPLIT, BLOCK=_BLOCK)
    return out.view(capacity, -1).sum(dim=1)


def segmented_adamw_(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                     segs: torch.Tensor, rank: torch.Tensor, coef: torch.Tensor, opt: torch.Tensor,
                     rank_bucket: int) -> None:
    """In place, on each slot's live values: one AdamW step of ``param`` on ``grad * coef``, then ``grad = 0``
    (``grad`` unchanged where the slot's ``keep`` column is set: it is accumulating, its row a no-op step).

    Args:
        param, grad, exp_avg, exp_avg_sq: (total,) fp32 flat buffers of one layout (module docstring).
        segs, rank, rank_bucket: as ``segmented_sumsq``.
        coef: (C,) fp32 clip coefficient of each slot.
        opt: (C, OPT_FIELDS) fp32 per-slot table (``OPT_FIELDS``).
    """
    n_seg, capacity = segs.shape[0], rank.shape[0]
    _jit.launch(_adamw_kernel, (n_seg, capacity, _SPLIT), param, grad, exp_avg, exp_avg_sq, segs, rank, coef, opt,
                rank_bucket, SPLIT=_SPLIT, BLOCK=_BLOCK)
