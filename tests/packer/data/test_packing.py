"""Sample packing: an example in a packed row has the loss and gradient it has in its own row."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from lora_sweep.errors import ConfigError
from lora_sweep.packer.data.batch import collate
from lora_sweep.packer.data.packing import (
    VERIFIED_FAMILIES,
    PackedRow,
    SamplePackedStream,
    batches_per_epoch,
    pack_rows,
)
from lora_sweep.packer.data.rows import Example, SlotStream
from lora_sweep.packer.model.load import load_base
from lora_sweep.packer.model.packed import PackedModel
from lora_sweep.packer.plan import AdapterSpec
from lora_sweep.packer.step.train import SlotJob, target_tokens, train
from tests.conftest import Recorder, random_examples

PAD = 0
ROW = 48


def _split(row: PackedRow) -> list[Example]:
    """The examples of a packed row, each as it would sit in its own row."""
    starts = [i for i, p in enumerate(row.position_ids) if p == 0] + [len(row.input_ids)]
    return [Example(row.input_ids[a:b], row.labels[a:b]) for a, b in zip(starts, starts[1:], strict=False)]


class _Unpacked:
    """The examples of a packed stream's micro-batches, one example per row."""

    def __init__(self, packed: SamplePackedStream) -> None:
        self.packed = packed

    def next_batch(self) -> list[Example]:
        return [e for row in self.packed.next_batch() for e in _split(row)]


def test_pack_rows_keeps_every_example_and_its_trained_tokens() -> None:
    examples = random_examples(30, seed=1)
    rows = pack_rows(examples, ROW)
    assert sum(r.n_examples for r in rows) == 30 and all(len(r.input_ids) <= ROW for r in rows)
    assert [e.input_ids for r in rows for e in _split(r)] == [e.input_ids for e in examples]
    assert sum(map(target_tokens, rows)) == sum(map(target_tokens, examples))
    assert len(rows) < 30 / 2  # short rows really share rows
    assert batches_per_epoch(examples, 2, sample_packing=True, row_len=ROW) == -(-len(rows) // 2)
    with pytest.raises(ValueError, match="does not fit"):
        pack_rows(examples, 10)


def test_stream_state_round_trips() -> None:
    a = SamplePackedStream(random_examples(30, seed=1), 3, seed=5, row_len=ROW)
    for _ in range(4):
        a.next_batch()
    b = SamplePackedStream(random_examples(30, seed=1), 3, seed=5, row_len=ROW)
    b.load_state_dict(a.state_dict())
    assert a.next_batch() == b.next_batch()


@pytest.mark.parametrize("family", VERIFIED_FAMILIES)  # the tiny families are named by their model_type
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_packed_row_logits_equal_each_example_in_its_own_row(tiny_dirs, family: str, attn: str) -> None:
    model, _ = load_base(str(tiny_dirs(family)), attn_implementation=attn)
    assert model.config.model_type == family
    pm = PackedModel(model)
    vocab = min(300, model.config.vocab_size)
    rows = pack_rows(random_examples(12, seed=2, vocab=vocab), ROW)[:3]
    assert all(r.n_examples >= 2 for r in rows)
    plain = [random_examples(1, seed=9, vocab=vocab)[0]]  # an unpacked row in the same batch stays as it was
    b = collate([0, 1], [rows, plain], PAD, dropout=[0.0, 0.0], seeds=[0, 0])
    logits = pm.forward(b.input_ids, b.attention_mask, None, b.position_ids)
    for i, row in enumerate(rows):
        at = 0
        for ex in _split(row):
            alone = collate([0], [[ex]], PAD, dropout=[0.0], seeds=[0])
            ref = pm.forward(alone.input_ids, alone.attention_mask, None)[0]
            torch.testing.assert_close(logits[i, at:at + len(ex.input_ids)], ref, rtol=1e-5, atol=1e-5)
            at += len(ex.input_ids)
    alone = collate([0], [plain], PAD, dropout=[0.0], seeds=[0])
    n = len(plain[0].input_ids)
    torch.testing.assert_close(logits[3, :n], pm.forward(alone.input_ids, alone.attention_mask, None)[0, :n],
                               rtol=1e-5, atol=1e-5)


SPEC = AdapterSpec(rank=4, alpha=8, lr=5e-3, micro_batch=2, max_steps=8, seed=3, sample_packing=True,
                   targets=("q_proj", "v_proj", "down_proj"), gradient_accumulation_steps=2)


def _train(model_dir, jobs):  # noqa: ANN001, ANN202
    model, _ = load_base(str(model_dir), attn_implementation="sdpa")
    pm = PackedModel(model)
    queue, rec = list(jobs), Recorder(pm)
    result = train(pm, len(jobs), lambda slot: queue.pop(0) if queue else None, pad_id=PAD, on_step=rec.on_step,
                   on_end=rec.on_end)
    assert result.step == "eager"
    return rec.losses, rec.final


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_sample_packed_slot_trains_as_its_examples_unpacked(tiny_dirs, family: str) -> None:
    """Per-step losses within 1e-5 relative and the same final adapter, with accumulation (dropout off: its
    masks are drawn per row layout, so a packed row draws other masks than the rows it replaces); an
    unpacked slot beside it is unchanged. On the step the packed rows' positions are a block of its
    tables and the whole batch (padding rows and the unpacked slot's rows too) goes without a padding mask."""
    examples = random_examples(40, seed=4)
    plain_spec = AdapterSpec(rank=2, lr=1e-2, micro_batch=2, max_steps=8, seed=1)

    def jobs(packed: bool) -> list[SlotJob]:
        stream = SamplePackedStream(examples, SPEC.micro_batch, SPEC.seed, ROW)
        job = SlotJob(SPEC, stream, key=0) if packed else SlotJob(replace(SPEC, sample_packing=False),
                                                                  _Unpacked(stream), key=0)
        return [job, SlotJob(plain_spec, SlotStream(random_examples(20, seed=5), 2, seed=1), key=1)]

    packed_losses, packed_final = _train(tiny_dirs(family), jobs(True))
    ref_losses, ref_final = _train(tiny_dirs(family), jobs(False))
    alone_losses, _ = _train(tiny_dirs(family), jobs(False)[1:])
    for key in (0, 1):
        assert len(packed_losses[key]) == 8
        torch.testing.assert_close(torch.tensor(packed_losses[key]), torch.tensor(ref_losses[key]), rtol=1e-5, atol=0)
    torch.testing.assert_close(torch.tensor(packed_losses[1]), torch.tensor(alone_losses[1]), rtol=1e-5, atol=0)
    for path, (a, b) in packed_final[0].items():
        assert b.abs().max() > 0
        # the summation order differs (other row shapes); Adam's normalised update lifts such rounding on
        # near-zero gradients to ~1e-5, hence the PEFT oracle's tolerance (test_equivalence)
        torch.testing.assert_close(a, ref_final[0][path][0], rtol=0, atol=1e-4)
        torch.testing.assert_close(b, ref_final[0][path][1], rtol=0, atol=1e-4)


def test_unverified_family_is_refused(tiny_dirs) -> None:
    stream = SamplePackedStream(random_examples(10, seed=4), 1, 0, ROW)
    with pytest.raises(ConfigError, match="sample_packing: not verified for model family 'opt'"):
        _train(tiny_dirs("opt"), [SlotJob(replace(SPEC, targets=("q_proj",)), stream)])


def test_opt_would_be_wrong_packed(tiny_dirs) -> None:
    """Why OPT is refused: its positions ignore position_ids, so a packed example sees other logits."""
    model, _ = load_base(str(tiny_dirs("opt")), attn_implementation="eager")
    pm = PackedModel(model)
    row = pack_rows(random_examples(12, seed=2), ROW)[0]
    second = _split(row)[1]
    b = collate([0], [[row]], PAD, dropout=[0.0], seeds=[0])
    alone = collate([0], [[second]], PAD, dropout=[0.0], seeds=[0])
    at = len(_split(row)[0].input_ids)
    packed = pm.forward(b.input_ids, b.attention_mask, None, b.position_ids)[0, at:at + len(second.input_ids)]
    assert not torch.allclose(packed, pm.forward(alone.input_ids, alone.attention_mask, None)[0], atol=1e-3)
