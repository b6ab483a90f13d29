"""The adapter variants on a real pretrained model: SmolLM2-135M-Instruct, fp64, CPU, one mixed pack.

A DoRA slot, a LoRA+ slot, a PiSSA slot and an OLoRA slot (ranks, learning rates, targets and clipping differ) train
as one pack over the one unmodified base on the demo task's rows; each must end where PEFT's same config
(``use_dora``, ``create_loraplus_optimizer``, ``init_lora_weights="pissa"`` / ``"olora"``) trained alone with torch
AdamW ends: per-step losses and final A and B (``tests.helpers.assert_trained_as_peft``). PEFT initialises PiSSA and
OLoRA in fp32 only; its residual base is formed again in fp64 there (``tests.helpers.run_peft``), so both sides run
PEFT's math in fp64, as ``test_smollm2_vs_peft`` does for plain LoRA (whose docstring says why not fp32).
"""

from __future__ import annotations

import pytest

from lora_sweep.packer.plan import AdapterSpec

pytestmark = pytest.mark.real_model

STEPS = 4
SPECS = [
    AdapterSpec(rank=4, alpha=8, lr=2e-3, micro_batch=2, targets=("q_proj", "v_proj", "down_proj"), max_steps=STEPS,
                seed=1, dora=True, max_grad_norm=0.5),
    AdapterSpec(rank=4, alpha=16, lr=1e-3, micro_batch=2, targets=("all-linear",), max_steps=STEPS, seed=2,
                lr_ratio=8.0, weight_decay=0.1, warmup_steps=2, schedule="cosine"),
    AdapterSpec(rank=8, alpha=8, lr=2e-4, micro_batch=2, targets=("o_proj", "up_proj"), max_steps=STEPS, seed=3,
                init="pissa", max_grad_norm=None),
    AdapterSpec(rank=8, alpha=16, lr=2e-4, micro_batch=2, targets=("q_proj", "gate_proj"), max_steps=STEPS, seed=4,
                init="olora", schedule="linear", warmup_steps=1),
]


def test_each_variant_in_a_mixed_pack_equals_peft_on_smollm2(pack_equals_peft) -> None:  # noqa: ANN001
    pack_equals_peft(SPECS, STEPS)
