"""A saved adapter folded into its base: W + s·B·A for nn.Linear and GPT-2's Conv1D (which stores W as
(D_in, D_out)), each variant's extra tensors through its ``merge`` hook (DoRA's magnitudes), and a tensor no
variant knows refused in one line. PEFT's own merge is the oracle in test_dora_checkpoint.py; here the formula."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers.pytorch_utils import Conv1D

from lora_sweep.errors import UserError
from lora_sweep.packer.api import Packer

D_IN, D_OUT, R, ALPHA = 6, 5, 2, 4.0


def _adapter(dora: bool) -> tuple[dict, dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    tensors = {"base_model.model.proj.lora_A.weight": torch.randn(R, D_IN, generator=g),
               "base_model.model.proj.lora_B.weight": torch.randn(D_OUT, R, generator=g)}
    if dora:
        tensors["base_model.model.proj.lora_magnitude_vector"] = torch.rand(D_OUT, generator=g) + 0.5
    return {"r": R, "lora_alpha": ALPHA, "use_dora": dora}, tensors


@pytest.mark.parametrize("dora", [False, True], ids=["lora", "dora"])
@pytest.mark.parametrize("layer", ["linear", "conv1d"])
def test_merge_folds_the_adapter_and_each_variants_tensors_into_either_layout(layer: str, dora: bool) -> None:
    torch.manual_seed(1)
    model = nn.Module()
    model.proj = nn.Linear(D_IN, D_OUT, bias=False) if layer == "linear" else Conv1D(D_OUT, D_IN)
    w = model.proj.weight.detach().clone()
    w = w.T if layer == "conv1d" else w  # (D_OUT, D_IN)
    config, tensors = _adapter(dora)
    a, b = tensors["base_model.model.proj.lora_A.weight"], tensors["base_model.model.proj.lora_B.weight"]
    want = w + ALPHA / R * b @ a
    if dora:
        want = want * (tensors["base_model.model.proj.lora_magnitude_vector"] / want.norm(dim=1))[:, None]

    Packer.merge_adapter(model, config, tensors)

    got = model.proj.weight.detach()
    torch.testing.assert_close(got.T if layer == "conv1d" else got, want)


def test_a_tensor_no_variant_knows_is_refused_in_one_line() -> None:
    model = nn.Module()
    model.proj = nn.Linear(D_IN, D_OUT, bias=False)
    config, tensors = _adapter(dora=False)
    tensors["base_model.model.proj.lora_embedding_A"] = torch.zeros(R, D_IN)
    with pytest.raises(UserError, match=r"^export: tensor 'base_model\.model\.proj\.lora_embedding_A' is not a LoRA "
                                        r"A/B weight \(no variant of the pack merges it\)$"):
        Packer.merge_adapter(model, config, tensors)
