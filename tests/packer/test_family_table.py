"""``packer.families``: the one table of model families. Every other list derives from it (the fused classes, sample
packing's verified families, the tiny models, the command line's choices), so they agree by construction; what is
checked here is that each row holds for its family: it builds a tiny model of that model type, and its base runs on
the fused kernels exactly where the row says so, with the logits of the eager base."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import need_triton

need_triton()  # before anything imports the Triton kernel modules

from lora_sweep.packer.api import supported  # noqa: E402
from lora_sweep.packer.families import FAMILIES, Family, family  # noqa: E402
from lora_sweep.packer.model.fuse import FusedGatedMLP, FusedRMSNorm, fuse_base_ops  # noqa: E402
from lora_sweep.packer.tiny.models import _init_model, tiny_config  # noqa: E402

IDS = torch.randint(3, 300, (2, 9), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("row", FAMILIES, ids=lambda f: f.name)
def test_each_family_builds_a_tiny_model_and_fuses_as_its_row_says(row: Family) -> None:
    model = _init_model(tiny_config(row.name, 300), seed=0).eval()
    assert model.config.model_type == row.name
    with torch.no_grad():
        eager = model(input_ids=IDS).logits
    fused = fuse_base_ops(model, "triton")
    if row.fuses is None:
        assert fused == []
        return
    kinds = {type(model.get_submodule(path)).__name__ for path in fused}
    assert kinds == {FusedRMSNorm.__name__, FusedGatedMLP.__name__, f"{row.fuses}Attention"}
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=IDS).logits, eager, rtol=1e-5, atol=1e-5)


def test_the_table_is_the_faces_names() -> None:
    names = supported.FAMILY_NAMES
    assert names == tuple(f.name for f in FAMILIES) and len(set(names)) == len(FAMILIES)
    assert family("qwen3") == Family("qwen3", fuses="Qwen3") and family("t5") is None
