"""Host-side metadata for the packed LoRA kernels: segment table, tile maps and block sizes.

Torch only (no triton), so it is importable and testable anywhere. Everything here is built from the
plain Python ints of ``PackLayout`` / ``LayerRanks``: no device-to-host sync.

Token segments: slot g owns the tokens ``[row_start[g] * L, (row_start[g] + n_rows[g]) * L)`` of the
flattened ``(B * L, D)`` activations (padding positions included; harmless). Only *active* segments
(rank > 0 and n_rows > 0) get a row in the tables, so empty and rank-0 segments get no tiles.
"""

from __future__ import annotations

from functools import lru_cache
from typing import NamedTuple

import torch

from lora_sweep.kernels.meta import LayerRanks, PackLayout, rank_bucket_for

__all__ = ["SegmentMeta", "build_meta", "segment_meta", "check_2d", "to_device_async",
           "SegInt", "SegFlt", "Tile", "Chunk", "SEG_INT_COL", "SEG_FLT_COL", "TILE_COL", "CHUNK_COL",
           "SEG_INT_FIELDS", "SEG_FLT_FIELDS", "TILE_FIELDS", "CHUNK_FIELDS", "POS_BITS", "free_segment", "FREE_FLT"]

class SegInt(NamedTuple):
    """One row of ``SegmentMeta.seg_int`` (int64): the column names every user of the table indexes by
    (``SEG_INT_COL``), the kernels through ``kernels._tables``' constants."""

    tok_start: int
    """First token of the segment in the flattened (T, D) activations."""
    tok_end: int
    """One past its last token."""
    row_start: int
    """Its first row of the (B, L) batch (dropout counters are slot-local rows)."""
    rank: int
    """r_g in this call (0: a free slot of a pack)."""
    rank_off: int
    """Its first row of ``a_cat`` / ``bt_cat``."""
    seed: int
    """The slot's dropout seed (``PackLayout.seed``; the layer enters the kernels' Philox counter, so one table
    serves every layer)."""


class SegFlt(NamedTuple):
    """One row of ``SegmentMeta.seg_flt`` (fp32)."""

    scale: float
    """s_g."""
    p: float
    """Dropout probability."""
    inv_keep: float
    """1 / (1 - p)."""


class Tile(NamedTuple):
    """One row of ``SegmentMeta.tiles`` (int64): a token tile of the shrink and expand kernels."""

    seg: int
    tok0: int


class Chunk(NamedTuple):
    """One row of ``SegmentMeta.chunks`` (int64): a token chunk of the weight gradient's partial sums."""

    seg: int
    tok0: int
    tok1: int
    part: int


SEG_INT_COL = SegInt(*range(len(SegInt._fields)))
"""Column index of each ``seg_int`` field (``seg_int[:, SEG_INT_COL.rank]``)."""
SEG_FLT_COL = SegFlt(*range(len(SegFlt._fields)))
"""Column index of each ``seg_flt`` field."""
TILE_COL = Tile(*range(len(Tile._fields)))
CHUNK_COL = Chunk(*range(len(Chunk._fields)))
SEG_INT_FIELDS = len(SegInt._fields)
SEG_FLT_FIELDS = len(SegFlt._fields)
TILE_FIELDS = len(Tile._fields)
CHUNK_FIELDS = len(Chunk._fields)
POS_BITS = 20
"""Dropout counters use ``(local_row << POS_BITS) + position``: independent of the packed ``L``."""

BLOCK_M = 64
"""Tokens per tile of the shrink and expand kernels: the fastest tried (BENCHMARKS.md, "Kernel tiles, operand dtypes
and the fused norms")."""
CHUNK_TOKENS = 2048
"""Tokens per weight-gradient partial sum. A constant (not derived from the pack) so a slot's
reduction order, and hence its gradient bits, do not depend on which slots share the pack. 2048 rather
than 1024: a slot of up to 2048 tokens then needs no partial-sum buffer and no reduction after the kernel, which
makes the weight gradient faster (BENCHMARKS.md, "Kernel tiles, operand dtypes and the fused norms")."""


class SegmentMeta(NamedTuple):
    """Device tables for one layer call, shared by its forward and backward.

    Attributes:
        seg_int: (S, SEG_INT_FIELDS) int64, one ``SegInt`` per active segment; S = active segments.
        seg_flt: (S, SEG_FLT_FIELDS) float32, one ``SegFlt`` per active segment.
        tiles: (n_tiles, TILE_FIELDS) int64, one ``Tile`` each; tiles never straddle two segments.
        chunks: (n_chunks, CHUNK_FIELDS) int64, one ``Chunk`` each (segment, first token, end token, partial slot).
        n_tiles: rows of ``tiles``.
        n_chunks: rows of ``chunks``.
        n_partials: partial-sum slots of the weight gradient (the most chunks any segment has).
        seq_len: L, positions per row.
        r_cols: columns of the per-token rank buffer h (its row stride), a power of 2 >= 16 and >= every rank.
        total_rank: R, rows of ``a_cat`` / ``bt_cat``.
        covers_all: the active segments cover every token (then outputs need no pre-fill).
        has_dropout: some active segment has p > 0.
        block_m: tokens per tile (the ``tiles`` map was built for it).
        layer_id: ``LayerRanks.layer_id``, the third Philox counter word of the dropout masks.
    """

    seg_int: torch.Tensor
    seg_flt: torch.Tensor
    tiles: torch.Tensor
    chunks: torch.Tensor
    n_tiles: int
    n_chunks: int
    n_partials: int
    seq_len: int
    r_cols: int
    total_rank: int
    covers_all: bool
    has_dropout: bool
    block_m: int
    layer_id: int = 0


def build_meta(layout: PackLayout, ranks: LayerRanks, n_tokens: int, seq_len: int, device: torch.device, *,
               block_m: int = BLOCK_M, chunk_tokens: int = CHUNK_TOKENS) -> SegmentMeta:
    """Segment tables and tile maps of one layer call.

    Args:
        layout: row segments of the packed batch.
        ranks: this layer's ranks, scales and layer id.
        n_tokens: T = B * L of the activations.
        seq_len: L.
        device: where the kernels run.
        block_m: tokens per shrink/expand tile.
        chunk_tokens: tokens per weight-gradient partial sum.

    Returns:
        The metadata, with its tensors on ``device``.

    Raises:
        ValueError: the layout and ranks disagree, a segment leaves the batch, or p is not in [0, 1).
    """
    n = len(layout.slots)
    if len(ranks.rank) != n or len(ranks.scale) != n:
        raise ValueError(f"ranks describe {len(ranks.rank)} slots, layout {n}")
    if seq_len >= 1 << POS_BITS:
        raise ValueError(f"sequence length {seq_len} >= 2**{POS_BITS} (dropout counter width)")
    # cached without the layer id: every layer of a step shares the tables (no host work, no copy per layer)
    meta = _tables(layout, ranks.rank, ranks.scale, n_tokens, seq_len, device, block_m, chunk_tokens)
    return meta._replace(layer_id=ranks.layer_id)


@lru_cache(maxsize=64)
def _tables(layout: PackLayout, rank: tuple[int, ...], scale: tuple[float, ...], n_tokens: int, seq_len: int,
            device: torch.device, block_m: int, chunk_tokens: int) -> SegmentMeta:
    n = len(layout.slots)
    seg_int, seg_flt, tiles, chunks = [], [], [], []  # flat int lists, one float list
    n_seg, n_partials, covered, rank_off = 0, 0, 0, 0
    for g in range(n):
        r0, rows, r, p = layout.row_start[g], layout.n_rows[g], rank[g], layout.dropout[g]
        if (r0 + rows) * seq_len > n_tokens or min(r0, rows, r) < 0:
            raise ValueError(f"segment {g}: rows {r0}..{r0 + rows}, rank {r} do not fit {n_tokens // seq_len} rows")
        if not 0.0 <= p < 1.0:
            raise ValueError(f"segment {g}: dropout {p} not in [0, 1)")
        if r > 0 and rows > 0:
            t0, t1 = r0 * seq_len, (r0 + rows) * seq_len
            seg_int += SegInt(tok_start=t0, tok_end=t1, row_start=r0, rank=r, rank_off=rank_off, seed=layout.seed[g])
            seg_flt += SegFlt(scale=scale[g], p=p, inv_keep=1.0 / (1.0 - p))
            for t in range(t0, t1, block_m):
                tiles += Tile(seg=n_seg, tok0=t)
            for c, t in enumerate(range(t0, t1, chunk_tokens)):
                chunks += Chunk(seg=n_seg, tok0=t, tok1=min(t + chunk_tokens, t1), part=c)
            n_partials = max(n_partials, -(-(t1 - t0) // chunk_tokens))
            covered += t1 - t0
            n_seg += 1
        rank_off += r
    blob = to_device_async(torch.tensor(seg_int + tiles + chunks, dtype=torch.int64), device)  # one copy for all ints
    a, b = len(seg_int), len(seg_int) + len(tiles)
    r_cols = rank_bucket_for(max(rank, default=0))  # h's columns per token
    return SegmentMeta(
        seg_int=blob[:a].view(-1, SEG_INT_FIELDS),
        seg_flt=to_device_async(torch.tensor(seg_flt, dtype=torch.float32), device).view(-1, SEG_FLT_FIELDS),
        tiles=blob[a:b].view(-1, TILE_FIELDS),
        chunks=blob[b:].view(-1, CHUNK_FIELDS),
        n_tiles=len(tiles) // TILE_FIELDS, n_chunks=len(chunks) // CHUNK_FIELDS, n_partials=n_partials, seq_len=seq_len,
        r_cols=r_cols, total_rank=rank_off,
        covers_all=covered == n_tokens,
        has_dropout=any(p > 0 for p in seg_flt[SEG_FLT_COL.p::SEG_FLT_FIELDS]), block_m=block_m,
    )


def to_device_async(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host tensor -> device without a stream sync: a pageable copy waits for every kernel queued before it
    (here: stalls every layer call). Pinned blocks come from torch's caching host allocator, so pinning a few
    hundred bytes per call is cheap."""
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def check_2d(name: str, t: torch.Tensor, rows: int, cols: int) -> None:
    """Launcher argument check: a contiguous fp32/bf16/fp16 ``(rows, cols)`` tensor.

    Raises:
        ValueError: any of the three does not hold.
    """
    if t.shape != (rows, cols) or not t.is_contiguous() or t.dtype not in (torch.float32, torch.bfloat16,
                                                                           torch.float16):
        raise ValueError(f"{name}: expected a contiguous fp32/bf16/fp16 ({rows}, {cols}) tensor, "
                         f"got {t.dtype} {tuple(t.shape)} contiguous={t.is_contiguous()}")


def segment_meta(capacity: int, rows: int, seq_len: int, rank_cols: int, device: torch.device, *,
                dropout: bool, block_m: int = BLOCK_M, chunk_tokens: int = CHUNK_TOKENS) -> SegmentMeta:
    """Tables of a fixed-shape pack (``packer.model.store``): ``capacity`` segments of ``rows`` rows each, every one
    present whatever its slot holds, so the tile and chunk maps (and hence every grid) depend on the shape only.

    The per-slot columns are data the caller writes in place before each step (a captured CUDA graph reads
    them at replay): ``seg_int[g]`` a ``SegInt``, ``seg_flt[g]`` a ``SegFlt``. Here they are filled with
    ``free_segment`` (the fixed token range, rows and ``rank_off = g * rank_cols``; rank 0: a free slot, whose
    LoRA term the kernels skip, writing its base output unchanged) and ``FREE_FLT``.

    Args:
        capacity: C, segments (slots).
        rows: M, rows per slot.
        seq_len: L, the padded length of every row.
        rank_cols: the rank bucket: rows of A / B^T per slot, and the largest rank a slot may have.
        device: where the kernels run.
        dropout: compile the kernels' dropout branch (a slot with p = 0 then gets a multiplier of exactly 1).

    Returns:
        The metadata; ``covers_all`` is true (every token belongs to a segment).
    """
    if seq_len >= 1 << POS_BITS:
        raise ValueError(f"sequence length {seq_len} >= 2**{POS_BITS} (dropout counter width)")
    per = rows * seq_len
    seg_int = torch.tensor([free_segment(g, rows, seq_len, rank_cols) for g in range(capacity)], dtype=torch.int64)
    seg_flt = torch.tensor([FREE_FLT] * capacity, dtype=torch.float32)
    tiles = [Tile(g, t) for g in range(capacity) for t in range(g * per, (g + 1) * per, block_m)]
    chunks = [Chunk(g, t, min(t + chunk_tokens, (g + 1) * per), c) for g in range(capacity)
              for c, t in enumerate(range(g * per, (g + 1) * per, chunk_tokens))]
    r_cols = rank_bucket_for(rank_cols)
    return SegmentMeta(
        seg_int=seg_int.to(device), seg_flt=seg_flt.to(device),
        tiles=torch.tensor(tiles, dtype=torch.int64).view(-1, TILE_FIELDS).to(device),
        chunks=torch.tensor(chunks, dtype=torch.int64).view(-1, CHUNK_FIELDS).to(device),
        n_tiles=len(tiles), n_chunks=len(chunks), n_partials=-(-per // chunk_tokens), seq_len=seq_len,
        r_cols=r_cols, total_rank=capacity * rank_cols, covers_all=True, has_dropout=dropout,
        block_m=block_m,
    )


def free_segment(g: int, rows: int, seq_len: int, rank_cols: int) -> SegInt:
    """Segment g of a pack (``segment_meta``) holding no slot: its fixed token range, rows and rank rows,
    rank 0 (the kernels skip its LoRA term), seed 0."""
    per = rows * seq_len
    return SegInt(tok_start=g * per, tok_end=(g + 1) * per, row_start=g * rows, rank=0, rank_off=g * rank_cols,
                  seed=0)


FREE_FLT = SegFlt(scale=0.0, p=0.0, inv_keep=1.0)
"""``seg_flt`` row of a free slot (and of a slot without dropout, with its scale)."""
