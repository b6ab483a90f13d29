"""DoRA on the Triton path: the packed output rescaled per slot and column (``kernels.triton_dora``), the magnitudes'
gradient added by the kernel and their AdamW step in the Triton optimizer, beside plain and LoRA+ slots, so each slot
trains as on the torch step, which ``test_dora_equivalence`` holds to PEFT's ``use_dora``."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from tests.conftest import need_triton

need_triton()  # before anything imports the Triton kernel modules

from lora_sweep.packer.model.packed import PackedModel  # noqa: E402
from lora_sweep.packer.tiny.models import build_tiny_model  # noqa: E402
from tests.helpers import LLAMA_SPECS  # noqa: E402

TRITON_SPECS = [  # DoRA with clipping (the magnitudes in the slot's norm), DoRA with dropout (the kernels' masks on
    # both steps: the base GEMM of what dropout removed, ``kernels.ops.dropped_part``), DoRA with LoRA+ and gradient
    # accumulation (the magnitudes' gradient kept across micro-batches), PiSSA under DoRA; two steps each (A first
    # moves at the second: B starts at zero), one row per micro-batch (the interpreter's time)
    replace(LLAMA_SPECS[2], dora=True, targets=("q_proj", "down_proj"), max_steps=2, micro_batch=1),
    replace(LLAMA_SPECS[0], dora=True, targets=("q_proj", "down_proj"), max_steps=2, dropout=0.1),
    replace(LLAMA_SPECS[3], dora=True, targets=("down_proj", "k_proj"), max_steps=2, lr_ratio=4.0, micro_batch=1,
            gradient_accumulation_steps=2),
    replace(LLAMA_SPECS[1], dora=True, init="pissa", targets=("o_proj",), max_steps=2, micro_batch=1),
]


def _snapshot(pm: PackedModel):  # noqa: ANN202
    """A slot's final A, B and (DoRA) magnitudes, copied as it ends."""
    def take(slot: int) -> dict:
        weights = {p: (a.detach().clone(), b.detach().clone()) for p, (a, b) in pm.slot_weights(slot).items()}
        mags = {p: m.detach().clone() for p, m in pm.slot_magnitudes(slot).items()}
        starts = {p: torch.linalg.norm(pm.layers[p].base.weight.float(), dim=1) for p in mags}  # DoRA's start
        return {"weights": weights, "mags": mags, "starts": starts}
    return take


@pytest.mark.parametrize("device", [
    pytest.param("cpu", marks=pytest.mark.slow),  # the Triton interpreter: three steps of one decoder layer
    pytest.param("cuda", marks=pytest.mark.gpu),  # compiled kernels, the step replayed as a CUDA graph
])
def test_triton_step_trains_dora_slots_as_the_torch_step(
        tmp_path_factory, torch_and_triton, device: str) -> None:  # noqa: ANN001
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    model_dir = build_tiny_model("llama", tmp_path_factory.mktemp("tiny-llama-1"), seed=0, num_layers=1)
    runs = torch_and_triton(model_dir, TRITON_SPECS, device, snapshot=_snapshot)
    if device == "cuda":
        assert runs["triton"][1].step == "cuda-graph", "the DoRA step must capture"
    runs = {impl: rec for impl, (rec, _) in runs.items()}
    for key, spec in enumerate(TRITON_SPECS):
        # fp32, the same sums in another order
        torch.testing.assert_close(torch.tensor(runs["triton"].losses[key]), torch.tensor(runs["torch"].losses[key]),
                                   rtol=1e-5, atol=0)
        want, got = runs["torch"].final[key], runs["triton"].final[key]
        for path, (a, b) in want["weights"].items():
            torch.testing.assert_close(got["weights"][path][0], a, rtol=0, atol=1e-5)
            torch.testing.assert_close(got["weights"][path][1], b, rtol=0, atol=1e-5)
        assert want["mags"].keys() == got["mags"].keys() and bool(want["mags"]) == spec.dora
        for path, m in want["mags"].items():
            torch.testing.assert_close(got["mags"][path], m, rtol=0, atol=1e-5)
            assert (m - want["starts"][path]).abs().max() > 1e-4, f"{path}: the magnitudes never moved"
