"""DoRA in the pack (torch path): a slot with a trained magnitude per output column, beside plain and LoRA+ slots over
the one base, ends where PEFT's ``use_dora=True`` trained alone ends on the same batches (fp64, losses and A, B; the
magnitudes move the losses, and ``test_dora_checkpoint`` holds the saved ones to PEFT's logits); ``test_dora_triton``
holds the Triton step to this one."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from tests import helpers as eq

MIXED = {  # llama's last slot: DoRA with dropout (PEFT's DoRA term on the dropped input; the oracle draws the
    # engine's masks, ``tests.helpers.run_peft``), beside a plain slot with dropout
    "llama": [replace(eq.LLAMA_SPECS[0], dora=True), replace(eq.LLAMA_SPECS[2], dropout=0.2),
              replace(eq.LLAMA_SPECS[1], dora=True, lr=2e-3, lr_ratio=4.0),
              replace(eq.LLAMA_SPECS[3], dora=True, dropout=0.1)],
    "gpt2": [replace(eq.GPT2_SPECS[0], dora=True), eq.GPT2_SPECS[1], replace(eq.GPT2_SPECS[3], dora=True, rslora=True)],
}


@pytest.mark.parametrize("family", list(MIXED))
def test_dora_slots_in_a_mixed_pack_equal_peft(tiny_dirs, family: str) -> None:
    model_dir = tiny_dirs(family)
    with eq.default_dtype(torch.float64):
        losses, final = eq.run_packed(model_dir, eq.slot_jobs(MIXED[family]), capacity=len(MIXED[family]))
        for job in eq.slot_jobs(MIXED[family]):
            eq.assert_trained_as_peft(model_dir, job, losses, final)


def test_a_dora_slot_moved_to_a_larger_bucket_trains_on_as_alone(tiny_dirs) -> None:
    """A later job's rank 32 outgrows the pack's bucket of 16: the live DoRA slot moves to the new store with its
    magnitudes, moments and flags (``SlotStore.copy_slot_from``) and ends where it ends alone."""
    dora = replace(eq.LLAMA_SPECS[0], dora=True, max_steps=8)
    short = replace(eq.LLAMA_SPECS[2], max_steps=3)  # ends at step 3; the wide job takes its slot then
    wide = replace(eq.LLAMA_SPECS[2], rank=32, alpha=32, targets=("q_proj", "o_proj"), max_steps=4)
    model_dir = tiny_dirs("llama")
    with eq.default_dtype(torch.float64):
        moved, _ = eq.run_packed(model_dir, eq.slot_jobs([dora, short, wide]), capacity=2)
        assert len(moved[2]) == 4
        alone, _ = eq.run_packed(model_dir, eq.slot_jobs([dora]), capacity=1)
    torch.testing.assert_close(torch.tensor(moved[0]), torch.tensor(alone[0]), rtol=1e-6, atol=0)
