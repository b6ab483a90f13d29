"""The training step's precompile (``capture.precompile`` of the whole step, before its first run): it asks for every
kernel variant the step launches, launches none, and leaves the pack's weights, gradients and moments as they
were."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import need_triton

need_triton()  # before anything imports the Triton kernel modules

import lora_sweep.packer.step.train  # noqa: E402
from lora_sweep.packer.model.load import load_base  # noqa: E402
from lora_sweep.packer.model.packed import PackedModel  # noqa: E402
from lora_sweep.packer.plan import AdapterSpec  # noqa: E402
from lora_sweep.packer.step.train import FixedBatch, SlotJob, train  # noqa: E402
from tests.conftest import random_examples, record_launches  # noqa: E402


def test_precompile_covers_the_first_step_and_touches_no_slot(tiny_dirs, monkeypatch) -> None:
    """Qwen2 (biased q/k/v projections beside unbiased ones), three slots of different ranks and targets,
    one with dropout: one training step."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model, _ = load_base(str(tiny_dirs("qwen2")), device=device)
    pm = PackedModel(model, impl="triton")
    specs = [AdapterSpec(rank=4, targets=("all-linear",), max_steps=1, seed=1),
             AdapterSpec(rank=8, targets=("q_proj", "v_proj"), dropout=0.1, max_steps=1, seed=2),
             AdapterSpec(rank=2, targets=("down_proj",), max_steps=1, seed=3)]
    jobs = [SlotJob(s, FixedBatch(random_examples(2, i)), key=i) for i, s in enumerate(specs)]
    calls = record_launches(monkeypatch)
    snapshots = []
    real = lora_sweep.packer.step.train.precompile

    def checked(step) -> None:  # noqa: ANN001  (the store's buffers around the call)
        store = pm.store
        before = [t.clone() for t in (store.flat, store.grad, store.exp_avg, store.exp_avg_sq)]
        real(step)
        snapshots.append((before, [t.clone() for t in (store.flat, store.grad, store.exp_avg, store.exp_avg_sq)]))

    monkeypatch.setattr(lora_sweep.packer.step.train, "precompile", checked)
    train(pm, 3, lambda s: jobs.pop(0) if jobs else None, pad_id=0)
    warm = {v for inside, v in calls if inside}
    real = {v for inside, v in calls if not inside}
    assert len(snapshots) == 1, "once, before the first step"
    assert real and real <= warm, real - warm
    before, after = snapshots[0]
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))


def test_a_failed_precompile_warns_and_training_goes_on(tiny_dirs, monkeypatch) -> None:
    """Precompiling is an optimisation: if it fails (say, a Triton whose warm-up API differs), the step
    compiles its kernels as it launches them, as without it."""
    from lora_sweep.kernels import ops

    def broken(run: object) -> None:
        raise AttributeError("no warmup here")

    monkeypatch.setattr(ops, "precompile", broken)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model, _ = load_base(str(tiny_dirs("qwen2")), device=device)
    pm = PackedModel(model, impl="triton")
    jobs = [SlotJob(AdapterSpec(rank=4, targets=("all-linear",), max_steps=1), FixedBatch(random_examples(2, 0)))]
    with pytest.warns(UserWarning, match="precompile failed.*AttributeError: no warmup here"):
        result = train(pm, 1, lambda s: jobs.pop(0) if jobs else None, pad_id=0)
    assert result.steps == 1 and result.jobs_started == 1
