"""What a slot trains on for an adapter, and what that adds up to: its stream, its epochs' steps, its tokens.

The sweep asks these with plain values (the adapter, the study's seed and row length) when it starts a trial and
when it plans one, so the stream a slot trains on, the optimizer steps its epochs take and the target tokens a
budget plans for it come from the same numbers.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from lora_sweep.packer.data.packing import SamplePackedStream, batches_per_epoch, slot_stream
from lora_sweep.packer.data.rows import IGNORE_INDEX, Example, SlotStream
from lora_sweep.packer.plan import AdapterSpec

__all__ = ["adapter_stream", "epoch_steps", "row_lengths", "stream_tokens", "target_tokens"]


def target_tokens(row: Any) -> int:
    """Tokens of a row that take a loss (``labels[1:]`` after the causal shift)."""
    return sum(1 for label in row.labels[1:] if label != IGNORE_INDEX)


def adapter_stream(examples: Sequence[Example], adapter: AdapterSpec, seed: int,
                   row_len: int) -> SlotStream | SamplePackedStream:
    """The stream a slot of ``adapter`` trains on: ``micro_batch`` rows a micro-batch in the order seeded by ``seed``
    (every slot of a study the same order: pack peers are paired samples), sample-packed into rows of ``row_len``
    tokens when the adapter packs."""
    return slot_stream(examples, adapter.micro_batch, seed, sample_packing=adapter.sample_packing, row_len=row_len)


def epoch_steps(examples: Sequence[Example], adapter: AdapterSpec, epochs: float, row_len: int, seed: int,
                max_per_epoch: int | None = None) -> int:
    """Optimizer steps of ``epochs`` passes: ``ceil(epochs * ceil(micro-batches per epoch / accumulation))``
    (HF Trainer's count, the last partial accumulation counted as a step), each epoch capped at
    ``max_per_epoch`` steps (torchtune's ``max_steps_per_epoch``)."""
    batches = batches_per_epoch(examples, adapter.micro_batch, sample_packing=adapter.sample_packing,
                                row_len=row_len, seed=seed)
    per_epoch = max(1, -(-batches // adapter.gradient_accumulation_steps))
    if max_per_epoch is not None:
        per_epoch = min(per_epoch, max_per_epoch)
    return max(1, math.ceil(epochs * per_epoch))


def row_lengths(lengths: Sequence[int], adapter: AdapterSpec, seed: int, row_len: int) -> list[int]:
    """Token lengths of the rows a slot of ``adapter`` trains on, from its examples' lengths alone (a plan has no
    rows): the examples themselves, or with sample packing the rows one epoch's packing makes of them (nearly
    ``row_len`` each, where a plan that took the examples' lengths counted a step's tokens several times too few)."""
    if not adapter.sample_packing or not lengths:
        return list(lengths)
    shaped = [Example(tuple(range(n)), tuple(range(n))) for n in lengths]  # only the lengths count for the packing
    return [len(row.input_ids) for row in SamplePackedStream(shaped, 1, seed, row_len).epoch_rows(0)]


def stream_tokens(examples: Sequence[Example], adapter: AdapterSpec, seed: int, row_len: int,
                  micro_steps: int) -> int:
    """Target tokens of the first ``micro_steps`` micro-batches of ``adapter_stream`` (drawn from a fresh stream)."""
    stream = adapter_stream(examples, adapter, seed, row_len)
    return sum(target_tokens(r) for _ in range(micro_steps) for r in stream.next_batch())
