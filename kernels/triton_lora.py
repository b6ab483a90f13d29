"""The packed multi-slot LoRA of one projection as an autograd Function, on the segmented kernels of
``kernels.triton_segments`` (math, shapes and kernels described there).

This module holds the projection's forward and backward and the ``kernels.ops.packed_lora_eval(..., impl="triton")``
entry.
"""

from __future__ import annotations

import torch

from lora_sweep.kernels import _jit
from lora_sweep.kernels._jit import tl
from lora_sweep.kernels._launch import SegmentMeta, build_meta
from lora_sweep.kernels.meta import LayerRanks, PackLayout
from lora_sweep.kernels.triton_segments import _dot_config, keep_bits, seg_expand_add, seg_shrink, seg_wgrad

__all__ = ["PackedLoRAFunction", "operand_dtype", "packed_lora_triton"]


class PackedLoRAFunction(torch.autograd.Function):
    """``y = base(x) + LoRA(x)`` on flattened tokens.

    The base is either given (``base_out``, differentiated by autograd) or, for a frozen ``nn.Linear``,
    computed here from ``weight`` and ``bias``: the expand kernel writes the LoRA term (plus bias) and cuBLAS
    accumulates ``x W^T`` onto it (``addmm_``, beta = 1, read in the GEMM's epilogue). The base output is then
    never written and re-read, and in the backward ``dx = dy W`` lands on the LoRA part of dx the same way,
    with no separate add of two dx tensors: per projection that saves about four passes over a (T, D) tensor.

    The dropout mask is drawn once, as bits, in the forward (``keep_bits``) and kept for the backward. With
    ``grads`` (a pack's gradient buffers, ``a_cat.grad`` and ``bt_cat.grad``) the weight gradients are
    added into them by the kernel and autograd gets None for a_cat and bt_cat: no zero-filled result per call and
    no AccumulateGrad add of it (the same fp32 sum, so the same bits).
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, base_out: torch.Tensor | None, weight: torch.Tensor | None,
                bias: torch.Tensor | None, a_cat: torch.Tensor, bt_cat: torch.Tensor, meta: SegmentMeta,
                grads: tuple[torch.Tensor, torch.Tensor] | None = None,
                ops: tuple[torch.Tensor, torch.Tensor] | None = None,
                keep: torch.Tensor | None = None) -> torch.Tensor:
        """x: (T, D_in); base_out: (T, D_out) or None; weight: (D_out, D_in) or None; bias: (D_out,) or None;
        a_cat: (R, D_in); bt_cat: (R, D_out); grads: ((R, D_in), (R, D_out)) fp32 or None; ops: a_cat and bt_cat
        already in ``operand_dtype(x.dtype)`` (a pack casts all its weights once per step), or None; keep: the
        call's dropout bits, drawn by the caller (``keep_bits(meta, x)``), or None to draw them here
        -> (T, D_out)."""
        a_w, bt_w = ops or (a_cat, bt_cat)
        if not meta.has_dropout:
            keep = None
        elif keep is None:
            keep = keep_bits(meta, x)  # (T, ceil(D_in / 32)) int32
        h = seg_shrink(x, a_w, meta, dropout=True, keep=keep)  # (T, R_PAD) fp32, scaled by s_g
        bt_op = bt_w if ops else _expand_operand(bt_cat, x.dtype)
        if weight is not None:
            y = _lora_term(h, bt_op, meta, (x.shape[0], weight.shape[0]), x, bias)
            y.addmm_(x, weight.t())
        elif meta.covers_all:  # one pass: read base_out, write y
            y = seg_expand_add(h, bt_op, meta, torch.empty_like(base_out), src=base_out, dropout=False)
        else:  # tokens of rank-0 / uncovered rows keep base_out: copy, then add in place
            y = base_out.clone()
            seg_expand_add(h, bt_op, meta, y, src=y, dropout=False)
        ctx.save_for_backward(x, weight, a_cat, bt_cat, h, keep)
        ctx.meta, ctx.grads, ctx.ops = meta, grads, ops  # ops: views of a buffer that outlives the step
        ctx.warming = _jit.warm_context()
        return y

    @staticmethod
    def backward(ctx, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        # inside precompile, maybe on autograd's device thread: warm up, launch nothing
        return _jit.run_in(ctx.warming, PackedLoRAFunction._backward, ctx, dy)  # type: ignore[return-value]

    @staticmethod
    def _backward(ctx, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight, a_cat, bt_cat, h, keep = ctx.saved_tensors
        meta: SegmentMeta = ctx.meta
        ga, gbt = ctx.grads or (None, None)
        a_w, bt_w = ctx.ops or (_expand_operand(a_cat, x.dtype), bt_cat)
        need_x, need_base, need_w, need_bias, need_a, need_bt = ctx.needs_input_grad[:6]
        dy = dy.contiguous()
        dx = da = dbt = dw = dbias = None
        if need_x or need_a:
            dh = seg_shrink(dy, bt_w, meta, dropout=False)  # (T, R_PAD) = s_g * dy B_g
            if need_x:
                dx = _lora_term(dh, a_w, meta, x.shape, x, None, keep=keep)
                if weight is not None:
                    dx.addmm_(dy, weight)
            if need_a:
                da = seg_wgrad(dh, x, meta, dropout=True, keep=keep, into=ga).to(a_cat.dtype)
        if need_bt:
            dbt = seg_wgrad(h, dy, meta, dropout=False, into=gbt).to(bt_cat.dtype)
        if need_w:  # only for a base that is not frozen; the packer freezes it
            dw = dy.t().mm(x)
        if need_bias:
            dbias = dy.sum(0)
        return dx, dy if need_base else None, dw, dbias, None if ga is not None else da, \
            None if gbt is not None else dbt, None, None, None, None


def operand_dtype(act: torch.dtype) -> torch.dtype:
    """The dtype the shrink and expand dots read packed weights in for activations of dtype ``act``: fp32 (the
    masters themselves) or ``act`` (they are cast to it, in the kernel or once before)."""
    dot_dtype, _ = _dot_config(act, cast_to_act=True)
    return torch.float32 if dot_dtype == tl.float32 else act


def _expand_operand(w: torch.Tensor, act: torch.dtype) -> torch.Tensor:
    """``w`` in the dtype the expand kernel's ``tl.dot`` reads it in: cast once here (a (R, D) tensor) rather
    than in each of its (T / BM) x (D / BN) programs. The same rounding, so the same bits, and a faster expand
    (BENCHMARKS.md, "Kernel tiles, operand dtypes and the fused norms"). The Function saves the fp32 masters, not the
    copy: no memory is kept for the backward, which casts again."""
    dot_dtype, _ = _dot_config(act, cast_to_act=True)
    return w if dot_dtype == tl.float32 or w.dtype == act else w.to(act)


def _lora_term(h: torch.Tensor, w: torch.Tensor, meta: SegmentMeta, shape: tuple[int, int] | torch.Size,
               like: torch.Tensor, bias: torch.Tensor | None, *, keep: torch.Tensor | None = None) -> torch.Tensor:
    """A new (T, N) tensor: ``bias + drop?(h W)`` on active tokens (dropout where ``keep`` bits are given),
    ``bias`` (or 0) elsewhere."""
    dropout = keep is not None
    if meta.covers_all:
        out = torch.empty(shape, dtype=like.dtype, device=like.device)
        return seg_expand_add(h, w, meta, out, src=None, bias=bias, dropout=dropout, keep=keep)
    out = torch.zeros(shape, dtype=like.dtype, device=like.device)
    if bias is not None:
        out += bias
    return seg_expand_add(h, w, meta, out, src=out, dropout=dropout, keep=keep)


def packed_lora_triton(x: torch.Tensor, base_out: torch.Tensor | None, a_cat: torch.Tensor, bt_cat: torch.Tensor,
                       layout: PackLayout, ranks: LayerRanks, *, weight: torch.Tensor | None = None,
                       bias: torch.Tensor | None = None) -> torch.Tensor:
    """``kernels.ops.packed_lora_eval(..., impl="triton")``: same arguments and result as
    ``kernels.reference.lora_loop``.

    Args:
        x: (B, L, D_in) layer input, on CUDA (or CPU under ``TRITON_INTERPRET=1``).
        base_out: (B, L, D_out) frozen base output, or None to compute it here from ``weight``.
        a_cat: (R, D_in) packed A.
        bt_cat: (R, D_out) packed B^T.
        layout: row segments of the batch.
        ranks: this layer's ranks and scales.
        weight: (D_out, D_in) base weight when ``base_out`` is None.
        bias: (D_out,) base bias, or None.

    Returns:
        (B, L, D_out) the base output plus every slot's LoRA term.

    Raises:
        RuntimeError: x is on the CPU and the Triton interpreter is off.
        ValueError: neither or both of ``base_out`` and ``weight`` given.
    """
    _jit.check_device(x, "lora_sweep.kernels.ops.packed_lora_eval")
    if (base_out is None) == (weight is None):
        raise ValueError("give exactly one of base_out and weight")
    b, seq, d_in = x.shape
    d_out = weight.shape[0] if weight is not None else base_out.shape[-1]  # type: ignore[union-attr]
    meta = build_meta(layout, ranks, b * seq, seq, x.device)
    y = PackedLoRAFunction.apply(x.reshape(b * seq, d_in).contiguous(),
                                 None if base_out is None else base_out.reshape(b * seq, d_out).contiguous(),
                                 weight, bias, a_cat.contiguous(), bt_cat.contiguous(), meta)
    return y.view(b, seq, d_out)
