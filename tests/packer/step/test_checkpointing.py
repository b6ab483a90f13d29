"""Activation checkpointing trains exactly as the plain path: same losses and weights, LoRA dropout included (the
recompute runs inside the step's backward, on its tables)."""

from __future__ import annotations

import pytest
import torch

from lora_sweep.packer.data.rows import SlotStream
from lora_sweep.packer.model.layer import PackedLoRALinear
from lora_sweep.packer.model.load import load_base
from lora_sweep.packer.model.packed import PackedModel
from lora_sweep.packer.plan import AdapterSpec
from lora_sweep.packer.step.train import SlotJob, train
from tests.conftest import Recorder, random_examples

PAD = 0
STEPS = 8
TARGETS = {"llama": ("q_proj", "v_proj", "up_proj"), "gpt2": ("c_attn", "c_fc")}


def _jobs(family: str) -> list[SlotJob]:
    t = TARGETS[family]
    specs = [AdapterSpec(rank=2, alpha=4, lr=1e-2, micro_batch=1, targets=t, max_steps=STEPS, seed=1, dropout=0.3),
             AdapterSpec(rank=4, alpha=8, lr=5e-3, micro_batch=3, targets=t[-1:], max_steps=STEPS, seed=2),
             AdapterSpec(rank=8, alpha=8, lr=2e-3, micro_batch=2, targets=t[:1], max_steps=STEPS - 3, seed=3,
                         dropout=0.1)]
    return [SlotJob(spec, SlotStream(random_examples(30, seed=100 + i), spec.micro_batch, seed=spec.seed), key=i)
            for i, spec in enumerate(specs)]


def _train(model_dir, family: str, **options):
    """Losses per key, final flat weights per key, and how many times the adapted layers ran forward."""
    pm = PackedModel(load_base(str(model_dir), attn_implementation="eager")[0])
    queue = _jobs(family)
    # a slot's weights as one flat vector (on the step they are rows of the store, not a buffer of its own)
    rec = Recorder(pm, snapshot=lambda slot: torch.cat([t.detach().flatten() for t in pm.slot_parameters(slot)]))
    calls = [0]

    def count(module, args, out) -> None:
        calls[0] += 1

    pm.add_slot(0, AdapterSpec(rank=1, targets=TARGETS[family]))  # wrap the projections, to hook the targeted ones
    for path in pm.slot_paths[0]:
        pm.layers[path].register_forward_hook(count)
    pm.remove_slot(0)
    train(pm, 2, lambda slot: queue.pop(0) if queue else None, pad_id=PAD, on_step=rec.on_step, on_end=rec.on_end,
          **options)
    return rec.losses, rec.final, calls[0]


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_checkpointing_equals_plain(tiny_dirs, family: str) -> None:
    ref_losses, ref_final, ref_calls = _train(tiny_dirs(family), family)
    losses, final, calls = _train(tiny_dirs(family), family, activation_checkpointing=True)
    # every adapted layer ran again in the backward (the checkpointing is real), with the same layout and masks
    assert calls == 2 * ref_calls
    for key, curve in ref_losses.items():
        assert len(curve) == _jobs(family)[key].spec.max_steps
        torch.testing.assert_close(torch.tensor(losses[key]), torch.tensor(curve), rtol=1e-5, atol=0)
        torch.testing.assert_close(final[key], ref_final[key], rtol=0, atol=1e-5)


def test_checkpointing_with_chunked_ce(tiny_dirs) -> None:
    ref_losses, ref_final, _ = _train(tiny_dirs("llama"), "llama")
    losses, final, _ = _train(tiny_dirs("llama"), "llama", activation_checkpointing=True, chunked_ce=5)
    for key, curve in ref_losses.items():
        torch.testing.assert_close(torch.tensor(losses[key]), torch.tensor(curve), rtol=1e-5, atol=0)
        torch.testing.assert_close(final[key], ref_final[key], rtol=0, atol=1e-5)


def test_base_stays_in_eval_mode(tiny_dirs) -> None:
    pm = PackedModel(load_base(str(tiny_dirs("gpt2")))[0])  # GPT-2's config has dropout 0.1 everywhere
    pm.set_activation_checkpointing(True)
    dropouts = [m for m in pm.model.modules() if isinstance(m, torch.nn.Dropout)]
    assert dropouts and not any(m.training for m in dropouts)
    assert not any(m.training for m in pm.model.modules() if isinstance(m, PackedLoRALinear))
    pm.set_activation_checkpointing(False)
    assert not any(m.training for m in pm.model.modules())
