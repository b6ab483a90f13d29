"""The core invariant: a slot trained in a pack ends where the same adapter trained alone ends.

The oracle is independent code (``tests.helpers``): PEFT on a fresh copy of the base model, torch AdamW, the
same scheduler formula and the same batches, with the loss computed by transformers itself.
"""

from __future__ import annotations

import pytest
import torch

from lora_sweep.packer.model.load import load_base
from lora_sweep.packer.model.packed import PackedModel
from lora_sweep.packer.plan import AdapterSpec
from lora_sweep.packer.step.train import SlotJob, train
from tests.conftest import Recorder
from tests.helpers import GPT2_SPECS, LLAMA_SPECS, PAD, STEPS, assert_trained_as_peft, run_packed, slot_jobs

OPT_SPECS = [  # OPT's decoder feeds fc1/fc2 flattened (B·L, D) tokens: both steps must route them by the pack's rows
    AdapterSpec(rank=2, alpha=4, lr=3e-3, micro_batch=2, targets=("fc1", "fc2"), max_steps=STEPS, seed=1),
    AdapterSpec(rank=4, alpha=16, lr=1e-2, micro_batch=3, targets=("all-linear",), max_steps=STEPS, seed=2,
                schedule="cosine", warmup_steps=3),
]


@pytest.mark.parametrize(("family", "specs"), [("llama", LLAMA_SPECS), ("gpt2", GPT2_SPECS), ("opt", OPT_SPECS)])
def test_packed_equals_peft_separately(tiny_dirs, family: str, specs: list[AdapterSpec]) -> None:
    model_dir = tiny_dirs(family)
    losses, final = run_packed(model_dir, slot_jobs(specs), capacity=len(specs))
    for job in slot_jobs(specs):
        assert_trained_as_peft(model_dir, job, losses, final)


def test_loop_and_dense_impls_agree(tiny_dirs) -> None:
    specs = LLAMA_SPECS[:3]
    dense = run_packed(tiny_dirs("llama"), slot_jobs(specs), capacity=3, impl="torch")
    loop = run_packed(tiny_dirs("llama"), slot_jobs(specs), capacity=3, impl="loop")
    for key in dense[0]:
        torch.testing.assert_close(torch.tensor(dense[0][key]), torch.tensor(loop[0][key]), rtol=1e-5, atol=0)


def _with(spec: AdapterSpec, **kw) -> AdapterSpec:
    from dataclasses import replace

    return replace(spec, **kw)


@pytest.mark.parametrize("impl", ["torch", "loop"])
def test_dropout_slot_in_pack_equals_alone(tiny_dirs, impl: str) -> None:
    """Packed == alone with dropout (each slot's masks from its own seed, whatever its rows in the step)."""
    specs = [_with(LLAMA_SPECS[0], dropout=0.1), _with(LLAMA_SPECS[1], dropout=0.3), LLAMA_SPECS[2]]
    packed_losses, packed_final = run_packed(tiny_dirs("llama"), slot_jobs(specs), capacity=3, impl=impl)
    for job in slot_jobs(specs)[:2]:
        alone_losses, alone_final = run_packed(tiny_dirs("llama"), [job], capacity=1, impl=impl)
        torch.testing.assert_close(torch.tensor(packed_losses[job.key]), torch.tensor(alone_losses[job.key]),
                                   rtol=1e-5, atol=0)
        for path, (a, b) in packed_final[job.key].items():
            torch.testing.assert_close(a, alone_final[job.key][path][0], rtol=0, atol=1e-5)
            torch.testing.assert_close(b, alone_final[job.key][path][1], rtol=0, atol=1e-5)
    # dropout really is on: the same slot without dropout trains differently
    plain = run_packed(tiny_dirs("llama"), [slot_jobs([LLAMA_SPECS[0]])[0]], capacity=1, impl=impl)[0]
    assert plain[0][1:] != packed_losses[0][1:]


def test_slot_started_mid_run_equals_fresh_run(tiny_dirs) -> None:
    short = _with(LLAMA_SPECS[0], max_steps=5)
    late = _with(LLAMA_SPECS[2], dropout=0.2, max_steps=12)
    specs = [short, LLAMA_SPECS[1], late]  # capacity 2: `late` starts in slot 0 at global step 5
    steps_at_start = {}
    jobs = slot_jobs(specs)
    model, _ = load_base(str(tiny_dirs("llama")), attn_implementation="eager")
    pm = PackedModel(model)
    queue = list(jobs)
    rec = Recorder(pm)

    def next_job(slot: int) -> SlotJob | None:
        if queue:
            steps_at_start[queue[0].key] = (slot, rec.global_step)
            return queue.pop(0)
        return None

    train(pm, 2, next_job, pad_id=PAD, on_step=rec.on_step, on_end=rec.on_end)
    losses, final = rec.losses, rec.final
    assert steps_at_start[2] == (0, 5), "the late job must have started in the freed slot mid-run"
    fresh_losses, fresh_final = run_packed(tiny_dirs("llama"), [slot_jobs(specs)[2]], capacity=1)
    torch.testing.assert_close(torch.tensor(losses[2]), torch.tensor(fresh_losses[2]), rtol=1e-5, atol=0)
    for path, (a, b) in final[2].items():
        torch.testing.assert_close(a, fresh_final[2][path][0], rtol=0, atol=1e-5)
        torch.testing.assert_close(b, fresh_final[2][path][1], rtol=0, atol=1e-5)
