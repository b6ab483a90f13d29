"""LoRA+ in the pack: a slot whose B learns at ``lr * lr_ratio`` ends where PEFT's ``create_loraplus_optimizer``
(torch AdamW, B in its own parameter group) ends on the same batches, beside plain slots in the same pack."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from tests.helpers import (
    GPT2_SPECS,
    LLAMA_SPECS,
    assert_trained_as_peft,
    default_dtype,
    run_packed,
    slot_jobs,
)

MIXED = {
    # ratios 16 (the paper's default) and 4, with weight decay, warm-up, clipping, rsLoRA and a cosine schedule,
    # beside a plain slot that must train as before. B's learning rate stays <= 1.6e-2: above ~4e-2 these tiny
    # models' losses stop falling and the steps amplify fp32 rounding (plain LoRA at 4e-2 leaves PEFT by 7e-2 too)
    "llama": [replace(LLAMA_SPECS[0], lr_ratio=16.0, lr=1e-3), replace(LLAMA_SPECS[1], lr_ratio=4.0, lr=2e-3),
              LLAMA_SPECS[2]],
    "gpt2": [replace(GPT2_SPECS[1], lr_ratio=8.0, lr=2e-3), GPT2_SPECS[0], replace(GPT2_SPECS[3], lr_ratio=2.0)],
}


@pytest.mark.parametrize("family", list(MIXED))
def test_loraplus_slots_in_a_mixed_pack_equal_peft_loraplus(tiny_dirs, family: str) -> None:
    model_dir = tiny_dirs(family)
    with default_dtype(torch.float64):  # fp64: a wrong B learning rate is far outside the tolerances
        losses, final = run_packed(model_dir, slot_jobs(MIXED[family]), capacity=3)
        for job in slot_jobs(MIXED[family]):
            assert_trained_as_peft(model_dir, job, losses, final)


def test_the_ratio_changes_training(tiny_dirs) -> None:
    """The oracle's check has teeth: the same slot without its ratio ends elsewhere."""
    spec = MIXED["llama"][0]
    with_ratio = run_packed(tiny_dirs("llama"), slot_jobs([spec]), capacity=1)[1][0]
    plain = run_packed(tiny_dirs("llama"), slot_jobs([replace(spec, lr_ratio=1.0)]), capacity=1)[1][0]
    for path, (_, b) in with_ratio.items():
        assert (b - plain[path][1]).abs().max() > 1e-3, path


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_loraplus_on_the_triton_adamw_equals_the_torch_step_on_cuda(tiny_dirs) -> None:
    """The Triton AdamW's per-segment learning rate (``kernels.triton_adamw``, B^T segments at ``lr * lr_ratio``),
    captured in the CUDA graph, against the torch step that the CPU test above holds to PEFT, both on the GPU."""
    from lora_sweep.packer.model.load import load_base
    from lora_sweep.packer.model.packed import PackedModel
    from lora_sweep.packer.step.train import train
    from tests.conftest import Recorder

    runs = {}
    for impl, graphs in (("triton", "auto"), ("torch", "off")):
        model, _ = load_base(str(tiny_dirs("llama")), attn_implementation="sdpa", device="cuda", dtype="float32")
        pm = PackedModel(model, impl=impl)
        queue = slot_jobs(MIXED["llama"])
        rec = Recorder(pm)
        train(pm, 3, lambda slot, q=queue: q.pop(0) if q else None, pad_id=0, on_step=rec.on_step,
              on_end=rec.on_end, cuda_graphs=graphs)
        runs[impl] = rec
    for key, losses in runs["torch"].losses.items():
        # fp32 on both sides; the kernels sum in another order than cuBLAS: 1e-5 relative over 20 steps
        torch.testing.assert_close(torch.tensor(runs["triton"].losses[key]), torch.tensor(losses), rtol=1e-5, atol=0)
        for path, (a, b) in runs["torch"].final[key].items():
            torch.testing.assert_close(runs["triton"].final[key][path][0], a, rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(runs["triton"].final[key][path][1], b, rtol=1e-4, atol=1e-5)
