"""``train(optimizer_in_backward=True)`` (torchtune's ``optimizer_in_bwd``) mapped onto the one training step: the
same updates as the whole-gradient step (it is that step), one warning that the gradient buffer is kept, and jobs the
option cannot train (clipping, accumulation) refused as before.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from lora_sweep.errors import ConfigError
from lora_sweep.packer.data.rows import SlotStream
from lora_sweep.packer.model.load import load_base
from lora_sweep.packer.model.packed import PackedModel
from lora_sweep.packer.plan import AdapterSpec
from lora_sweep.packer.step.train import SlotJob, train
from tests.conftest import Recorder, random_examples
from tests.helpers import assert_trained_as_peft

PAD = 0
STEPS = 6

SPECS = [  # heterogeneous: ranks, lrs, schedules, weight decay, micro-batches, targets, dropout on one; no clipping
    AdapterSpec(rank=2, alpha=4, lr=3e-3, micro_batch=1, targets=("q_proj", "v_proj"), max_steps=STEPS, seed=1,
                max_grad_norm=None),
    AdapterSpec(rank=4, alpha=16, lr=1e-2, micro_batch=2, targets=("all-linear",), max_steps=STEPS + 2, seed=2,
                rslora=True, weight_decay=0.1, warmup_steps=3, schedule="cosine", max_grad_norm=None, dropout=0.2),
    AdapterSpec(rank=8, alpha=8, lr=5e-3, micro_batch=3, targets=("o_proj", "down_proj"), max_steps=STEPS, seed=3,
                schedule="linear", warmup_steps=2, max_grad_norm=None, betas=(0.8, 0.95)),
]


def slot_jobs(specs: list[AdapterSpec]) -> list[SlotJob]:
    return [SlotJob(spec, SlotStream(random_examples(40, seed=100 + i), spec.micro_batch, seed=spec.seed), key=i)
            for i, spec in enumerate(specs)]


def _run(model_dir, jobs: list[SlotJob], capacity: int, in_backward: bool):  # noqa: ANN001, ANN202
    model, _ = load_base(str(model_dir), attn_implementation="eager")
    pm = PackedModel(model, impl="torch")
    queue = list(jobs)
    rec = Recorder(pm)
    norms: list[float] = []

    def on_step(reports) -> None:  # noqa: ANN001
        rec.on_step(reports)
        norms.extend(r.grad_norm for r in reports)

    train(pm, capacity, lambda slot: queue.pop(0) if queue else None, pad_id=PAD, on_step=on_step, on_end=rec.on_end,
          optimizer_in_backward=in_backward)
    return rec.losses, rec.final, norms


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_optimizer_in_backward_equals_the_whole_gradient_step_and_says_so(tiny_dirs, family: str) -> None:
    specs = SPECS if family == "llama" else [replace(s, targets=("all-linear",)) for s in SPECS[:2]]
    ref = _run(tiny_dirs(family), slot_jobs(specs), len(specs), False)
    with pytest.warns(UserWarning, match="optimizer_in_backward: the training step keeps its preallocated fp32 "
                                         "gradient buffer") as caught:
        ours = _run(tiny_dirs(family), slot_jobs(specs), len(specs), True)
    assert len([w for w in caught if "optimizer_in_backward" in str(w.message)]) == 1
    for key in range(len(specs)):
        assert len(ours[0][key]) >= STEPS
        assert ours[0][key] == ref[0][key]
        for path, (wa, wb) in ours[1][key].items():
            assert wb.abs().max() > 0, "B never moved: the test would not see a wrong update"
            assert torch.equal(wa, ref[1][key][path][0]) and torch.equal(wb, ref[1][key][path][1])
    assert ours[2] == ref[2]  # reported gradient norms


def test_optimizer_in_backward_equals_peft(tiny_dirs) -> None:
    job = slot_jobs([replace(SPECS[1], dropout=0.0)])[0]
    with pytest.warns(UserWarning, match="optimizer_in_backward"):
        losses, final, _ = _run(tiny_dirs("llama"), [job], 1, True)
    assert_trained_as_peft(tiny_dirs("llama"), slot_jobs([replace(SPECS[1], dropout=0.0)])[0], losses, final,
                           min_steps=STEPS)


@pytest.mark.parametrize(("change", "key"), [({"max_grad_norm": 1.0}, "max_grad_norm"),
                                             ({"gradient_accumulation_steps": 2}, "gradient_accumulation_steps")])
def test_clipping_and_accumulation_are_refused(tiny_dirs, change: dict, key: str) -> None:
    job = slot_jobs([replace(SPECS[0], **change)])[0]
    with pytest.raises(ConfigError, match=f"^optimizer_in_backward: needs {key}: "), pytest.warns(UserWarning):
        _run(tiny_dirs("llama"), [job], 1, True)


def test_planner_calibrates_the_gradient_buffer_it_keeps(tiny_dirs) -> None:
    """The memory model measured with the option is the one measured without: the gradient buffer is kept (the
    planner must not count on the 4 B per adapter parameter the option would save)."""
    from lora_sweep.packer.plan import ADAPTER_BYTES_PER_PARAM
    from lora_sweep.packer.probe import calibrate

    model, _ = load_base(str(tiny_dirs("llama")), attn_implementation="eager")
    pm = PackedModel(model, impl="torch")
    off = calibrate(pm, 32, rows=(1, 3))
    with pytest.warns(UserWarning, match="optimizer_in_backward"):
        on = calibrate(pm, 32, rows=(1, 3), optimizer_in_backward=True)
    assert on.optimizer_in_backward and not off.optimizer_in_backward
    assert on.bytes_per_param == pytest.approx(off.bytes_per_param, rel=1e-9)
    assert on.bytes_per_param >= ADAPTER_BYTES_PER_PARAM
