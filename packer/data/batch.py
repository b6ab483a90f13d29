"""Assemble the micro-batches of all active slots into one padded, slot-grouped batch."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple, Protocol

import torch

from lora_sweep.kernels.ops import PackLayout, to_device_async
from lora_sweep.packer.data.rows import IGNORE_INDEX

__all__ = ["PackBatch", "collate", "row_slots", "IGNORE_INDEX"]


class Row(Protocol):
    input_ids: Sequence[int]
    labels: Sequence[int]


class PackBatch(NamedTuple):
    """One packed step's inputs.

    Attributes:
        input_ids: (B, L) right-padded token ids.
        attention_mask: (B, L) 1 on real tokens.
        labels: (B, L) targets, ``IGNORE_INDEX`` on prompt and padding tokens (not yet shifted).
        layout: row segment of each slot.
        position_ids: (B, L) positions restarting at every example of a sample-packed row (0..L-1 on the
            other rows); None when no row is sample-packed.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    labels: torch.Tensor
    layout: PackLayout
    position_ids: torch.Tensor | None = None


def collate(slots: Sequence[int], rows: Sequence[Sequence[Row]], pad_id: int, *,
            dropout: Sequence[float], seeds: Sequence[int], device: torch.device | str = "cpu") -> PackBatch:
    """Right-pad every slot's rows to the longest row of the pack and record the layout.

    Right padding with a causal model leaves every real token's output as it would be in a batch of
    that slot alone; attention never crosses rows, so slots never mix.

    Args:
        slots: slot id of each group, in row order.
        rows: each slot's micro-batch (``Example``-like objects with ``input_ids`` and ``labels``).
        pad_id: token id used for padding.
        dropout: each slot's LoRA dropout probability.
        seeds: each slot's dropout seed for this step.
        device: where the tensors go.
    """
    flat = [r for group in rows for r in group]
    seq = max(len(r.input_ids) for r in flat)
    ids = torch.full((len(flat), seq), pad_id, dtype=torch.long)
    labels = torch.full((len(flat), seq), IGNORE_INDEX, dtype=torch.long)
    mask = torch.zeros((len(flat), seq), dtype=torch.long)
    packed = any(getattr(r, "position_ids", None) is not None for r in flat)
    pos = torch.arange(seq).repeat(len(flat), 1) if packed else None
    for i, r in enumerate(flat):
        n = len(r.input_ids)
        ids[i, :n] = torch.tensor(r.input_ids)
        labels[i, :n] = torch.tensor(r.labels)
        mask[i, :n] = 1
        if pos is not None and getattr(r, "position_ids", None) is not None:
            # the padding tail continues the last example's positions: it belongs to no new example
            pos[i, :n] = torch.tensor(r.position_ids)
            pos[i, n:] = torch.arange(seq - n) + (r.position_ids[-1] + 1)
    starts, start = [], 0
    for group in rows:
        starts.append(start)
        start += len(group)
    layout = PackLayout(
        slots=tuple(slots),
        row_start=tuple(starts),
        n_rows=tuple(len(g) for g in rows),
        own_len=tuple(max((len(r.input_ids) for r in g), default=0) for g in rows),
        dropout=tuple(float(p) for p in dropout),
        seed=tuple(seeds),
    )
    return PackBatch(ids.to(device), mask.to(device), labels.to(device), layout,
                     None if pos is None else pos.to(device))


def row_slots(layout: PackLayout, device: torch.device) -> torch.Tensor:
    """(B,) int64: the layout index of the slot each row belongs to, on ``device``.

    Built on the host and copied without blocking: a blocking copy would wait for the whole forward, when
    the loss asks for it.
    """
    return to_device_async(torch.repeat_interleave(torch.arange(len(layout.slots)), torch.tensor(layout.n_rows)),
                           device)

