"""Sample packing: several examples in one row, each attending only to itself.

With short instruction rows most of a padded batch is padding. A sample-packed slot fills each row of
its micro-batch with whole examples, in its seeded order, up to the row length (next-fit: the next
example opens a new row when it does not fit), as Axolotl's ``sample_packing`` does, and
``micro_batch`` counts rows. Positions restart at 0 at every example (``PackedRow.position_ids``);
transformers reads the example boundaries from those positions when no padding mask is given
(``masking_utils.find_packed_sequence_indices``) and builds a block-diagonal causal mask, so no token
attends across examples. The first label of every example is masked: in its own row it is never a
target (the causal shift drops it), and here it would be predicted from the previous example's end.
So each example's loss and gradient are those it has in its own row, and the slot's per-step mean over
target tokens is that of the same examples unpacked.

Only families whose logits were checked against the unpacked examples take packed rows
(``VERIFIED_FAMILIES``, tests/packer/data/test_packing.py; the whole training run on Llama and Qwen2); the
others are refused. Whether a family's mask reads the positions depends on the transformers release, so
``packer.step.isolation`` also asks the loaded model, before a slot trains on packed rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from lora_sweep.errors import ConfigError
from lora_sweep.packer.data.rows import IGNORE_INDEX, Example, SlotStream
from lora_sweep.packer.families import FAMILIES

__all__ = ["PackedRow", "SamplePackedStream", "VERIFIED_FAMILIES", "batches_per_epoch", "check_family", "pack_rows",
           "slot_stream"]

VERIFIED_FAMILIES = tuple(f.name for f in FAMILIES if f.sample_packing)
"""``config.model_type`` values whose packed rows are tested to give each example the logits it has in its
own row (eager and SDPA attention, tests/packer/data/test_packing.py): the ``sample_packing`` column of
``packer.families``. OPT is not among them: its learned positions come from the padding mask, not from
``position_ids``."""


@dataclass(frozen=True)
class PackedRow:
    """One row holding whole examples back to back."""

    input_ids: tuple[int, ...]
    labels: tuple[int, ...]
    """Each example's labels, its first one masked."""
    position_ids: tuple[int, ...]
    """0.. per example."""
    n_examples: int


def pack_rows(examples: Sequence[Example], row_len: int) -> list[PackedRow]:
    """Next-fit packing of ``examples`` (in this order) into rows of at most ``row_len`` tokens.

    Raises:
        ValueError: an example is longer than ``row_len``.
    """
    rows: list[PackedRow] = []
    ids: list[int] = []
    labels: list[int] = []
    pos: list[int] = []
    n = 0
    for ex in examples:
        if len(ex.input_ids) > row_len:
            raise ValueError(f"an example of {len(ex.input_ids)} tokens does not fit a row of {row_len}")
        if len(ids) + len(ex.input_ids) > row_len:
            rows.append(PackedRow(tuple(ids), tuple(labels), tuple(pos), n))
            ids, labels, pos, n = [], [], [], 0
        ids += ex.input_ids
        labels += (IGNORE_INDEX, *ex.labels[1:])
        pos += range(len(ex.input_ids))
        n += 1
    if ids:
        rows.append(PackedRow(tuple(ids), tuple(labels), tuple(pos), n))
    return rows


class SamplePackedStream:
    """Endless stream of micro-batches of packed rows for one slot.

    Epoch ``e`` packs the examples in the same seeded permutation as ``SlotStream`` (``(seed, e)``)
    into rows of ``row_len`` tokens; a micro-batch is the next ``micro_batch`` rows, continuing into the
    next epoch's rows at an epoch end. ``state_dict``/``load_state_dict`` as ``SlotStream``'s.
    """

    def __init__(self, examples: Sequence[Example], micro_batch: int, seed: int, row_len: int) -> None:
        if micro_batch < 1:
            raise ValueError(f"micro_batch must be >= 1, got {micro_batch}")
        self._order = SlotStream(examples, 1, seed)  # the seeded per-epoch order, nothing else
        self.examples, self.micro_batch, self.seed, self.row_len = examples, micro_batch, seed, row_len
        self.epoch = 0
        self.position = 0
        self._rows_epoch = -1
        self._rows: list[PackedRow] = []

    def epoch_rows(self, epoch: int) -> list[PackedRow]:
        """The packed rows of one epoch."""
        if self._rows_epoch != epoch:
            self._order.epoch = epoch
            order = self._order._epoch_order()
            self._rows = pack_rows([self.examples[i] for i in order], self.row_len)
            self._rows_epoch = epoch
        return self._rows

    def next_batch(self) -> list[PackedRow]:
        batch: list[PackedRow] = []
        while len(batch) < self.micro_batch:
            rows = self.epoch_rows(self.epoch)
            end = min(len(rows), self.position + self.micro_batch - len(batch))
            batch.extend(rows[self.position:end])
            self.position = end
            if self.position == len(rows):
                self.epoch, self.position = self.epoch + 1, 0
        return batch

    def state_dict(self) -> dict[str, Any]:
        return {"seed": self.seed, "epoch": self.epoch, "position": self.position,
                "num_examples": len(self.examples), "row_len": self.row_len}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if (state["seed"], state["num_examples"], state.get("row_len")) != (self.seed, len(self.examples),
                                                                             self.row_len):
            raise ValueError("stream state is for another seed, data set or row length")
        self.epoch, self.position = state["epoch"], state["position"]


def slot_stream(examples: Sequence[Example], micro_batch: int, seed: int, *, sample_packing: bool = False,
                row_len: int | None = None) -> SlotStream | SamplePackedStream:
    """A slot's stream: one example per row, or packed rows of ``row_len`` tokens (default: the longest
    example)."""
    if not sample_packing:
        return SlotStream(examples, micro_batch, seed)
    return SamplePackedStream(examples, micro_batch, seed, row_len or max(len(e.input_ids) for e in examples))


def batches_per_epoch(examples: Sequence[Example], micro_batch: int, *, sample_packing: bool = False,
                      row_len: int | None = None, seed: int = 0) -> int:
    """Micro-batches in one pass over ``examples`` (rows of the first epoch's packing when packed)."""
    rows = len(examples)
    if sample_packing:
        stream = SamplePackedStream(examples, micro_batch, seed, row_len or max(len(e.input_ids) for e in examples))
        rows = len(stream.epoch_rows(0))
    return -(-rows // micro_batch)


def check_family(config: Any) -> None:
    """Refuse sample packing on a model family it was not verified for.

    Raises:
        ConfigError: ``config.model_type`` is not in ``VERIFIED_FAMILIES``.
    """
    family = getattr(config, "model_type", None)
    if family not in VERIFIED_FAMILIES:
        raise ConfigError(f"sample_packing: not verified for model family {family!r} "
                          f"(verified: {', '.join(VERIFIED_FAMILIES)}); set sample_packing: false")
