"""Gradient accumulation per slot: micro-batch m x accumulation k is one batch of m*k examples.

The oracle is PEFT + torch AdamW stepping once per batch of m*k examples, its loss the mean over
all their target tokens (what transformers computes with ``num_items_in_batch``). The step runs eagerly here on
the CPU; its k is data in the step's tables.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from lora_sweep.packer.data.rows import SlotStream
from lora_sweep.packer.model.load import load_base
from lora_sweep.packer.model.packed import PackedModel
from lora_sweep.packer.plan import AdapterSpec
from lora_sweep.packer.step.train import SlotJob, train
from tests.conftest import Recorder, random_examples
from tests.helpers import initial_a, run_peft

PAD = 0
STEPS = 6


def _packed(model_dir, jobs, capacity):  # noqa: ANN001, ANN202
    model, _ = load_base(str(model_dir), attn_implementation="eager")
    pm = PackedModel(model)
    queue = list(jobs)
    rec = Recorder(pm)
    steps: dict = {}

    def on_step(reports) -> None:  # noqa: ANN001
        rec.on_step(reports)
        for r in reports:
            steps.setdefault(r.key, []).append((r.step, r.slot_step, r.tokens))

    result = train(pm, capacity, lambda slot: queue.pop(0) if queue else None, pad_id=PAD, on_step=on_step,
                   on_end=rec.on_end, readback_every=5)
    assert result.step == "eager"
    return rec.losses, rec.final, steps


def _stream(spec: AdapterSpec, data_seed: int, micro: int | None = None) -> SlotStream:
    return SlotStream(random_examples(40, seed=data_seed), micro or spec.micro_batch, seed=spec.seed)


def _assert_same(losses, final, key, ref_losses, ref_weights) -> None:  # noqa: ANN001
    assert len(losses[key]) == len(ref_losses) >= 5
    torch.testing.assert_close(torch.tensor(losses[key]), torch.tensor(ref_losses), rtol=1e-5, atol=0)
    for path, (a, b) in final[key].items():
        assert b.abs().max() > 0
        torch.testing.assert_close(a, ref_weights[path][0], rtol=0, atol=1e-5)
        torch.testing.assert_close(b, ref_weights[path][1], rtol=0, atol=1e-5)


ACC = AdapterSpec(rank=4, alpha=8, lr=5e-3, micro_batch=2, gradient_accumulation_steps=4, max_steps=STEPS, seed=3,
                  targets=("q_proj", "v_proj", "down_proj"), schedule="cosine", warmup_steps=2, max_grad_norm=0.1,
                  weight_decay=0.01)


def test_micro_2_by_accumulation_4_equals_one_batch_of_8(tiny_dirs) -> None:
    model_dir = tiny_dirs("llama")
    losses, final, steps = _packed(model_dir, [SlotJob(ACC, _stream(ACC, 100), key=0)], capacity=1)
    # one report per optimizer step, after every 4th micro-batch
    assert [(s, k) for s, k, _ in steps[0]] == [(4 * i + 3, i + 1) for i in range(STEPS)]
    one_batch = replace(ACC, micro_batch=8, gradient_accumulation_steps=1)
    ref_losses, ref_weights, _ = run_peft(model_dir, one_batch, _stream(ACC, 100, micro=8),
                                          initial_a(model_dir, one_batch))
    _assert_same(losses, final, 0, ref_losses, ref_weights)


def test_accumulated_gradient_is_independent_of_the_split(tiny_dirs) -> None:
    model_dir = tiny_dirs("llama")
    splits = [replace(ACC, micro_batch=m, gradient_accumulation_steps=k) for m, k in ((8, 1), (4, 2), (1, 8))]
    runs = [_packed(model_dir, [SlotJob(sp, _stream(sp, 100), key=0)], capacity=1) for sp in splits]
    for losses, final, _ in runs[1:]:
        _assert_same(losses, final, 0, runs[0][0][0], runs[0][1][0])


def test_heterogeneous_accumulation_in_one_pack(tiny_dirs) -> None:
    """Slots with accumulation 1, 3 and 4 share a pack; each equals PEFT on its own effective batches."""
    model_dir = tiny_dirs("llama")
    specs = [replace(ACC, micro_batch=2, gradient_accumulation_steps=1, seed=1, max_steps=10),
             replace(ACC, micro_batch=1, gradient_accumulation_steps=3, seed=2, dropout=0.0, lr=1e-2),
             ACC]
    jobs = [SlotJob(sp, _stream(sp, 200 + i), key=i) for i, sp in enumerate(specs)]
    losses, final, steps = _packed(model_dir, jobs, capacity=3)
    assert [s for s, _, _ in steps[1]] == [3 * i + 2 for i in range(STEPS)]
    assert [s for s, _, _ in steps[0]] == list(range(10))
    for i, sp in enumerate(specs):
        one = replace(sp, micro_batch=sp.micro_batch * sp.gradient_accumulation_steps, gradient_accumulation_steps=1)
        ref = run_peft(model_dir, one, _stream(sp, 200 + i, micro=one.micro_batch), initial_a(model_dir, one))
        _assert_same(losses, final, i, ref.losses, ref.weights)


def test_reported_tokens_are_the_whole_steps_target_tokens(tiny_dirs) -> None:
    _, _, steps = _packed(tiny_dirs("llama"), [SlotJob(ACC, _stream(ACC, 100), key=0)], capacity=1)
    stream = _stream(ACC, 100)
    expected = []
    for _ in range(STEPS):
        rows = [r for _ in range(4) for r in stream.next_batch()]
        expected.append(sum(sum(1 for x in r.labels[1:] if x != -100) for r in rows))
    assert [t for _, _, t in steps[0]] == expected
