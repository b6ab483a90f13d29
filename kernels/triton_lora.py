"""Triton kernels for packed multi-slot LoRA: segmented shrink, expand-add and weight gradient.

Math, for the tokens t of slot g (rank r_g, scale s_g, dropout p_g with keep mask M, X~ = X * M / (1 - p_g)):

    forward   H'  = s_g * X~ A_g^T                      (T_g, r_g)  fp32, saved
              Y   = base + H' B_g^T                     (T_g, D_out)
    backward  dH  = s_g * dY B_g                        (T_g, r_g)  grad of the unscaled H
              dBt = H'^T dY                             (r_g, D_out)  rows of d(bt_cat)
              dA  = dH^T X~                             (r_g, D_in)   rows of d(a_cat); uses the DROPPED input
              dX  = (dH A_g) * M / (1 - p_g)            (T_g, D_in)   LoRA part; the base GEMM's dX is autograd's

Shape legend: T = B * L tokens (flattened), N slots (S of them active: rank > 0 and rows > 0), R = sum of
ranks (rows of ``a_cat`` / ``bt_cat``, slot g at ``rank_off[g] : rank_off[g] + r_g``), R_PAD = per-token
column count of H (power of 2 >= 16, >= max rank; a runtime ``h_stride`` in the kernels, not a constexpr, so
one compiled variant serves every pack width and every shared-input group), D_in / D_out features, K =
reduced feature dim.

Kernels (kernels.md §4), all driven by host-built tables (``kernels._launch.SegmentMeta``):

- ``_seg_shrink_kernel``: grid (token tiles, rank tiles of BR columns). A rank tile at or past r_g exits at
  once, so a rank-8 slot in a pack with a rank-128 slot costs one BR tile, not R_PAD columns.
- ``_seg_expand_kernel``: grid (token tiles, D tiles); loops over r_g in chunks of 16 (a runtime bound), so
  each slot pays for its own rank only. Reads the addend and writes the result in one pass (in place allowed).
- ``_seg_wgrad_kernel``: grid (token chunks of a segment, D tiles, rank tiles); each program writes its own
  fp32 partial sum, a deterministic torch sum over partial slots follows: no atomics, bit-identical reruns.

Dropout is regenerated in every kernel that needs it, by ``kernels.triton_dropout.keep_scale`` (Philox from
the slot's seed, its own rows and positions, the column and the layer): no mask is stored.

Kernels call Triton builtins only (``tl.full``, not ``tl.zeros``; our ``philox``, not ``tl.philox``): the
``tl`` helpers are themselves ``@triton.jit`` and cannot run in the interpreter when triton was imported
before ``TRITON_INTERPRET=1`` was set, as happens in a test session that imports transformers first.
"""

from __future__ import annotations

import torch

from kernels import _jit
from kernels._jit import INTERPRET, tl, triton
from kernels._launch import SegmentMeta, build_meta, check_2d
from kernels._tables import (
    CH,
    CH_PART,
    CH_SEG,
    CH_TOK0,
    CH_TOK1,
    SF,
    SF_SCALE,
    SI,
    SI_H_COL,
    SI_RANK,
    SI_RANK_OFF,
    SI_TOK_END,
    TI,
    TI_SEG,
    TI_TOK0,
)
from kernels.meta import LayerRanks, PackLayout
from kernels.triton_dropout import keep_scale

__all__ = ["PackedLoRAFunction", "packed_lora_triton", "seg_expand_add", "seg_shrink", "seg_wgrad"]

_EXPAND_BR = 16  # rank chunk of the expand loop: the smallest tl.dot K, so a slot pays for ceil(r_g / 16) chunks
_TL_DTYPE = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


# Int arguments that change within a run (the layer id, the step's padded length, the pack's total rank)
# are not specialized: Triton would compile a variant per value class of each (equal to 1, divisible by
# 16), and a sweep would pay those compiles in its first packs. The tensor sizes K and N stay specialized.
@triton.jit(do_not_specialize=["seq_len", "layer_id"])
def _seg_shrink_kernel(
    inp_ptr,  # (T, K) activations: x (forward) or dy (backward), row-major
    w_ptr,  # (R, K) packed weights: a_cat (forward) or bt_cat (backward), row-major
    out_ptr,  # (T, R_PAD) fp32 result; column h_col[g] + j of token t <-> weight row rank_off[g] + j
    tiles_ptr,  # (n_tiles, TI) int64 tile map (kernels._launch.Tile)
    seg_int_ptr,  # (S, SI) int64 segment table (kernels._launch.SegInt)
    seg_flt_ptr,  # (S, SF) fp32 segment table (kernels._launch.SegFlt)
    K, h_stride, seq_len, layer_id,
    DROPOUT: tl.constexpr, DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr,
    BM: tl.constexpr, BK: tl.constexpr, BR: tl.constexpr,
):
    pid_m = tl.program_id(0)
    seg = tl.load(tiles_ptr + TI * pid_m + TI_SEG)
    rank = tl.load(seg_int_ptr + seg * SI + SI_RANK)
    r_lo = tl.program_id(1) * BR
    if r_lo >= rank:  # rank tile past this slot's rank: nothing to compute, nobody reads these columns
        return
    t0 = tl.load(tiles_ptr + TI * pid_m + TI_TOK0)
    t_end = tl.load(seg_int_ptr + seg * SI + SI_TOK_END)
    rank_off = tl.load(seg_int_ptr + seg * SI + SI_RANK_OFF)
    tok = (t0 + tl.arange(0, BM)).to(tl.int64)
    m_mask = tok < t_end
    offs_r = r_lo + tl.arange(0, BR)
    r_mask = offs_r < rank
    w_rows = (rank_off + offs_r).to(tl.int64)
    acc = tl.full((BM, BR), 0.0, tl.float32)
    for k0 in range(0, K, BK):
        cols = k0 + tl.arange(0, BK)
        k_mask = cols < K
        a = tl.load(inp_ptr + tok[:, None] * K + cols[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        if DROPOUT:
            a = a.to(tl.float32) * keep_scale(seg_int_ptr, seg_flt_ptr, seg, tok, k0, seq_len, K, layer_id, BK)
        w = tl.load(w_ptr + w_rows[:, None] * K + cols[None, :], mask=r_mask[:, None] & k_mask[None, :], other=0.0)
        acc = tl.dot(a.to(DOT_DTYPE), tl.trans(w.to(DOT_DTYPE)), acc, input_precision=PRECISION)
    acc = acc * tl.load(seg_flt_ptr + seg * SF + SF_SCALE)
    h_col = tl.load(seg_int_ptr + seg * SI + SI_H_COL)  # other slices of a shared-input group own the other columns
    tl.store(out_ptr + tok[:, None] * h_stride + (h_col + offs_r)[None, :], acc, mask=m_mask[:, None] & r_mask[None, :])


@triton.jit(do_not_specialize=["seq_len", "layer_id"])
def _seg_expand_kernel(
    h_ptr,  # (T, R_PAD) fp32 per-token rank coefficients from the shrink (h' or dh), slot g's from column h_col[g]
    w_ptr,  # (R, N) packed weights: bt_cat (forward) or a_cat (backward dx), row-major
    src_ptr,  # (T, N) addend (the base output); ignored unless HAS_SRC; may alias dst_ptr
    bias_ptr,  # (N,) added to every row; ignored unless HAS_BIAS
    dst_ptr,  # (T, N) result, written for the active segments' tokens only
    tiles_ptr,  # (n_tiles, TI) int64 tile map (kernels._launch.Tile)
    seg_int_ptr,  # (S, SI) int64 segment table (SegInt)
    seg_flt_ptr,  # (S, SF) fp32 segment table (SegFlt)
    N, h_stride, seq_len, layer_id,
    HAS_SRC: tl.constexpr, HAS_BIAS: tl.constexpr, DROPOUT: tl.constexpr, DOT_DTYPE: tl.constexpr,
    PRECISION: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BR: tl.constexpr,
):
    pid_m = tl.program_id(0)
    seg = tl.load(tiles_ptr + TI * pid_m + TI_SEG)
    t0 = tl.load(tiles_ptr + TI * pid_m + TI_TOK0)
    t_end = tl.load(seg_int_ptr + seg * SI + SI_TOK_END)
    rank = tl.load(seg_int_ptr + seg * SI + SI_RANK)
    rank_off = tl.load(seg_int_ptr + seg * SI + SI_RANK_OFF)
    h_col = tl.load(seg_int_ptr + seg * SI + SI_H_COL)
    tok = (t0 + tl.arange(0, BM)).to(tl.int64)
    m_mask = tok < t_end
    cols = tl.program_id(1) * BN + tl.arange(0, BN)
    n_mask = cols < N
    acc = tl.full((BM, BN), 0.0, tl.float32)
    for k0 in range(0, rank, BR):  # this slot's own rank only: no padding to the pack's largest rank
        kk = k0 + tl.arange(0, BR)
        k_mask = kk < rank
        h = tl.load(h_ptr + tok[:, None] * h_stride + (h_col + kk)[None, :], mask=m_mask[:, None] & k_mask[None, :],
                    other=0.0)
        w_rows = (rank_off + kk).to(tl.int64)
        w = tl.load(w_ptr + w_rows[:, None] * N + cols[None, :], mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        acc = tl.dot(h.to(DOT_DTYPE), w.to(DOT_DTYPE), acc, input_precision=PRECISION)
    if DROPOUT:  # dx epilogue: the same mask the forward shrink drew
        acc = acc * keep_scale(seg_int_ptr, seg_flt_ptr, seg, tok, tl.program_id(1) * BN, seq_len, N, layer_id, BN)
    offs = tok[:, None] * N + cols[None, :]
    mask = m_mask[:, None] & n_mask[None, :]
    if HAS_SRC:
        acc += tl.load(src_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(dst_ptr + offs, acc.to(dst_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["R", "seq_len", "layer_id"])
def _seg_wgrad_kernel(
    p_ptr,  # (T, R_PAD) fp32 per-token rank coefficients: h' (for d bt_cat) or dh (for d a_cat), from h_col[g]
    q_ptr,  # (T, N) activations: dy (for d bt_cat) or x (for d a_cat, dropout re-applied)
    out_ptr,  # (n_partials, R, N) fp32 partial sums, zero-initialised
    chunks_ptr,  # (n_chunks, CH) int64 (kernels._launch.Chunk)
    seg_int_ptr,  # (S, SI) int64 segment table (SegInt)
    seg_flt_ptr,  # (S, SF) fp32 segment table (SegFlt)
    N, R, h_stride, seq_len, layer_id,
    DROPOUT: tl.constexpr, DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr,
    BT: tl.constexpr, BN: tl.constexpr, BR: tl.constexpr,
):
    pid_c = tl.program_id(0)
    seg = tl.load(chunks_ptr + CH * pid_c + CH_SEG)
    rank = tl.load(seg_int_ptr + seg * SI + SI_RANK)
    r_lo = tl.program_id(2) * BR
    if r_lo >= rank:  # rank tile past this slot's rank: its rows do not exist
        return
    t0 = tl.load(chunks_ptr + CH * pid_c + CH_TOK0)
    t1 = tl.load(chunks_ptr + CH * pid_c + CH_TOK1)
    part = tl.load(chunks_ptr + CH * pid_c + CH_PART).to(tl.int64)
    rank_off = tl.load(seg_int_ptr + seg * SI + SI_RANK_OFF)
    h_col = tl.load(seg_int_ptr + seg * SI + SI_H_COL)
    offs_r = r_lo + tl.arange(0, BR)
    r_mask = offs_r < rank
    col0 = tl.program_id(1) * BN
    cols = col0 + tl.arange(0, BN)
    n_mask = cols < N
    acc = tl.full((BR, BN), 0.0, tl.float32)
    for t in range(t0, t1, BT):  # fixed order within the chunk: deterministic
        tok = (t + tl.arange(0, BT)).to(tl.int64)
        t_mask = tok < t1
        p = tl.load(p_ptr + tok[:, None] * h_stride + (h_col + offs_r)[None, :], mask=t_mask[:, None] & r_mask[None, :],
                    other=0.0)
        q = tl.load(q_ptr + tok[:, None] * N + cols[None, :], mask=t_mask[:, None] & n_mask[None, :], other=0.0)
        if DROPOUT:
            q = q.to(tl.float32) * keep_scale(seg_int_ptr, seg_flt_ptr, seg, tok, col0, seq_len, N, layer_id, BN)
        acc = tl.dot(tl.trans(p.to(DOT_DTYPE)), q.to(DOT_DTYPE), acc, input_precision=PRECISION)
    rows = (rank_off + offs_r).to(tl.int64)
    tl.store(out_ptr + part * R * N + rows[:, None] * N + cols[None, :], acc, mask=r_mask[:, None] & n_mask[None, :])


def _dot_config(act: torch.dtype, *, cast_to_act: bool) -> tuple[tl.dtype, str]:
    """Operand dtype and fp32 precision of ``tl.dot``.

    fp32 activations (and the interpreter, whose bf16 ``tl.dot`` is wrong, kernels.md §7) use exact fp32.
    16-bit activations: shrink and expand cast both operands (fp32 master weights, fp32 H) to the activation
    dtype, the rounding PEFT's bf16 path has too; fp32 operands run 2x slower there on an H200 (expand 191 vs
    92 us at T=16384, 4096 -> 4096). The weight gradient keeps H in fp32 and uses tf32.
    """
    if act == torch.float32 or INTERPRET:
        return tl.float32, "ieee"
    return (_TL_DTYPE[act], "tf32") if cast_to_act else (tl.float32, "tf32")


def _launch_config(dropout: bool) -> tuple[int, int]:
    """(tile, pipeline stages) of the two kernels that stream a (T, D) input: the shrink's K tile is twice the
    tile, the weight gradient's token step is the tile.

    Measured on an H200 by ``python -m packer.gpu_kernels`` (T=16384, 8 slots, r=16, bf16; BENCHMARKS.md):
    without dropout (64, 3) is within 1 us of the best tried; with dropout the Philox draws dominate and
    shorter tiles in a deeper pipeline win: shrink 153 vs 162 us (K=4096) and 501 vs 541 us (K=14336), weight
    gradient of A 162 vs 193 us and 481 vs 617 us (old: 1024-token chunks, (64, 3)).
    """
    return (32, 4) if dropout else (64, 3)


def seg_shrink(inp: torch.Tensor, w: torch.Tensor, meta: SegmentMeta, *, dropout: bool,
               block_k: int | None = None, stages: int | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """``out[t, :r_g] = s_g * drop?(inp[t]) @ w[rank_off_g : rank_off_g + r_g]^T`` for active tokens t.

    Args:
        inp: (T, K) activations.
        w: (R, K) packed weights.
        meta: segment tables of this layer call.
        dropout: re-draw each slot's dropout mask on ``inp`` (forward: x; never for dy).
        block_k: reduction tile; default ``_launch_config``'s.
        stages: software-pipeline depth; default ``_launch_config``'s.
        out: (T, R_PAD) fp32 to write into (one slice of a shared-input group writes its own columns), or None
            for a new tensor.

    Returns:
        (T, R_PAD) fp32: slot g's tokens get columns ``h_col_g : h_col_g + r_g``; the rest is left as it was
        (unspecified in a new tensor).
    """
    n_tok, k = inp.shape
    check_2d("inp", inp, n_tok, k)
    check_2d("w", w, meta.total_rank, k)
    if out is None:
        out = torch.empty((n_tok, meta.r_pad), dtype=torch.float32, device=inp.device)
    elif out.dtype != torch.float32:
        raise ValueError(f"out: expected fp32, got {out.dtype}")
    check_2d("out", out, n_tok, meta.r_pad)
    br = min(meta.r_cols, 64)
    if meta.n_tiles:
        dropout = dropout and meta.has_dropout
        tile, default_stages = _launch_config(dropout)
        dot_dtype, precision = _dot_config(inp.dtype, cast_to_act=True)
        _jit.launch(_seg_shrink_kernel, (meta.n_tiles, meta.r_cols // br),
            inp, w, out, meta.tiles, meta.seg_int, meta.seg_flt, k, meta.r_pad, meta.seq_len, meta.layer_id,
            DROPOUT=dropout, DOT_DTYPE=dot_dtype, PRECISION=precision,
            BM=meta.block_m, BK=block_k or 2 * tile, BR=br, num_stages=stages or default_stages)
    return out


def seg_expand_add(h: torch.Tensor, w: torch.Tensor, meta: SegmentMeta, dst: torch.Tensor, *,
                   src: torch.Tensor | None, dropout: bool, bias: torch.Tensor | None = None,
                   block_n: int | None = None) -> torch.Tensor:
    """``dst[t] = src[t] + bias + drop?(h[t, :r_g] @ w[rank_off_g : rank_off_g + r_g])`` for active tokens t.

    Args:
        h: (T, R_PAD) fp32 from ``seg_shrink``.
        w: (R, N) packed weights.
        meta: segment tables of this layer call.
        dst: (T, N) output, written on active tokens only; may be ``src`` (in place).
        src: (T, N) addend, or None to store the LoRA term alone.
        bias: (N,) added to every active row, or None.
        dropout: multiply by each slot's dropout mask (the backward dx epilogue).
        block_n: output-feature tile; default 128, or 64 with dropout (H200: 189 vs 245 us, Philox-bound).

    Returns:
        ``dst``.
    """
    n_tok, n = dst.shape
    check_2d("h", h, n_tok, meta.r_pad)
    check_2d("w", w, meta.total_rank, n)
    check_2d("dst", dst, n_tok, n)
    if src is not None:
        check_2d("src", src, n_tok, n)
    if bias is not None:
        check_2d("bias", bias.view(1, -1), 1, n)
    if meta.n_tiles:
        dropout = dropout and meta.has_dropout
        block_n = block_n or (64 if dropout else 128)
        dot_dtype, precision = _dot_config(dst.dtype, cast_to_act=True)
        _jit.launch(_seg_expand_kernel, (meta.n_tiles, triton.cdiv(n, block_n)),
            h, w, dst if src is None else src, dst if bias is None else bias, dst, meta.tiles, meta.seg_int,
            meta.seg_flt, n, meta.r_pad, meta.seq_len, meta.layer_id, HAS_SRC=src is not None,
            HAS_BIAS=bias is not None, DROPOUT=dropout, DOT_DTYPE=dot_dtype, PRECISION=precision, BM=meta.block_m,
            BN=block_n, BR=_EXPAND_BR)
    return dst


def seg_wgrad(p: torch.Tensor, q: torch.Tensor, meta: SegmentMeta, *, dropout: bool, block_t: int | None = None,
              block_n: int = 128, stages: int | None = None) -> torch.Tensor:
    """``out[rank_off_g : rank_off_g + r_g] = p_g[:, :r_g]^T @ drop?(q_g)`` over each segment's tokens.

    Args:
        p: (T, R_PAD) fp32 per-token rank coefficients.
        q: (T, N) activations.
        meta: segment tables of this layer call.
        dropout: re-draw each slot's dropout mask on ``q`` (x for d a_cat).
        block_t: token step of the reduction; default ``_launch_config``'s.
        stages: software-pipeline depth; default ``_launch_config``'s.
        block_n: feature tile.

    Returns:
        (R, N) fp32; rows of slots without tokens are zero.
    """
    n_tok, n = q.shape
    check_2d("p", p, n_tok, meta.r_pad)
    check_2d("q", q, n_tok, n)
    out = torch.zeros((max(meta.n_partials, 1), meta.total_rank, n), dtype=torch.float32, device=q.device)
    br = min(meta.r_cols, 64)
    if meta.n_chunks:
        dropout = dropout and meta.has_dropout
        tile, default_stages = _launch_config(dropout)
        dot_dtype, precision = _dot_config(q.dtype, cast_to_act=False)
        _jit.launch(_seg_wgrad_kernel, (meta.n_chunks, triton.cdiv(n, block_n), meta.r_cols // br),
            p, q, out, meta.chunks, meta.seg_int, meta.seg_flt, n, meta.total_rank, meta.r_pad, meta.seq_len,
            meta.layer_id,
            DROPOUT=dropout, DOT_DTYPE=dot_dtype, PRECISION=precision,
            BT=block_t or tile, BN=block_n, BR=br, num_stages=stages or default_stages)
    return out[0] if out.shape[0] == 1 else out.sum(dim=0)  # fixed-order reduction: deterministic


class PackedLoRAFunction(torch.autograd.Function):
    """``y = base(x) + LoRA(x)`` on flattened tokens.

    The base is either given (``base_out``, differentiated by autograd) or, for a frozen ``nn.Linear``,
    computed here from ``weight`` and ``bias``: the expand kernel writes the LoRA term (plus bias) and cuBLAS
    accumulates ``x W^T`` onto it (``addmm_``, beta = 1, read in the GEMM's epilogue). The base output is then
    never written and re-read, and in the backward ``dx = dy W`` lands on the LoRA part of dx the same way,
    with no separate add of two dx tensors: per projection that saves about four passes over a (T, D) tensor.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, base_out: torch.Tensor | None, weight: torch.Tensor | None,
                bias: torch.Tensor | None, a_cat: torch.Tensor, bt_cat: torch.Tensor,
                meta: SegmentMeta) -> torch.Tensor:
        """x: (T, D_in); base_out: (T, D_out) or None; weight: (D_out, D_in) or None; bias: (D_out,) or None;
        a_cat: (R, D_in); bt_cat: (R, D_out) -> (T, D_out)."""
        h = seg_shrink(x, a_cat, meta, dropout=True)  # (T, R_PAD) fp32, scaled by s_g
        bt_op = _expand_operand(bt_cat, x.dtype)
        if weight is not None:
            y = _lora_term(h, bt_op, meta, (x.shape[0], weight.shape[0]), x, bias)
            y.addmm_(x, weight.t())
        elif meta.covers_all:  # one pass: read base_out, write y
            y = seg_expand_add(h, bt_op, meta, torch.empty_like(base_out), src=base_out, dropout=False)
        else:  # tokens of rank-0 / uncovered rows keep base_out: copy, then add in place
            y = base_out.clone()
            seg_expand_add(h, bt_op, meta, y, src=y, dropout=False)
        ctx.save_for_backward(x, weight, a_cat, bt_cat, h)
        ctx.meta = meta
        ctx.warming = _jit.warm_context()
        return y

    @staticmethod
    def backward(ctx, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        # inside precompile, maybe on autograd's device thread: warm up, launch nothing
        return _jit.run_in(ctx.warming, PackedLoRAFunction._backward, ctx, dy)  # type: ignore[return-value]

    @staticmethod
    def _backward(ctx, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight, a_cat, bt_cat, h = ctx.saved_tensors
        meta: SegmentMeta = ctx.meta
        need_x, need_base, need_w, need_bias, need_a, need_bt = ctx.needs_input_grad[:6]
        dy = dy.contiguous()
        dx = da = dbt = dw = dbias = None
        if need_x or need_a:
            dh = seg_shrink(dy, bt_cat, meta, dropout=False)  # (T, R_PAD) = s_g * dy B_g
            if need_x:
                dx = _lora_term(dh, _expand_operand(a_cat, x.dtype), meta, x.shape, x, None, dropout=True)
                if weight is not None:
                    dx.addmm_(dy, weight)
            if need_a:
                da = seg_wgrad(dh, x, meta, dropout=True).to(a_cat.dtype)
        if need_bt:
            dbt = seg_wgrad(h, dy, meta, dropout=False).to(bt_cat.dtype)
        if need_w:  # only for a base that is not frozen; the packer freezes it
            dw = dy.t().mm(x)
        if need_bias:
            dbias = dy.sum(0)
        return dx, dy if need_base else None, dw, dbias, da, dbt, None


def _expand_operand(w: torch.Tensor, act: torch.dtype) -> torch.Tensor:
    """``w`` in the dtype the expand kernel's ``tl.dot`` reads it in: cast once here (a (R, D) tensor) rather
    than in each of its (T / BM) x (D / BN) programs. The same rounding, so the same bits; on an H200 the
    expand takes 56 instead of 66 us at T=16384, D=4096 and 178 instead of 216 us at D=14336
    (``python -m packer.gpu_kernels``). The Function saves the fp32 masters, not the copy: no memory is kept
    for the backward, which casts again."""
    dot_dtype, _ = _dot_config(act, cast_to_act=True)
    return w if dot_dtype == tl.float32 or w.dtype == act else w.to(act)


def _lora_term(h: torch.Tensor, w: torch.Tensor, meta: SegmentMeta, shape: tuple[int, int] | torch.Size,
               like: torch.Tensor, bias: torch.Tensor | None, *, dropout: bool = False) -> torch.Tensor:
    """A new (T, N) tensor: ``bias + h W`` on active tokens, ``bias`` (or 0) elsewhere."""
    if meta.covers_all:
        out = torch.empty(shape, dtype=like.dtype, device=like.device)
        return seg_expand_add(h, w, meta, out, src=None, bias=bias, dropout=dropout)
    out = torch.zeros(shape, dtype=like.dtype, device=like.device)
    if bias is not None:
        out += bias
    return seg_expand_add(h, w, meta, out, src=out, dropout=dropout)


def packed_lora_triton(x: torch.Tensor, base_out: torch.Tensor | None, a_cat: torch.Tensor, bt_cat: torch.Tensor,
                       layout: PackLayout, ranks: LayerRanks, *, weight: torch.Tensor | None = None,
                       bias: torch.Tensor | None = None) -> torch.Tensor:
    """``kernels.packed_lora(..., impl="triton")``: same arguments and result as ``kernels.reference.lora_loop``.

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
    _jit.check_device(x, "kernels.packed_lora")
    if (base_out is None) == (weight is None):
        raise ValueError("give exactly one of base_out and weight")
    b, seq, d_in = x.shape
    d_out = weight.shape[0] if weight is not None else base_out.shape[-1]  # type: ignore[union-attr]
    meta = build_meta(layout, ranks, b * seq, seq, x.device)
    y = PackedLoRAFunction.apply(x.reshape(b * seq, d_in).contiguous(),
                                 None if base_out is None else base_out.reshape(b * seq, d_out).contiguous(),
                                 weight, bias, a_cat.contiguous(), bt_cat.contiguous(), meta)
    return y.view(b, seq, d_out)
