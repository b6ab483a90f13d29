"""PiSSA / OLoRA on the Triton path: the kernels read a principal slot's 2r rows (its segment rank, the frozen
correction's included) and the Triton AdamW walks its first r, so the slot trains as on the torch step, which
``test_principal_equivalence`` holds to PEFT."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from tests.conftest import need_triton

need_triton()  # before anything imports the Triton kernel modules

from lora_sweep.packer.tiny.models import build_tiny_model  # noqa: E402
from tests.helpers import LLAMA_SPECS  # noqa: E402

TRITON_SPECS = [  # the Triton kernels read a principal slot's 2r rows (its segment rank); the optimizer its first r
    replace(LLAMA_SPECS[0], init="pissa", targets=("q_proj", "down_proj"), max_steps=3),
    replace(LLAMA_SPECS[2], targets=("q_proj", "down_proj"), max_steps=3),
    replace(LLAMA_SPECS[3], init="olora", targets=("down_proj",), max_steps=3, lr_ratio=4.0),
]


@pytest.mark.parametrize("device", [
    pytest.param("cpu", marks=pytest.mark.slow),  # the Triton interpreter: three steps of one decoder layer
    pytest.param("cuda", marks=pytest.mark.gpu),  # compiled kernels, the step replayed as a CUDA graph
])
def test_triton_step_trains_principal_slots_as_the_torch_step(
        tmp_path_factory, torch_and_triton, device: str) -> None:  # noqa: ANN001
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    model_dir = build_tiny_model("llama", tmp_path_factory.mktemp("tiny-llama-1"), seed=0, num_layers=1)
    runs = {impl: rec for impl, (rec, _) in torch_and_triton(model_dir, TRITON_SPECS, device).items()}
    for key in range(len(TRITON_SPECS)):
        # fp32, the same sums in another order
        torch.testing.assert_close(torch.tensor(runs["triton"].losses[key]), torch.tensor(runs["torch"].losses[key]),
                                   rtol=1e-5, atol=0)
        for path, (a, b) in runs["torch"].final[key].items():
            torch.testing.assert_close(runs["triton"].final[key][path][0], a, rtol=0, atol=1e-5)
            torch.testing.assert_close(runs["triton"].final[key][path][1], b, rtol=0, atol=1e-5)
