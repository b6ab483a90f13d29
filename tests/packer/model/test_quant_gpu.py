"""QLoRA on the GPU: the Triton path over an NF4 base (H200 only): a slot in a pack equals it alone; the captured
step equals the eager one."""

from __future__ import annotations

import pytest
import torch

from lora_sweep.packer.data.rows import SlotStream
from lora_sweep.packer.model.load import load_base
from lora_sweep.packer.model.packed import PackedModel
from lora_sweep.packer.model.quant import NF4Linear
from lora_sweep.packer.plan import AdapterSpec
from lora_sweep.packer.step.train import SlotJob, train
from tests.conftest import Recorder, need_module, random_examples

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
need_module("torchao", "qlora")

SPECS = [
    AdapterSpec(rank=4, alpha=8, lr=3e-3, micro_batch=2, targets=("q_proj", "v_proj"), max_steps=6, seed=1),
    AdapterSpec(rank=8, alpha=16, lr=1e-2, micro_batch=3, targets=("all-linear",), max_steps=8, seed=2,
                schedule="cosine", warmup_steps=2),
    AdapterSpec(rank=16, alpha=16, lr=5e-3, micro_batch=1, targets=("o_proj", "down_proj"), max_steps=6, seed=3),
]


def _run(model_dir, specs, capacity, first=0, **kw):  # noqa: ANN001, ANN003, ANN202
    """Train ``specs`` (spec i on the data of SPECS[first + i]) in ``capacity`` slots."""
    model, _ = load_base(str(model_dir), attn_implementation="sdpa", device="cuda", quantize="nf4")
    assert any(isinstance(m, NF4Linear) for m in model.modules())
    pm = PackedModel(model, impl="triton")
    jobs = [SlotJob(s, SlotStream(random_examples(48, seed=10 + first + i), s.micro_batch, seed=s.seed), key=i)
            for i, s in enumerate(specs)]
    rec = Recorder(pm)
    result = train(pm, capacity, lambda slot: jobs.pop(0) if jobs else None, pad_id=0, on_step=rec.on_step,
                   on_end=rec.on_end, **kw)
    return rec, result


def test_qlora_slot_in_a_triton_pack_equals_it_alone(tiny_dirs) -> None:
    packed, _ = _run(tiny_dirs("llama"), SPECS, 3)
    for i, spec in enumerate(SPECS):
        alone, _ = _run(tiny_dirs("llama"), [spec], 1, first=i)  # the same data as in the pack
        torch.testing.assert_close(torch.tensor(packed.losses[i]), torch.tensor(alone.losses[0]), rtol=1e-4, atol=0)
        for path, (a, b) in packed.final[i].items():
            assert b.abs().max() > 0
            torch.testing.assert_close(a, alone.final[0][path][0], rtol=0, atol=1e-4)
            torch.testing.assert_close(b, alone.final[0][path][1], rtol=0, atol=1e-4)


def test_the_step_captures_over_nf4_and_equals_eager(tiny_dirs) -> None:
    eager, r_eager = _run(tiny_dirs("llama"), SPECS, 3, cuda_graphs="off")
    graph, r_graph = _run(tiny_dirs("llama"), SPECS, 3, cuda_graphs="on")
    assert r_eager.graphs == 0 and r_graph.graphs >= 1
    for key in eager.losses:
        torch.testing.assert_close(torch.tensor(graph.losses[key]), torch.tensor(eager.losses[key]), rtol=1e-6, atol=0)
        for path, (a, b) in eager.final[key].items():
            torch.testing.assert_close(graph.final[key][path][0], a, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(graph.final[key][path][1], b, rtol=1e-5, atol=1e-6)
