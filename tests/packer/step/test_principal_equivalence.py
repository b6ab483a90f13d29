"""PiSSA / OLoRA in the pack: a slot started from the base weight's principal part, beside plain slots over the one
unmodified base, ends where PEFT's ``init_lora_weights="pissa"`` / ``"olora"`` (which rewrites the base to W_res)
ends on the same batches; the torch step and the per-slot loop agree."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from tests.helpers import (
    GPT2_SPECS,
    LLAMA_SPECS,
    assert_trained_as_peft,
    run_packed,
    slot_jobs,
)

MIXED = {
    "llama": [replace(LLAMA_SPECS[0], init="pissa"), LLAMA_SPECS[2],
              replace(LLAMA_SPECS[1], init="olora", lr=2e-3, lr_ratio=4.0)],
    "gpt2": [replace(GPT2_SPECS[0], init="pissa"), replace(GPT2_SPECS[3], init="pissa", rslora=True, dora=True),
             GPT2_SPECS[1]],  # PiSSA under DoRA: the norm of W_res + s B A, the frozen rows' part of the sum
}


@pytest.mark.parametrize("family", list(MIXED))
def test_principal_slots_in_a_mixed_pack_equal_peft(tiny_dirs, family: str) -> None:
    """fp32: PEFT refuses to initialise PiSSA on an fp64 base (``pissa_init``: float32, float16 or bfloat16)."""
    model_dir = tiny_dirs(family)
    losses, final = run_packed(model_dir, slot_jobs(MIXED[family]), capacity=3)
    for job in slot_jobs(MIXED[family]):
        assert_trained_as_peft(model_dir, job, losses, final)


def test_loop_oracle_agrees_with_the_torch_step(tiny_dirs) -> None:
    dense = run_packed(tiny_dirs("llama"), slot_jobs(MIXED["llama"]), capacity=3, impl="torch")
    loop = run_packed(tiny_dirs("llama"), slot_jobs(MIXED["llama"]), capacity=3, impl="loop")
    for key in dense[0]:
        torch.testing.assert_close(torch.tensor(dense[0][key]), torch.tensor(loop[0][key]), rtol=1e-5, atol=0)

