"""``packer.data.stream``: an adapter's stream, the optimizer steps of its epochs and the target tokens of its first
micro-batches, from plain values (no model)."""

from __future__ import annotations

import math

import pytest

from lora_sweep.packer.data.packing import SamplePackedStream
from lora_sweep.packer.data.rows import IGNORE_INDEX, Example, SlotStream
from lora_sweep.packer.data.stream import adapter_stream, epoch_steps, row_lengths, stream_tokens
from lora_sweep.packer.plan import AdapterSpec


def _examples(n: int = 22) -> list[Example]:
    """Rows of 3..9 tokens whose first two labels are the prompt's (masked)."""
    out = []
    for i in range(n):
        ids = tuple(range(3, 3 + 3 + i % 7))
        out.append(Example(ids, (IGNORE_INDEX, IGNORE_INDEX, *ids[2:])))
    return out


def test_the_stream_is_the_adapters_kind_in_the_studys_seeded_order() -> None:
    rows = _examples()
    plain = adapter_stream(rows, AdapterSpec(micro_batch=4), seed=3, row_len=16)
    assert isinstance(plain, SlotStream) and plain.next_batch() == SlotStream(rows, 4, 3).next_batch()
    packed = adapter_stream(rows, AdapterSpec(micro_batch=2, sample_packing=True), seed=3, row_len=16)
    assert isinstance(packed, SamplePackedStream) and all(len(r.input_ids) <= 16 for r in packed.next_batch())


@pytest.mark.parametrize(("micro", "accum", "epochs", "cap", "steps"), [
    (4, 1, 1, None, 6),  # 22 rows: 6 micro-batches, the last partial
    (4, 4, 1, None, 2),  # 6 micro-batches / 4: the last partial accumulation is a step (HF Trainer)
    (4, 1, 2.5, None, 15),
    (4, 1, 3, 4, 12),  # torchtune's max_steps_per_epoch caps each epoch
    (64, 1, 0.1, None, 1),  # never 0
])
def test_epochs_count_steps_as_hf_trainer_does(micro: int, accum: int, epochs: float, cap: int | None,
                                               steps: int) -> None:
    adapter = AdapterSpec(micro_batch=micro, gradient_accumulation_steps=accum)
    assert epoch_steps(_examples(), adapter, epochs, 16, 0, cap) == steps


def test_a_packed_epoch_counts_packed_rows() -> None:
    rows, packs = _examples(), AdapterSpec(micro_batch=2, sample_packing=True)
    n_rows = len(SamplePackedStream(rows, 2, 0, 16).epoch_rows(0))
    assert n_rows < len(rows) and epoch_steps(rows, packs, 1, 16, 0) == math.ceil(n_rows / 2)


def test_the_tokens_are_the_target_tokens_of_the_first_micro_batches() -> None:
    rows, adapter = _examples(), AdapterSpec(micro_batch=4)
    stream = SlotStream(rows, 4, 7)
    drawn = [r for _ in range(3) for r in stream.next_batch()]
    expected = sum(sum(1 for label in r.labels[1:] if label != IGNORE_INDEX) for r in drawn)
    assert stream_tokens(rows, adapter, 7, 16, 3) == expected > 0


def test_row_lengths_are_the_examples_or_the_rows_packing_makes_of_them() -> None:
    """A plan has only the examples' lengths: with sample packing a step's rows are the packed ones, as long as the
    slot's own stream packs them (same seed, same row length)."""
    examples = _examples()
    lengths = [len(e.input_ids) for e in examples]
    plain = AdapterSpec(micro_batch=2)
    assert row_lengths(lengths, plain, seed=5, row_len=16) == lengths
    packed = AdapterSpec(micro_batch=2, sample_packing=True)
    rows = row_lengths(lengths, packed, seed=5, row_len=16)
    stream = adapter_stream(examples, packed, 5, 16)
    assert isinstance(stream, SamplePackedStream)
    assert rows == [len(r.input_ids) for r in stream.epoch_rows(0)]
    assert sum(rows) == sum(lengths) and max(rows) <= 16 and len(rows) < len(lengths)
