"""Shared-input packed LoRA: the projections that read one input (q/k/v, gate/up) as one autograd Function.

Run one by one, each of S projections that read the same x streams x through its own shrink (forward) and its
own weight gradient of A (backward), writes its own LoRA part of dx, and autograd then adds the S dx tensors.
Here the group is one LoRA on the input side: the slots' A rows are stacked per slot and slice
(``kernels._launch.build_slice_metas``), so

    forward   h   = shrink(x, A_group)                 one pass over x for all slices   (T, R_PAD) fp32
              y_s = h[:, slice s] B_s^T + x W_s^T       per slice (expand, then cuBLAS accumulates)
    backward  dh[:, slice s] = s_g * dy_s B_s           per slice, each into its own columns of one dh
              dx  = dh A_group + sum_s dy_s W_s         one expand, then cuBLAS accumulates every slice
              dA_group = dh^T x                         one pass over x
              dBt_s    = h[:, slice s]^T dy_s           per slice

which removes S - 1 of the S passes over x in each direction, S - 1 (T, D_in) dx writes and autograd's S - 1
adds of them. The math per slice is that of ``kernels.triton_lora.PackedLoRAFunction`` (the same kernels
with column offsets), so a group's slot gradients equal the projections' own.

Dropout is not supported here: PEFT draws an independent mask per projection, and one shrink of x cannot
apply S masks; packs with LoRA dropout run each projection on its own (``packer.slices`` checks).
"""

from __future__ import annotations

import torch

from lora_sweep.kernels import _jit
from lora_sweep.kernels._launch import SegmentMeta, build_slice_metas
from lora_sweep.kernels.meta import LayerRanks, PackLayout
from lora_sweep.kernels.triton_lora import _expand_operand, _lora_term
from lora_sweep.kernels.triton_segments import seg_shrink, seg_wgrad

__all__ = ["PackedLoRASlicesFunction", "packed_lora_slices_triton"]


class PackedLoRASlicesFunction(torch.autograd.Function):
    """``y_s = x W_s^T + b_s + LoRA_s(x)`` for S frozen linears reading the same x, on flattened tokens.

    ``apply(x, a_group, group_meta, slice_metas, *weights, *biases, *bt_cats)``: S of each, in slice order.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, a_group: torch.Tensor, group: SegmentMeta, slices: tuple[SegmentMeta, ...],
                *per_slice: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
        """x: (T, D_in); a_group: (R_group, D_in); per slice s: weight (D_s, D_in), bias (D_s,) or None,
        bt_cat (R_s, D_s) -> S tensors (T, D_s)."""
        n = len(slices)
        weights, biases, bt_cats = per_slice[:n], per_slice[n:2 * n], per_slice[2 * n:]
        h = seg_shrink(x, a_group, group, dropout=False)  # (T, R_PAD) fp32, scaled by s_g; every slice's columns
        ys = []
        for meta, w, b, bt in zip(slices, weights, biases, bt_cats, strict=True):
            y = _lora_term(h, _expand_operand(bt, x.dtype), meta, (x.shape[0], w.shape[0]), x, b)
            ys.append(y.addmm_(x, w.t()))
        ctx.save_for_backward(x, a_group, h, *weights, *bt_cats)
        ctx.metas = (group, slices)
        ctx.warming = _jit.warm_context()
        ctx.set_materialize_grads(False)  # an output nobody used has no gradient: its slice adds nothing
        return tuple(ys)

    @staticmethod
    def backward(ctx, *dys: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        # inside precompile, maybe on autograd's device thread: warm up, launch nothing
        return _jit.run_in(ctx.warming, PackedLoRASlicesFunction._backward, ctx, *dys)  # type: ignore[return-value]

    @staticmethod
    def _backward(ctx, *dys: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        group, slices = ctx.metas
        n = len(slices)
        x, a_group, h, *rest = ctx.saved_tensors
        weights, bt_cats = rest[:n], rest[n:]
        need = ctx.needs_input_grad
        need_x, need_a = need[0], need[1]
        need_w, need_b, need_bt = need[4:4 + n], need[4 + n:4 + 2 * n], need[4 + 2 * n:]
        dys = tuple(None if d is None else d.contiguous() for d in dys)
        dx = da = None
        if (need_x or need_a) and any(d is not None for d in dys):
            # a slice without a gradient leaves its columns unwritten: they must read as zero
            dh = (torch.empty if all(d is not None for d in dys) else torch.zeros)(
                (x.shape[0], group.r_pad), dtype=torch.float32, device=x.device)
            for meta, bt, dy in zip(slices, bt_cats, dys, strict=True):
                if dy is not None:
                    seg_shrink(dy, bt, meta, dropout=False, out=dh)  # its columns: s_g * dy_s B_s
            if need_x:
                dx = _lora_term(dh, _expand_operand(a_group, x.dtype), group, x.shape, x, None)
                for w, dy in zip(weights, dys, strict=True):
                    if dy is not None:
                        dx.addmm_(dy, w)
            if need_a:
                da = seg_wgrad(dh, x, group, dropout=False).to(a_group.dtype)
        dbts = [seg_wgrad(h, dy, meta, dropout=False).to(bt.dtype) if want and dy is not None else None
                for meta, bt, dy, want in zip(slices, bt_cats, dys, need_bt, strict=True)]
        dws = [dy.t().mm(x) if want and dy is not None else None for dy, want in zip(dys, need_w, strict=True)]
        dbs = [dy.sum(0) if want and dy is not None else None for dy, want in zip(dys, need_b, strict=True)]
        return (dx, da, None, None, *dws, *dbs, *dbts)


def packed_lora_slices_triton(x: torch.Tensor, weights: tuple[torch.Tensor, ...],
                              biases: tuple[torch.Tensor | None, ...], a_group: torch.Tensor,
                              bt_cats: tuple[torch.Tensor, ...], layout: PackLayout,
                              slices: tuple[LayerRanks, ...]) -> tuple[torch.Tensor, ...]:
    """``kernels.packed_lora_linear_slices(..., impl="triton")``.

    Args:
        x: (B, L, D_in) the slices' shared input, on CUDA (or CPU under ``TRITON_INTERPRET=1``).
        weights: per slice, (D_s, D_in) frozen base weight.
        biases: per slice, (D_s,) or None.
        a_group: (R_group, D_in) every slot's A rows, per slot then per slice (``kernels.meta.group_rows``).
        bt_cats: per slice, (R_s, D_s) packed B^T.
        layout: row segments of the batch; no active slot may have dropout.
        slices: per slice, its ranks, scales and layer id.

    Returns:
        S tensors (B, L, D_s).

    Raises:
        ValueError: an adapted slot has dropout, or the slices disagree on a slot's scale.
        RuntimeError: x is on the CPU and the Triton interpreter is off.
    """
    _jit.check_device(x, "lora_sweep.kernels.packed_lora_linear_slices")
    b, seq, d_in = x.shape
    group, metas = build_slice_metas(layout, slices, b * seq, seq, x.device)
    if group.has_dropout:
        raise ValueError("dropout: a shared-input call draws no per-slice masks; run each projection on its own")
    ys = PackedLoRASlicesFunction.apply(x.reshape(b * seq, d_in).contiguous(), a_group.contiguous(), group, metas,
                                        *weights, *biases, *(bt.contiguous() for bt in bt_cats))
    return tuple(y.view(b, seq, -1) for y in ys)
