"""The step's loss through the frozen head (``packer.model.store.head_losses``) equals ``slot_losses``
on
full logits; which models take it (``fused_loss_head``); the Triton step uses it and starts where the
torch step (full logits) does."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch import nn

from lora_sweep.packer.data.batch import IGNORE_INDEX
from lora_sweep.packer.model.load import load_base
from lora_sweep.packer.model.store import fused_loss_head, head_losses, shift_targets, slot_losses
from lora_sweep.packer.step import loop
from tests.conftest import need_triton

need_triton()  # before anything imports the Triton kernel modules

from tests.helpers import LLAMA_SPECS, run_packed, slot_jobs  # noqa: E402


def test_shift_targets_predicts_the_next_label_and_nothing_at_the_last_position() -> None:
    labels = torch.tensor([[5, 6, 7], [IGNORE_INDEX, 8, 9]])
    assert shift_targets(labels).tolist() == [6, 7, IGNORE_INDEX, 8, 9, IGNORE_INDEX]


def _batch(vocab: int, hidden_size: int, capacity: int = 3, rows: int = 2, seq: int = 9):
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(capacity * rows, seq, hidden_size, generator=gen)
    labels = torch.randint(0, vocab, (capacity * rows, seq), generator=gen)
    labels[:, :3] = IGNORE_INDEX  # prompts
    labels[2:4] = IGNORE_INDEX  # slot 1: padding rows only
    return hidden, labels


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_head_losses_equal_slot_losses_on_full_logits(tiny_dirs, impl: str) -> None:
    model, _ = load_base(str(tiny_dirs("llama")))
    head = fused_loss_head(model.requires_grad_(False))  # frozen, as PackedModel freezes its base
    assert head is model.get_output_embeddings()
    hidden, labels = _batch(head.out_features, head.in_features)
    x = hidden.clone().requires_grad_()
    losses, counts = head_losses(x, head, labels, 3, impl=impl)
    (losses * torch.tensor([1.0, 2.0, -0.5])).sum().backward()
    y = hidden.clone().requires_grad_()
    want, want_counts = slot_losses(head(y), labels, 3)
    (want * torch.tensor([1.0, 2.0, -0.5])).sum().backward()
    assert counts.tolist() == want_counts.tolist() and counts[1] == 0
    torch.testing.assert_close(losses, want, rtol=1e-6, atol=1e-6)  # fp32: the same sums in another order
    torch.testing.assert_close(x.grad, y.grad, rtol=1e-5, atol=1e-7)


def test_models_whose_logits_are_not_the_heads_output_keep_full_logits(tiny_dirs) -> None:
    model, _ = load_base(str(tiny_dirs("llama")))
    model.requires_grad_(False)
    assert fused_loss_head(model) is model.lm_head
    model.config.final_logit_softcapping = 30.0  # Gemma-2's soft-capping: logits = cap * tanh(head(h) / cap)
    assert fused_loss_head(model) is None
    model.config.final_logit_softcapping = None
    model.lm_head.weight.requires_grad_(True)  # a head that trains: its weight gradient is not computed
    assert fused_loss_head(model) is None

    class Bare(nn.Module):  # logits from forward, no decoder body to run without the head
        def __init__(self) -> None:
            super().__init__()
            self.lm_head = nn.Linear(4, 8)

        def get_output_embeddings(self) -> nn.Module:
            return self.lm_head

    assert fused_loss_head(Bare().requires_grad_(False)) is None


@pytest.mark.slow  # ~20 s: two steps in the Triton interpreter
def test_triton_step_with_the_fused_loss_equals_full_logits(tiny_dirs, monkeypatch: pytest.MonkeyPatch) -> None:
    """The Triton step, its loss through the fused head, equals the torch step, on full logits:
    both steps' losses and the adapters after them (so the gradient the fused loss sends back is the same)."""
    calls = []
    fused = loop.head_losses

    def spy(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        calls.append(args[1])
        return fused(*args, **kwargs)

    monkeypatch.setattr(loop, "head_losses", spy)
    specs = [replace(LLAMA_SPECS[1], max_steps=2), replace(LLAMA_SPECS[2], max_steps=2)]
    triton_losses, triton_final = run_packed(tiny_dirs("llama"), slot_jobs(specs), 2, impl="triton")
    assert calls and all(isinstance(h, nn.Linear) for h in calls)
    torch_losses, torch_final = run_packed(tiny_dirs("llama"), slot_jobs(specs), 2, impl="torch")
    for key, losses in torch_losses.items():
        torch.testing.assert_close(torch.tensor(triton_losses[key]), torch.tensor(losses), rtol=1e-5, atol=0)
        for path, (a, b) in torch_final[key].items():
            torch.testing.assert_close(triton_final[key][path][0], a, rtol=0, atol=1e-5)
            torch.testing.assert_close(triton_final[key][path][1], b, rtol=0, atol=1e-5)
            assert b.abs().max() > 0
