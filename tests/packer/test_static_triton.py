"""The training step on the Triton kernels (CPU: the interpreter) equals the same step on the masked-dense PyTorch
path: the static segment table, the per-step dropout seeds it carries (the torch path draws the same bits) and the
segmented AdamW kernel, end to end."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from tests.conftest import need_triton

need_triton()  # before anything imports the Triton kernel modules

from tests.packer.test_equivalence import LLAMA_SPECS, _jobs, _run_packed  # noqa: E402


@pytest.mark.slow  # ~2 min in the interpreter on a 2-core CPU
def test_triton_step_equals_the_torch_step_with_dropout(tiny_dirs) -> None:
    specs = [replace(LLAMA_SPECS[0], max_steps=2, dropout=0.1), replace(LLAMA_SPECS[2], max_steps=2)]
    dense = _run_packed(tiny_dirs("llama"), _jobs(specs), 2, impl="torch")
    triton = _run_packed(tiny_dirs("llama"), _jobs(specs), 2, impl="triton")
    for key, losses in dense[0].items():
        torch.testing.assert_close(torch.tensor(triton[0][key]), torch.tensor(losses), rtol=1e-5, atol=0)
        for path, (a, b) in dense[1][key].items():
            torch.testing.assert_close(triton[1][key][path][0], a, rtol=0, atol=1e-5)
            torch.testing.assert_close(triton[1][key][path][1], b, rtol=0, atol=1e-5)
            assert b.abs().max() > 0
