"""A static pack's shared-input group (q/k/v, gate/up) as one autograd Function over the static tables.

On the static step (``packer.model.static``) every slot's A and B^T of a projection sit in fixed buffers read through
one
segment table, and the projections of a group read the same x. Run alone, each computes ``x W_s^T`` in a GEMM of
its own (k and v are narrow: 1024 of Llama-3-8B's 4096 columns), writes its own (T, D_in) dx and autograd adds the
S of them. Here, with the members' base weights adjacent rows of one ``w_cat`` (sum D_s, D_in)
(``packer.model.slices.lay_out_groups`` lays them out so):

    forward   y[:, cols_s] = bias_s + LoRA_s(x)          per member s, expand into its columns of one (T, sum D_s) y
              y           += x w_cat^T                   one GEMM for the group (cuBLAS, beta = 1)
    backward  dx  = sum_s drop_s(dh_s A_s) + dy w_cat    the members' LoRA dx into one buffer, then one GEMM
              dA_s, dBt_s                                per member, added into the static gradient buffers

Each member's LoRA term is exactly its solo call's (``kernels.triton_lora.PackedLoRAFunction`` with ``grads``): the
same shrink, expand and weight-gradient launches on the same operands, its own dropout mask drawn from its own
``layer_id`` (PEFT draws one per projection), so its weight gradients are the solo call's bits. Only the sums
change order: ``x w_cat^T`` is one GEMM instead of S (cuBLAS may split K differently for another N) and dx adds the
members' parts in another order; both are fp32-rounding differences of the base path.

The shrink and the weight gradient of A still read x once per member: the members' A rows are not adjacent in the
static buffers and, with dropout, each reads x through its own mask.
"""

from __future__ import annotations

import torch

from lora_sweep.kernels import _jit
from lora_sweep.kernels._launch import GroupSlice
from lora_sweep.kernels.triton_lora import _expand_operand, _lora_term
from lora_sweep.kernels.triton_segments import keep_bits, seg_expand_add, seg_shrink, seg_wgrad

__all__ = ["PackedLoRAGroupFunction", "packed_lora_static_group_triton"]


class PackedLoRAGroupFunction(torch.autograd.Function):
    """``y = x w_cat^T + b_cat + [LoRA_s(x) per member]`` on flattened tokens; the weight gradients go to the
    members' static gradient buffers (autograd gets None for the weights, as ``PackedLoRAFunction`` with ``grads``).

    ``apply(x, w_cat, b_cat, members, *weights)``: ``weights`` = A_s, B^T_s of each member with a ``meta``, in order.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, w_cat: torch.Tensor, b_cat: torch.Tensor | None,
                members: tuple[GroupSlice, ...], *weights: torch.Tensor) -> torch.Tensor:
        """x: (T, D_in); w_cat: (sum D_s, D_in); b_cat: (sum D_s,) or None; per adapted member A (C * RB, D_in) and
        B^T (C * RB, D_s) -> (T, sum D_s)."""
        y = torch.empty((x.shape[0], w_cat.shape[0]), dtype=x.dtype, device=x.device)
        hs, keeps, it = [], [], iter(weights)
        for m in members:
            cols = slice(m.col, m.col + m.width)
            if m.meta is None:  # no slot adapts it: its columns are the base projection alone
                y[:, cols] = 0.0 if b_cat is None else b_cat[cols]
                continue
            a, bt = next(it), next(it)
            a_w, bt_w = m.ops or (a, _expand_operand(bt, x.dtype))
            keep = keep_bits(m.meta, x) if m.meta.has_dropout else None  # (T, ceil(D_in / 32)) int32, its own mask
            h = seg_shrink(x, a_w, m.meta, dropout=True, keep=keep)  # (T, R_PAD) fp32, scaled by s_g
            # static tables cover every token: the expand writes each of the member's columns once
            seg_expand_add(h, bt_w, m.meta, y[:, cols], src=None, bias=None if b_cat is None else b_cat[cols],
                           dropout=False)
            hs.append(h)
            keeps.append(keep)
        y.addmm_(x, w_cat.t())
        ctx.save_for_backward(x, w_cat, *weights, *hs, *keeps)
        ctx.members = members  # grads and ops: views of buffers that outlive the step
        ctx.warming = _jit.warm_context()
        return y

    @staticmethod
    def backward(ctx, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        # inside precompile, maybe on autograd's device thread: warm up, launch nothing
        return _jit.run_in(ctx.warming, PackedLoRAGroupFunction._backward, ctx, dy)  # type: ignore[return-value]

    @staticmethod
    def _backward(ctx, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, w_cat, *rest = ctx.saved_tensors
        adapted = [m for m in ctx.members if m.meta is not None]
        n = len(adapted)
        weights, hs, keeps = rest[:2 * n], rest[2 * n:3 * n], rest[3 * n:]
        dy = dy.contiguous()  # (T, sum D_s); each member reads its columns in place
        dx = None
        for s, m in enumerate(adapted):
            a, bt, h, keep = weights[2 * s], weights[2 * s + 1], hs[s], keeps[s]
            a_w, bt_w = m.ops or (_expand_operand(a, x.dtype), bt)
            dy_s = dy[:, m.col:m.col + m.width]
            dh = seg_shrink(dy_s, bt_w, m.meta, dropout=False)  # (T, R_PAD) = s_g * dy_s B_s
            if ctx.needs_input_grad[0]:
                if dx is None:
                    dx = _lora_term(dh, a_w, m.meta, x.shape, x, None, keep=keep)
                else:  # the next member's LoRA dx lands on the same buffer: no (T, D_in) tensor per member
                    seg_expand_add(dh, a_w, m.meta, dx, src=dx, dropout=keep is not None, keep=keep)
            ga, gbt = m.grads  # type: ignore[misc]
            seg_wgrad(dh, x, m.meta, dropout=True, keep=keep, into=ga)
            seg_wgrad(h, dy_s, m.meta, dropout=False, into=gbt)
        if ctx.needs_input_grad[0]:
            dx = dy.mm(w_cat) if dx is None else dx.addmm_(dy, w_cat)  # one GEMM for every member's dy W_s
        return (dx, None, None, None, *(None for _ in range(2 * n)))


def packed_lora_static_group_triton(x: torch.Tensor, w_cat: torch.Tensor, b_cat: torch.Tensor | None,
                                    members: tuple[GroupSlice, ...], weights: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """``kernels.ops.packed_lora_static_group(..., impl="triton")``: the arguments as there, x flattened to (T, D_in).

    Raises:
        ValueError: a member's tables do not cover every token (not a static pack's), or it has no gradient buffers.
    """
    for m in members:
        if m.meta is not None and (not m.meta.covers_all or m.grads is None):
            raise ValueError("a static group member needs static tables (covering every token) and gradient buffers")
    return PackedLoRAGroupFunction.apply(x, w_cat, b_cat, members, *weights)
