"""The host tables' columns (``kernels._launch``: ``SegInt``, ``SegFlt``, ``Tile``, ``Chunk``) as Triton constants.

A ``@triton.jit`` function reads a module global only when it is a ``tl.constexpr``, so the kernel modules
take every table offset from here: ``tl.load(seg_int_ptr + seg * SI + SI_RANK)`` is column ``rank`` of the
table whose field order ``kernels._launch`` defines once. Reordering or adding a column there moves every
kernel's offsets with it.
"""

from __future__ import annotations

from lora_sweep.kernels._jit import tl
from lora_sweep.kernels._launch import (
    CHUNK_COL,
    CHUNK_FIELDS,
    POS_BITS,
    SEG_FLT_COL,
    SEG_FLT_FIELDS,
    SEG_INT_COL,
    SEG_INT_FIELDS,
    TILE_COL,
    TILE_FIELDS,
)

SI: tl.constexpr = tl.constexpr(SEG_INT_FIELDS)
"""Row stride of ``seg_int``."""
SI_TOK_END: tl.constexpr = tl.constexpr(SEG_INT_COL.tok_end)
SI_ROW_START: tl.constexpr = tl.constexpr(SEG_INT_COL.row_start)
SI_RANK: tl.constexpr = tl.constexpr(SEG_INT_COL.rank)
SI_RANK_OFF: tl.constexpr = tl.constexpr(SEG_INT_COL.rank_off)
SI_SEED: tl.constexpr = tl.constexpr(SEG_INT_COL.seed)

SF: tl.constexpr = tl.constexpr(SEG_FLT_FIELDS)
"""Row stride of ``seg_flt``."""
SF_SCALE: tl.constexpr = tl.constexpr(SEG_FLT_COL.scale)
SF_P: tl.constexpr = tl.constexpr(SEG_FLT_COL.p)
SF_INV_KEEP: tl.constexpr = tl.constexpr(SEG_FLT_COL.inv_keep)

TI: tl.constexpr = tl.constexpr(TILE_FIELDS)
"""Row stride of ``tiles``."""
TI_SEG: tl.constexpr = tl.constexpr(TILE_COL.seg)
TI_TOK0: tl.constexpr = tl.constexpr(TILE_COL.tok0)

CH: tl.constexpr = tl.constexpr(CHUNK_FIELDS)
"""Row stride of ``chunks``."""
CH_SEG: tl.constexpr = tl.constexpr(CHUNK_COL.seg)
CH_TOK0: tl.constexpr = tl.constexpr(CHUNK_COL.tok0)
CH_TOK1: tl.constexpr = tl.constexpr(CHUNK_COL.tok1)
CH_PART: tl.constexpr = tl.constexpr(CHUNK_COL.part)

POS_SHIFT: tl.constexpr = tl.constexpr(POS_BITS)
"""Dropout counters: ``(local_row << POS_SHIFT) + position``."""
