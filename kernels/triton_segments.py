"""Triton kernels for packed multi-slot LoRA: segmented shrink, expand-add and weight gradient, and their launchers.

The autograd Function built on them: ``kernels.triton_lora`` (one projection).

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
one compiled variant serves every pack width), D_in / D_out features, K =
reduced feature dim.

Kernels, all driven by host-built tables (``kernels._launch.SegmentMeta``):

- ``_seg_shrink_kernel``: grid (token tiles, rank tiles of BR columns). A rank tile at or past r_g exits at
  once, so a rank-8 slot in a pack with a rank-128 slot costs one BR tile, not R_PAD columns.
- ``_seg_expand_kernel``: grid (token tiles, D tiles); loops over r_g in chunks of 16 (a runtime bound), so
  each slot pays for its own rank only. Reads the addend and writes the result in one pass (in place allowed).
- ``_seg_wgrad_kernel``: grid (token chunks of a segment, D tiles, rank tiles); each program writes its own
  fp32 partial sum, a deterministic torch sum over partial slots follows: no atomics, bit-identical reruns. Given
  a gradient buffer (a pack's) and one partial per segment, it adds into the buffer as it stores.

Dropout: each layer call draws its keep mask once, as bits (``kernels.triton_dropout.keep_bits``: Philox from
the slot's seed, its own rows and positions, the column and the layer), which the shrink, the dx epilogue and
the weight gradient of A read (``bits_scale``); the Function keeps them for its backward.

Kernels call Triton builtins only (``tl.full``, not ``tl.zeros``; our ``philox``, not ``tl.philox``): the
``tl`` helpers are themselves ``@triton.jit`` and cannot run in the interpreter when triton was imported
before ``TRITON_INTERPRET=1`` was set, as happens in a test session that imports transformers first.
"""

from __future__ import annotations

import torch

from lora_sweep.kernels import _jit
from lora_sweep.kernels._jit import INTERPRET, tl, triton
from lora_sweep.kernels._launch import SegmentMeta, check_2d
from lora_sweep.kernels._tables import (
    CH,
    CH_PART,
    CH_SEG,
    CH_TOK0,
    CH_TOK1,
    SF,
    SF_SCALE,
    SI,
    SI_RANK,
    SI_RANK_OFF,
    SI_TOK_END,
    TI,
    TI_SEG,
    TI_TOK0,
)
from lora_sweep.kernels.triton_dropout import bits_scale, keep_bits

__all__ = ["seg_expand_add", "seg_shrink", "seg_wgrad"]

_EXPAND_BR = 16  # rank chunk of the expand loop: the smallest tl.dot K, so a slot pays for ceil(r_g / 16) chunks
WGRAD_BLOCK_N = 128
"""Feature tile of the weight gradient. Its grid is (chunks, D / BN, rank tiles), only 32-200 programs for a small
pack (16 segments of 384 tokens, one chunk each, D = 192..1536), yet a narrower tile does not pay: 64 is slower
in the SmolLM2-shaped 16 x 8 x 48 pack (BENCHMARKS.md, "Kernel tiles, operand dtypes and the fused norms")."""
_TL_DTYPE = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


# Int arguments that change within a run (the pack's total rank; the layer id and padded length of the keep-bits
# kernel) are not specialized: Triton would compile a variant per value class of each (equal to 1, divisible by
# 16), and a sweep would pay those compiles in its first packs. The tensor sizes K and N stay specialized.
@triton.jit
def _seg_shrink_kernel(
    inp_ptr,  # (T, K) activations: x (forward) or dy (backward), row-major
    w_ptr,  # (R, K) packed weights: a_cat (forward) or bt_cat (backward), row-major
    out_ptr,  # (T, R_PAD) fp32 result; column j of token t <-> weight row rank_off[g] + j
    keep_ptr,  # (T, ceil(K / 32)) int32 dropout keep bits (kernels.triton_dropout.keep_bits); unread unless DROPOUT
    tiles_ptr,  # (n_tiles, TI) int64 tile map (kernels._launch.Tile)
    seg_int_ptr,  # (S, SI) int64 segment table (kernels._launch.SegInt)
    seg_flt_ptr,  # (S, SF) fp32 segment table (kernels._launch.SegFlt)
    K, h_stride,
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
            a = a.to(tl.float32) * bits_scale(keep_ptr, seg_flt_ptr, seg, tok, m_mask, k0, (K + 31) // 32, BK)
        w = tl.load(w_ptr + w_rows[:, None] * K + cols[None, :], mask=r_mask[:, None] & k_mask[None, :], other=0.0)
        acc = tl.dot(a.to(DOT_DTYPE), tl.trans(w.to(DOT_DTYPE)), acc, input_precision=PRECISION)
    acc = acc * tl.load(seg_flt_ptr + seg * SF + SF_SCALE)
    tl.store(out_ptr + tok[:, None] * h_stride + offs_r[None, :], acc, mask=m_mask[:, None] & r_mask[None, :])


@triton.jit
def _seg_expand_kernel(
    h_ptr,  # (T, R_PAD) fp32 per-token rank coefficients from the shrink (h' or dh)
    w_ptr,  # (R, N) packed weights: bt_cat (forward) or a_cat (backward dx), row-major
    src_ptr,  # (T, N) addend (the base output); ignored unless HAS_SRC; may alias dst_ptr
    bias_ptr,  # (N,) added to every row; ignored unless HAS_BIAS
    dst_ptr,  # (T, N) result, written for the active segments' tokens only
    keep_ptr,  # (T, ceil(N / 32)) int32 dropout keep bits of the layer input; unread unless DROPOUT
    tiles_ptr,  # (n_tiles, TI) int64 tile map (kernels._launch.Tile)
    seg_int_ptr,  # (S, SI) int64 segment table (SegInt)
    seg_flt_ptr,  # (S, SF) fp32 segment table (SegFlt)
    N, h_stride,
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
    tok = (t0 + tl.arange(0, BM)).to(tl.int64)
    m_mask = tok < t_end
    cols = tl.program_id(1) * BN + tl.arange(0, BN)
    n_mask = cols < N
    acc = tl.full((BM, BN), 0.0, tl.float32)
    for k0 in range(0, rank, BR):  # this slot's own rank only: no padding to the pack's largest rank
        kk = k0 + tl.arange(0, BR)
        k_mask = kk < rank
        h = tl.load(h_ptr + tok[:, None] * h_stride + kk[None, :], mask=m_mask[:, None] & k_mask[None, :],
                    other=0.0)
        w_rows = (rank_off + kk).to(tl.int64)
        w = tl.load(w_ptr + w_rows[:, None] * N + cols[None, :], mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        acc = tl.dot(h.to(DOT_DTYPE), w.to(DOT_DTYPE), acc, input_precision=PRECISION)
    if DROPOUT:  # dx epilogue: the same mask the forward shrink drew
        acc = acc * bits_scale(keep_ptr, seg_flt_ptr, seg, tok, m_mask, tl.program_id(1) * BN, (N + 31) // 32, BN)
    offs = tok[:, None] * N + cols[None, :]
    mask = m_mask[:, None] & n_mask[None, :]
    if HAS_SRC:
        acc += tl.load(src_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(dst_ptr + offs, acc.to(dst_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["R"])
def _seg_wgrad_kernel(
    p_ptr,  # (T, R_PAD) fp32 per-token rank coefficients: h' (for d bt_cat) or dh (for d a_cat)
    q_ptr,  # (T, N) activations: dy (for d bt_cat) or x (for d a_cat, dropout re-applied)
    out_ptr,  # (n_partials, R, N) fp32 partial sums, zero-initialised; ACCUMULATE: (R, N) fp32, added to
    keep_ptr,  # (T, ceil(N / 32)) int32 dropout keep bits of x; unread unless DROPOUT
    chunks_ptr,  # (n_chunks, CH) int64 (kernels._launch.Chunk)
    seg_int_ptr,  # (S, SI) int64 segment table (SegInt)
    seg_flt_ptr,  # (S, SF) fp32 segment table (SegFlt)
    N, R, h_stride,
    DROPOUT: tl.constexpr, ACCUMULATE: tl.constexpr, DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr,
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
    offs_r = r_lo + tl.arange(0, BR)
    r_mask = offs_r < rank
    col0 = tl.program_id(1) * BN
    cols = col0 + tl.arange(0, BN)
    n_mask = cols < N
    acc = tl.full((BR, BN), 0.0, tl.float32)
    for t in range(t0, t1, BT):  # fixed order within the chunk: deterministic
        tok = (t + tl.arange(0, BT)).to(tl.int64)
        t_mask = tok < t1
        p = tl.load(p_ptr + tok[:, None] * h_stride + offs_r[None, :], mask=t_mask[:, None] & r_mask[None, :],
                    other=0.0)
        q = tl.load(q_ptr + tok[:, None] * N + cols[None, :], mask=t_mask[:, None] & n_mask[None, :], other=0.0)
        if DROPOUT:
            q = q.to(tl.float32) * bits_scale(keep_ptr, seg_flt_ptr, seg, tok, t_mask, col0, (N + 31) // 32, BN)
        acc = tl.dot(tl.trans(p.to(DOT_DTYPE)), q.to(DOT_DTYPE), acc, input_precision=PRECISION)
    rows = (rank_off + offs_r).to(tl.int64)
    ptrs = out_ptr + part * R * N + rows[:, None] * N + cols[None, :]
    mask = r_mask[:, None] & n_mask[None, :]
    if ACCUMULATE:  # straight into the gradient (one partial): grad + acc, the add AccumulateGrad would make
        acc = tl.load(ptrs, mask=mask, other=0.0) + acc
    tl.store(ptrs, acc, mask=mask)


def _dot_config(act: torch.dtype, *, cast_to_act: bool) -> tuple[tl.dtype, str]:
    """Operand dtype and fp32 precision of ``tl.dot``.

    fp32 activations (and the interpreter, whose bf16 ``tl.dot`` is wrong) use exact fp32. 16-bit activations: shrink
    and expand cast both operands (fp32 master weights, fp32 H) to the activation dtype, the rounding PEFT's bf16 path
    has too; fp32 operands run about 2x slower there (BENCHMARKS.md, "Kernel tiles, operand dtypes and the fused
    norms"). The weight gradient keeps H in fp32 and uses tf32.
    """
    if act == torch.float32 or INTERPRET:
        return tl.float32, "ieee"
    return (_TL_DTYPE[act], "tf32") if cast_to_act else (tl.float32, "tf32")


def _launch_config(dropout: bool) -> tuple[int, int]:
    """(tile, pipeline stages) of the two kernels that stream a (T, D) input: the shrink's K tile is twice the
    tile, the weight gradient's token step is the tile.

    Measured by ``python -m lora_sweep.benchmarks.gpu_kernels`` (BENCHMARKS.md, "Kernel tiles, operand dtypes and the
    fused norms"): without dropout (64, 3) is within a microsecond of the best tried. With dropout the kernels drew
    their masks then, and the Philox rounds made (32, 4) win; they read the mask's bits now (one int32 per 32 columns),
    so dropout takes the same tiles (``dropout`` stays an argument for the benchmark that sweeps them).
    """
    return (64, 3)


def seg_shrink(inp: torch.Tensor, w: torch.Tensor, meta: SegmentMeta, *, dropout: bool,
               keep: torch.Tensor | None = None, block_k: int | None = None, stages: int | None = None) -> torch.Tensor:
    """``h[t, :r_g] = s_g * drop?(inp[t]) @ w[rank_off_g : rank_off_g + r_g]^T`` for active tokens t.

    Args:
        inp: (T, K) activations.
        w: (R, K) packed weights.
        meta: segment tables of this layer call.
        dropout: apply each slot's dropout mask to ``inp`` (forward: x; never for dy).
        keep: the mask's bits (``keep_bits(meta, inp)``), or None to draw them here.
        block_k: reduction tile; default ``_launch_config``'s.
        stages: software-pipeline depth; default ``_launch_config``'s.

    Returns:
        (T, R_PAD) fp32 h, R_PAD = ``meta.r_cols``: slot g's tokens get columns ``0 : r_g``; the rest is
        unspecified.
    """
    n_tok, k = inp.shape
    check_2d("inp", inp, n_tok, k)
    check_2d("w", w, meta.total_rank, k)
    out = torch.empty((n_tok, meta.r_cols), dtype=torch.float32, device=inp.device)
    br = min(meta.r_cols, 64)
    if meta.n_tiles:
        dropout = dropout and meta.has_dropout
        if dropout and keep is None:
            keep = keep_bits(meta, inp)
        tile, default_stages = _launch_config(dropout)
        dot_dtype, precision = _dot_config(inp.dtype, cast_to_act=True)
        _jit.launch(_seg_shrink_kernel, (meta.n_tiles, meta.r_cols // br),
            inp, w, out, keep if dropout else out, meta.tiles, meta.seg_int, meta.seg_flt, k, meta.r_cols,
            DROPOUT=dropout, DOT_DTYPE=dot_dtype, PRECISION=precision,
            BM=meta.block_m, BK=block_k or 2 * tile, BR=br, num_stages=stages or default_stages)
    return out


def seg_expand_add(h: torch.Tensor, w: torch.Tensor, meta: SegmentMeta, dst: torch.Tensor, *,
                   src: torch.Tensor | None, dropout: bool, keep: torch.Tensor | None = None,
                   bias: torch.Tensor | None = None, block_n: int | None = None) -> torch.Tensor:
    """``dst[t] = src[t] + bias + drop?(h[t, :r_g] @ w[rank_off_g : rank_off_g + r_g])`` for active tokens t.

    Args:
        h: (T, R_PAD) fp32 from ``seg_shrink``.
        w: (R, N) packed weights.
        meta: segment tables of this layer call.
        dst: (T, N) output, written on active tokens only; may be ``src`` (in place).
        src: (T, N) addend, or None to store the LoRA term alone.
        bias: (N,) added to every active row, or None.
        dropout: multiply by each slot's dropout mask (the backward dx epilogue).
        keep: the mask's bits (``keep_bits`` of the layer input, N wide), or None to draw them here.
        block_n: output-feature tile; default 128 (64 was better when the epilogue drew the mask itself).

    Returns:
        ``dst``.
    """
    n_tok, n = dst.shape
    check_2d("h", h, n_tok, meta.r_cols)
    check_2d("w", w, meta.total_rank, n)
    check_2d("dst", dst, n_tok, n)
    if src is not None:
        check_2d("src", src, n_tok, n)
    if bias is not None:
        check_2d("bias", bias.view(1, -1), 1, n)
    if meta.n_tiles:
        dropout = dropout and meta.has_dropout
        if dropout and keep is None:
            keep = keep_bits(meta, dst)
        block_n = block_n or 128
        dot_dtype, precision = _dot_config(dst.dtype, cast_to_act=True)
        _jit.launch(_seg_expand_kernel, (meta.n_tiles, triton.cdiv(n, block_n)),
            h, w, dst if src is None else src, dst if bias is None else bias, dst, keep if dropout else dst,
            meta.tiles, meta.seg_int, meta.seg_flt, n, meta.r_cols, HAS_SRC=src is not None,
            HAS_BIAS=bias is not None, DROPOUT=dropout, DOT_DTYPE=dot_dtype, PRECISION=precision, BM=meta.block_m,
            BN=block_n, BR=_EXPAND_BR)
    return dst


def seg_wgrad(p: torch.Tensor, q: torch.Tensor, meta: SegmentMeta, *, dropout: bool, keep: torch.Tensor | None = None,
              into: torch.Tensor | None = None, block_t: int | None = None, block_n: int | None = None,
              stages: int | None = None) -> torch.Tensor:
    """``out[rank_off_g : rank_off_g + r_g] = p_g[:, :r_g]^T @ drop?(q_g)`` over each segment's tokens.

    Args:
        p: (T, R_PAD) fp32 per-token rank coefficients.
        q: (T, N) activations.
        meta: segment tables of this layer call.
        dropout: apply each slot's dropout mask to ``q`` (x for d a_cat).
        keep: the mask's bits (``keep_bits(meta, q)``), or None to draw them here.
        into: (R, N) fp32 gradient to add the result to in place (a pack's gradient buffer: no zero fill,
            no separate add), or None for a new tensor. With one partial sum the kernel adds it as it stores.
        block_t: token step of the reduction; default ``_launch_config``'s.
        stages: software-pipeline depth; default ``_launch_config``'s.
        block_n: feature tile; default ``WGRAD_BLOCK_N``.

    Returns:
        (R, N) fp32 (``into`` when given); rows of slots without tokens are zero (left as they were in ``into``).
    """
    n_tok, n = q.shape
    check_2d("p", p, n_tok, meta.r_cols)
    check_2d("q", q, n_tok, n)
    direct = into is not None and meta.n_partials <= 1
    if into is not None and (into.dtype != torch.float32 or into.shape != (meta.total_rank, n)
                             or not into.is_contiguous()):
        raise ValueError(f"into: expected a contiguous fp32 ({meta.total_rank}, {n}) tensor, got {into.dtype} "
                         f"{tuple(into.shape)}")
    out = into.view(1, meta.total_rank, n) if direct else torch.zeros(  # type: ignore[union-attr]
        (max(meta.n_partials, 1), meta.total_rank, n), dtype=torch.float32, device=q.device)
    br = min(meta.r_cols, 64)
    if meta.n_chunks:
        dropout = dropout and meta.has_dropout
        if dropout and keep is None:
            keep = keep_bits(meta, q)
        tile, default_stages = _launch_config(dropout)
        dot_dtype, precision = _dot_config(q.dtype, cast_to_act=False)
        block_n = block_n or WGRAD_BLOCK_N
        _jit.launch(_seg_wgrad_kernel, (meta.n_chunks, triton.cdiv(n, block_n), meta.r_cols // br),
            p, q, out, keep if dropout else out, meta.chunks, meta.seg_int, meta.seg_flt, n, meta.total_rank,
            meta.r_cols, DROPOUT=dropout, ACCUMULATE=direct, DOT_DTYPE=dot_dtype, PRECISION=precision,
            BT=block_t or tile, BN=block_n, BR=br, num_stages=stages or default_stages)
    if direct:
        return into  # type: ignore[return-value]
    total = out[0] if out.shape[0] == 1 else out.sum(dim=0)  # fixed-order reduction: deterministic
    return total if into is None else into.add_(total)
