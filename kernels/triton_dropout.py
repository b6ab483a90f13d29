"""Slot dropout of the packed-LoRA kernels: Philox4x32-10 spelled out, the keep mask of one layer call drawn once
as bits (``keep_bits``), the keep/scale multiplier every kernel of ``kernels.triton_lora`` reads from them
(``bits_scale``), a kernel that materialises the multiplier straight from Philox (tests and debugging), and
``DroppedPartFunction``: what dropout removed from some slots' input, ``x - drop(x)`` from the same bits (DoRA's
term with dropout, ``kernels.triton_dora``).

keep = u >= p_g, u = word (col % 4) of Philox4x32-10 with key ``PackLayout.seed[g]`` (the slot's own seed for
this step) and counter (((local_row << 20) + pos) * ceil(D_in / 4) + col // 4 as two words, layer_id, 0):
one Philox call per 4 columns. Key and counter depend on the slot, its own rows/positions, the column and the
layer only, so a slot's mask is the same whichever slots share the pack, and every layer draws an
independent one. The mask lives as bits from a layer's forward to its backward (1 bit per input element).

Builtins only (``tl.full``, not ``tl.zeros``): the ``tl`` helpers are themselves ``@triton.jit`` and cannot run
in the interpreter when triton was imported before ``TRITON_INTERPRET=1`` was set (``kernels.triton_lora``).
"""

from __future__ import annotations

import torch

from lora_sweep.kernels import _jit
from lora_sweep.kernels._jit import SUM_COMBINE, tl, triton
from lora_sweep.kernels._launch import SegmentMeta
from lora_sweep.kernels._tables import (
    POS_SHIFT,
    SF,
    SF_INV_KEEP,
    SF_P,
    SI,
    SI_ROW_START,
    SI_SEED,
    SI_TOK_END,
    TI,
    TI_SEG,
    TI_TOK0,
)

__all__ = ["DroppedPartFunction", "bits_scale", "dropout_mask", "dropped_part", "keep_bits", "keep_scale", "philox"]

_KEY_A: tl.constexpr = tl.constexpr(0x9E3779B9)  # Philox4x32 constants, as triton.language.random
_KEY_B: tl.constexpr = tl.constexpr(0xBB67AE85)
_ROUND_A: tl.constexpr = tl.constexpr(0xD2511F53)
_ROUND_B: tl.constexpr = tl.constexpr(0xCD9E8D57)


@triton.jit
def philox(seed, offs, stream):
    """Philox4x32-10 on the counter (offs_lo, offs_hi, stream, 0) with key (seed_lo, seed_hi), as
    ``tl.philox(seed, offs_lo, offs_hi, stream, 0)``; with stream 0 it is ``tl.randint4x(seed, offs)``.

    Spelled out so the interpreter can run it (module docstring); ``test_philox_is_tl_philox`` checks the bits.
    """
    seed = seed.to(tl.uint64)
    k0 = (seed & 0xFFFFFFFF).to(tl.uint32)
    k1 = ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32)
    c0 = offs.to(tl.uint32)
    c1 = (offs >> 32).to(tl.uint32)
    c2 = c0 * 0 + stream  # uint32 (an int argument equal to 1 arrives as a constexpr: no .to() on it)
    c3 = c0 * 0
    for _ in tl.static_range(10):
        _c0, _c2 = c0, c2
        c0 = tl.math.umulhi(_ROUND_B, _c2) ^ c1 ^ k0
        c2 = tl.math.umulhi(_ROUND_A, _c0) ^ c3 ^ k1
        c1 = _ROUND_B * _c2
        c3 = _ROUND_A * _c0
        k0 = k0 + _KEY_A
        k1 = k1 + _KEY_B
    return c0, c1, c2, c3


@triton.jit
def keep_scale(seg_int_ptr, seg_flt_ptr, seg, tok, col0, seq_len, d_in, layer_id, BC: tl.constexpr):
    """(len(tok), BC) fp32 dropout multiplier M / (1 - p) of segment ``seg`` for tokens ``tok`` (int64) and
    columns ``col0 + arange(BC)`` (col0 a multiple of 4). Column c uses word c % 4 of counter c // 4: one Philox
    call per 4 columns, the layer id as the third counter word; u = the word mapped to [0, 1) as ``tl.rand``.

    A segment with p = 0 (a slot without dropout in a call where some slot has it, as every call of a pack with
    dropout is) gets exactly 1 without drawing: u >= 0 always holds and 1 / (1 - 0) is 1, so the branch changes no
    value, only skips those programs' Philox rounds. In the SmolLM2-shaped 16-slot pack with dropout on every other slot
    it gains nothing measurable (BENCHMARKS.md, "Kernel tiles, operand dtypes and the fused norms"): a launch lasts as
    long as its slowest tiles, which draw."""
    p = tl.load(seg_flt_ptr + seg * SF + SF_P)
    n: tl.constexpr = tok.shape[0]
    mult = tl.full((n, BC), 1.0, tl.float32)
    if p > 0.0:
        mult = _draw(seg_int_ptr, seg_flt_ptr, seg, tok, col0, seq_len, d_in, layer_id, p, BC)
    return mult


@triton.jit
def _draw(seg_int_ptr, seg_flt_ptr, seg, tok, col0, seq_len, d_in, layer_id, p, BC: tl.constexpr):
    """``keep_scale``'s multiplier for a segment with p > 0."""
    inv_keep = tl.load(seg_flt_ptr + seg * SF + SF_INV_KEEP)
    return tl.where(_keep(seg_int_ptr, seg, tok, col0, seq_len, d_in, layer_id, p, BC), inv_keep, 0.0)


@triton.jit
def _keep(seg_int_ptr, seg, tok, col0, seq_len, d_in, layer_id, p, BC: tl.constexpr):
    """(len(tok), BC) int1: which of the columns ``col0 + arange(BC)`` segment ``seg`` keeps (u >= p)."""
    seed = tl.load(seg_int_ptr + seg * SI + SI_SEED)
    row_start = tl.load(seg_int_ptr + seg * SI + SI_ROW_START)
    row = tok // seq_len
    pos = tok - row * seq_len
    counter = ((row - row_start) << POS_SHIFT) + pos  # slot-local: independent of the other slots and of L
    quad = col0 // 4 + tl.arange(0, BC // 4)
    offs = counter[:, None] * ((d_in + 3) // 4) + quad[None, :]  # int64, unique per (local row, pos, quad)
    c0, c1, c2, c3 = philox(seed, offs, layer_id)
    # interleave to columns c0, c1, c2, c3 of quad 0, then quad 1, ... (builtins: tl.interleave is jit'd)
    n: tl.constexpr = tok.shape[0]
    even = tl.reshape(tl.join(c0, c2), (n, BC // 2))
    odd = tl.reshape(tl.join(c1, c3), (n, BC // 2))
    x = tl.reshape(tl.join(even, odd), (n, BC)).to(tl.int32, bitcast=True)
    u = tl.where(x < 0, ~x, x) * 4.6566127342e-10  # triton.language.random.uint_to_uniform_float
    return u >= p


@triton.jit
def bits_scale(bits_ptr, seg_flt_ptr, seg, tok, tok_mask, col0, n_words, BC: tl.constexpr):
    """(len(tok), BC) fp32 dropout multiplier M / (1 - p) of segment ``seg`` read from its keep bits (``keep_bits``)
    for tokens ``tok`` and columns ``col0 + arange(BC)`` (col0 and BC multiples of 32): the multiplier
    ``keep_scale`` draws, bit for bit, for a fraction of a draw's cost (one int32 load per 32 columns)."""
    inv_keep = tl.load(seg_flt_ptr + seg * SF + SF_INV_KEEP)
    words_i = col0 // 32 + tl.arange(0, BC // 32)
    words = tl.load(bits_ptr + tok[:, None] * n_words + words_i[None, :],
                    mask=tok_mask[:, None] & (words_i < n_words)[None, :], other=0)
    n: tl.constexpr = tok.shape[0]
    bit = tl.reshape((words[:, :, None] >> tl.arange(0, 32)[None, None, :]) & 1, (n, BC))
    return tl.where(bit != 0, inv_keep, 0.0)


@triton.jit(do_not_specialize=["seq_len", "layer_id"])
def _keep_bits_kernel(
    bits_ptr,  # (T, W) int32 keep bits: bit j of word w of token t = column 32 w + j kept
    tiles_ptr,  # (n_tiles, TI) int64 tile map (kernels._launch.Tile)
    seg_int_ptr,  # (S, SI) int64 segment table (kernels._launch.SegInt)
    seg_flt_ptr,  # (S, SF) fp32 segment table (kernels._launch.SegFlt)
    D, W, seq_len, layer_id,
    BM: tl.constexpr, BW: tl.constexpr,
):
    pid_m = tl.program_id(0)
    seg = tl.load(tiles_ptr + TI * pid_m + TI_SEG)
    t0 = tl.load(tiles_ptr + TI * pid_m + TI_TOK0)
    t_end = tl.load(seg_int_ptr + seg * SI + SI_TOK_END)
    p = tl.load(seg_flt_ptr + seg * SF + SF_P)
    tok = (t0 + tl.arange(0, BM)).to(tl.int64)
    w0 = tl.program_id(1) * BW
    words_i = w0 + tl.arange(0, BW)
    words = tl.full((BM, BW), -1, tl.int32)  # p = 0: every column kept, no draw
    if p > 0.0:
        keep = _keep(seg_int_ptr, seg, tok, w0 * 32, seq_len, D, layer_id, p, BW * 32).to(tl.int32)
        shifted = tl.reshape(keep, (BM, BW, 32)) << tl.arange(0, 32)[None, None, :]
        # the 32 bits are disjoint, so their sum (no carry) is their OR: Triton's own sum combine, which the
        # interpreter reduces in one numpy call (any other combine it runs element by element: _jit.SUM_COMBINE)
        words = tl.reduce(shifted, 2, SUM_COMBINE)
    tl.store(bits_ptr + tok[:, None] * W + words_i[None, :], words,
             mask=(tok < t_end)[:, None] & (words_i < W)[None, :])


@triton.jit(do_not_specialize=["seq_len", "layer_id"])
def _dropout_mask_kernel(
    out_ptr,  # (T, D) fp32 multiplier M / (1 - p); left untouched outside active segments
    tiles_ptr,  # (n_tiles, TI) int64 tile map (kernels._launch.Tile)
    seg_int_ptr,  # (S, SI) int64 segment table (kernels._launch.SegInt)
    seg_flt_ptr,  # (S, SF) fp32 segment table (kernels._launch.SegFlt)
    D, seq_len, layer_id,
    BM: tl.constexpr, BN: tl.constexpr,
):
    pid_m = tl.program_id(0)
    seg = tl.load(tiles_ptr + TI * pid_m + TI_SEG)
    t0 = tl.load(tiles_ptr + TI * pid_m + TI_TOK0)
    t_end = tl.load(seg_int_ptr + seg * SI + SI_TOK_END)
    tok = (t0 + tl.arange(0, BM)).to(tl.int64)
    cols = tl.program_id(1) * BN + tl.arange(0, BN)
    mult = keep_scale(seg_int_ptr, seg_flt_ptr, seg, tok, tl.program_id(1) * BN, seq_len, D, layer_id, BN)
    tl.store(out_ptr + tok[:, None] * D + cols[None, :], mult, mask=(tok < t_end)[:, None] & (cols < D)[None, :])


def dropout_mask(meta: SegmentMeta, n_tokens: int, d_in: int, device: torch.device) -> torch.Tensor:
    """The multiplier M / (1 - p) the kernels apply to x, materialised (tests and debugging only).

    Returns:
        (T, D_in) fp32; ones on tokens outside active segments.
    """
    out = torch.ones((n_tokens, d_in), dtype=torch.float32, device=device)
    if meta.n_tiles:
        _dropout_mask_kernel[(meta.n_tiles, triton.cdiv(d_in, 64))](
            out, meta.tiles, meta.seg_int, meta.seg_flt, d_in, meta.seq_len, meta.layer_id, BM=meta.block_m,
            BN=64)
    return out


KEEP_WORDS_PER_PROGRAM = 1
"""Words (of 32 columns) per program of ``_keep_bits_kernel``: 32 columns of a 64-token tile, 512 Philox calls.
Few columns per program: the kernel is Philox-bound, and a small pack's grid is narrow (96 tiles), so the draws
need many programs to hide their latency: in the SmolLM2-shaped 16 x 8 x 48 pack one word per program is the
fastest of 8, 2 and 1 (BENCHMARKS.md, "Kernel tiles, operand dtypes and the fused norms")."""


def keep_bits(meta: SegmentMeta, x: torch.Tensor) -> torch.Tensor:
    """Every active segment's dropout keep mask of one layer call on x, drawn once, as bits.

    Drawn in a kernel of its own, over a grid as wide as the mask, instead of inside the shrink, the weight
    gradient and the dx epilogue (three draws of the same mask, each in a grid of few programs, which the Philox
    rounds kept latency-bound: BENCHMARKS.md, issue 18). Those kernels read the bits (``bits_scale``); the
    multiplier is ``keep_scale``'s, bit for bit. Kept for the backward: T * D_in / 8 bytes, 1/16 of the bf16 x
    the backward keeps anyway.

    Args:
        meta: the layer call's tables (its ``layer_id``).
        x: (T, D_in) the layer input (only its shape and device are read).

    Returns:
        (T, ceil(D_in / 32)) int32; rows of tokens outside active segments are unspecified (no kernel reads them).
    """
    n_tok, d_in = x.shape
    n_words = triton.cdiv(d_in, 32)
    bits = torch.empty((n_tok, n_words), dtype=torch.int32, device=x.device)
    if meta.n_tiles:
        _jit.launch(_keep_bits_kernel, (meta.n_tiles, triton.cdiv(n_words, KEEP_WORDS_PER_PROGRAM)),
                    bits, meta.tiles, meta.seg_int, meta.seg_flt, d_in, n_words, meta.seq_len, meta.layer_id,
                    BM=meta.block_m, BW=KEEP_WORDS_PER_PROGRAM)
    return bits


@triton.jit
def _dropped_kernel(
    src_ptr,  # (T, D) forward: the layer input x; backward: (k * rows, D) the gradient of the result
    bits_ptr,  # (T, W) int32 keep bits of the layer call (``keep_bits``)
    seg_flt_ptr,  # (C, SF) fp32 segment table (the slots' 1 / (1 - p))
    sel_ptr,  # (k,) int64 the selected slots
    dst_ptr,  # forward: (k * rows, D); backward: (T, D) zero outside the selected slots' tokens
    rows,  # tokens per slot, T / C
    D, W,
    GATHER: tl.constexpr,  # forward: read slot sel[i]'s tokens of src, write block i of dst; backward: the reverse
    BM: tl.constexpr, BC: tl.constexpr,
):
    i = tl.program_id(0)
    g = tl.load(sel_ptr + i)
    rr = tl.program_id(1) * BM + tl.arange(0, BM)
    cols = tl.program_id(2) * BC + tl.arange(0, BC)
    rmask = rr < rows
    tok = g * rows + rr  # int64: the slot's tokens in the layer call (and in its bits)
    mult = bits_scale(bits_ptr, seg_flt_ptr, g, tok, rmask, tl.program_id(2) * BC, W, BC)
    mask = rmask[:, None] & (cols < D)[None, :]
    own = (i * rows + rr).to(tl.int64)[:, None] * D + cols[None, :]  # block i of the (k * rows, D) side
    full = tok[:, None] * D + cols[None, :]
    src = tl.load(src_ptr + (full if GATHER else own), mask=mask, other=0.0).to(tl.float32)
    tl.store(dst_ptr + (own if GATHER else full), (src * (1.0 - mult)).to(dst_ptr.dtype.element_ty), mask=mask)


def dropped_part(src: torch.Tensor, bits: torch.Tensor, meta: SegmentMeta, sel: torch.Tensor, capacity: int,
                 gather: bool, out: torch.Tensor) -> torch.Tensor:
    """``src * (1 - M / (1 - p))`` on the selected slots' tokens, into ``out`` (``DroppedPartFunction``)."""
    rows, d = out.shape[0] // (sel.numel() if gather else capacity), out.shape[1]
    if out.numel() and sel.numel():
        _jit.launch(_dropped_kernel, (sel.numel(), triton.cdiv(rows, 32), triton.cdiv(d, 64)), src, bits,
                    meta.seg_flt, sel, out, rows, d, bits.shape[1], GATHER=gather, BM=32, BC=64, num_warps=4)
    return out


class DroppedPartFunction(torch.autograd.Function):
    """What each selected slot's dropout removed from its tokens of a layer input: ``x - drop(x) = x (1 - M / (1 - p))``
    with the layer call's own keep bits (those the packed LoRA applied), as one (k * rows, D) block per selected slot.
    Linear in x with a constant factor, so the backward is the same product, scattered back onto the slots' tokens.
    Keeps nothing for the backward but the bits (which the packed LoRA keeps anyway)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, bits: torch.Tensor, meta: SegmentMeta, sel: torch.Tensor,
                capacity: int) -> torch.Tensor:
        """x: (T, D) contiguous, T = C * rows; bits: (T, ceil(D / 32)) int32 (``keep_bits``); sel: (k,) int64 slots
        -> (k * rows, D) in x's dtype."""
        ctx.save_for_backward(bits, sel)
        ctx.meta, ctx.capacity, ctx.shape = meta, capacity, x.shape
        ctx.warming = _jit.warm_context()
        rows = x.shape[0] // capacity
        out = torch.empty((sel.numel() * rows, x.shape[1]), dtype=x.dtype, device=x.device)
        return dropped_part(x, bits, meta, sel, capacity, True, out)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        bits, sel = ctx.saved_tensors
        dx = grad.new_zeros(ctx.shape)
        _jit.run_in(ctx.warming, dropped_part, grad.contiguous(), bits, ctx.meta, sel, ctx.capacity, False, dx)
        return dx, None, None, None, None
