"""Metadata describing how a packed batch is laid out across adapter slots.

A packed batch is one ``(B, L)`` tensor of token ids whose rows are grouped by slot: slot ``g`` owns
rows ``row_start[g] : row_start[g] + n_rows[g]``. ``PackLayout`` is built once per step on the host
and shared by every adapted layer; ``LayerRanks`` is per layer (a slot may skip a layer: rank 0).
Plain Python ints and floats, so building them costs no device sync.
"""

from __future__ import annotations

from typing import NamedTuple

__all__ = ["PackLayout", "LayerRanks", "dropout_seed", "rank_bucket_for"]

_MIX_A = 0x9E3779B97F4A7C15
_MIX_B = 0xBF58476D1CE4E5B9
_MASK63 = (1 << 63) - 1


class PackLayout(NamedTuple):
    """Row layout of one packed batch (shared by all layers of one forward/backward).

    Attributes:
        slots: slot id of each segment, in row order; length N.
        row_start: first row of each segment in the ``(B, L)`` batch.
        n_rows: rows of each segment (0 allowed: an empty segment).
        own_len: the length segment g's rows would be padded to if that slot ran alone. Dropout
            masks are drawn at shape ``(n_rows, own_len, D_in)`` so a slot sees the same masks packed
            or alone, whatever the other slots' sequence lengths.
        dropout: dropout probability of each segment's adapter.
        seed: per-segment dropout seed for this step (see ``dropout_seed``).
    """

    slots: tuple[int, ...]
    row_start: tuple[int, ...]
    n_rows: tuple[int, ...]
    own_len: tuple[int, ...]
    dropout: tuple[float, ...]
    seed: tuple[int, ...]


class LayerRanks(NamedTuple):
    """Per-layer adapter ranks and scales, aligned with ``PackLayout.slots``.

    Attributes:
        rank: r_g in this layer; 0 means slot g does not adapt this layer.
        scale: s_g (alpha/r or alpha/sqrt(r)); ignored where rank is 0.
        layer_id: a stable integer per adapted layer, folded into the dropout seed so every layer
            draws an independent mask (as PEFT's one ``nn.Dropout`` per projection does).
    """

    rank: tuple[int, ...]
    scale: tuple[float, ...]
    layer_id: int


def dropout_seed(slot_seed: int, slot_step: int, layer_id: int = 0) -> int:
    """A 63-bit seed that depends only on the slot's own seed, its own step and the layer.

    Counter-based rather than a stateful generator: the mask of (slot, step, layer) is the same
    whichever other slots share the pack, when the slot started, or whether a layer is recomputed.
    """
    h = (slot_seed * _MIX_A + (slot_step + 1) * _MIX_B + layer_id * 0x94D049BB133111EB) & _MASK63
    h ^= h >> 31
    return (h * _MIX_A) & _MASK63


def rank_bucket_for(rank: int) -> int:
    """The rows per slot that ranks up to ``rank`` are padded to: the smallest power of two >= ``rank`` and >= 16.

    16 is ``tl.dot``'s narrowest K, so the kernels' per-token buffer h has at least that many columns; a power of two
    lets a pack hold many ranks in few shapes (the slot store's rank bucket, ``packer.model.store``), so a new rank
    seldom changes the step's shapes and with them its compiled kernels and CUDA graphs.
    """
    return max(16, 1 << max(rank - 1, 0).bit_length())
