"""On CUDA: packed evaluation equals one slot at a time, with the torch and the Triton LoRA paths (H200 only).

Run: ``pytest -m gpu tests/evaluators/test_gpu.py``. fp32, so greedy tokens compare exactly; held-out losses
agree with the CPU reference within fp32 GEMM-order tolerance.
"""

from __future__ import annotations

import pytest
import torch

from lora_sweep.evaluators.generation import build_prompts, generate_ids
from lora_sweep.evaluators.heldout_loss import heldout_loss
from lora_sweep.evaluators.registry import EvalData
from lora_sweep.packer.model.load import load_base
from lora_sweep.packer.model.packed import PackedModel
from lora_sweep.packer.plan import AdapterSpec
from lora_sweep.packer.tiny.data import arithmetic_rows

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _pack(model_dir, device: str, impl: str) -> tuple[PackedModel, object]:
    model, tok = load_base(str(model_dir), device=device)
    pm = PackedModel(model, impl=impl)
    gen = torch.Generator().manual_seed(0)
    for slot, rank in enumerate((4, 16, 8)):
        pm.add_slot(slot, AdapterSpec(rank=rank, alpha=2.0 * rank, seed=slot))
        with torch.no_grad():
            for a, b in pm.slot_weights(slot).values():  # drawn on the CPU: add_slot draws A on the pack's
                a.copy_(torch.randn(a.shape, generator=gen) / a.shape[1] ** 0.5)  # device, so CUDA's A differed
                b.copy_(torch.randn(b.shape, generator=gen) * 0.2)
    return pm, tok


def _cuda_case(tiny_dirs, impl: str, items: int, seed: int, new_tokens: int):  # noqa: ANN001, ANN202
    """(pack on CUDA, tokenizer, arithmetic data of ``items`` rows, its prompts, ``generate_ids`` keywords)."""
    if impl == "triton":
        pytest.importorskip("triton")
    pm, tok = _pack(tiny_dirs("llama"), "cuda", impl)
    data = EvalData(arithmetic_rows(items, seed=seed, fmt="prompt_completion"), "prompt_completion", tok)
    kw = {"eos_id": tok.eos_token_id, "pad_id": tok.pad_token_id, "max_new_tokens": new_tokens}
    return pm, tok, data, build_prompts(data), kw


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_packed_equals_alone_on_cuda(tiny_dirs, impl: str) -> None:
    pm, tok, data, prompts, kw = _cuda_case(tiny_dirs, impl, 20, 2, 8)
    packed = generate_ids(pm, [0, 1, 2], prompts, batch_size=7, **kw)
    for slot in (0, 1, 2):
        assert generate_ids(pm, [slot], prompts, batch_size=20, **kw)[slot] == packed[slot]
    assert packed[0] != packed[1]
    loss = heldout_loss(pm, [0, 1, 2], data, batch_size=6)
    cpu_pm, _ = _pack(tiny_dirs("llama"), "cpu", "torch")
    cpu_loss = heldout_loss(cpu_pm, [0, 1, 2], data, batch_size=20)
    cpu_gen = generate_ids(cpu_pm, [0, 1, 2], prompts, batch_size=20, **kw)
    for slot in (0, 1, 2):
        assert loss.metrics[slot]["eval_loss"] == pytest.approx(cpu_loss.metrics[slot]["eval_loss"], rel=1e-4)
        same = sum(a == b for a, b in zip(packed[slot], cpu_gen[slot], strict=True))
        assert same >= len(prompts) - 1, "CUDA and CPU greedy answers differ beyond a near-tie"


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_captured_batched_evaluation_equals_the_per_adapter_path(tiny_dirs, impl: str) -> None:
    """Inside a static pack on CUDA (fp32): greedy tokens of the captured decode step over a static KV cache equal
    the per-adapter eager loop's exactly, and the captured held-out loss matches it; both ran as CUDA graphs."""
    from lora_sweep.evaluators.registry import load_eval_data
    from lora_sweep.packer.step import eval_graph
    from tests.evaluators.conftest import YESNO
    from tests.helpers import pack_evaluations

    if impl == "triton":
        pytest.importorskip("triton")
    captured = []

    def check(pm, slots, tok) -> None:  # noqa: ANN001
        data = load_eval_data(YESNO, tok, fmt="prompt_completion", max_length=48)
        prompts = build_prompts(data)[:7]
        kw = {"eos_id": None, "pad_id": tok.pad_token_id, "max_new_tokens": 6, "batch_size": 3}
        assert generate_ids(pm, slots, prompts, **kw) == generate_ids(pm, slots, prompts, batched=False, **kw)
        static = heldout_loss(pm, slots, data, batch_size=4)
        per_adapter = heldout_loss(pm, slots, data, batch_size=4, batched=False)
        for slot in slots:
            assert static.metrics[slot]["eval_loss"] == pytest.approx(per_adapter.metrics[slot]["eval_loss"], rel=1e-4)
        captured.append(eval_graph.graphs(pm)[1])

    pack_evaluations(tiny_dirs("llama"), check, device="cuda", impl=impl, cuda_graphs="on")
    assert captured and all(n == 3 for n in captured)  # the prefill, the decode step and the held-out forward


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_any_slot_set_scored_batched_equals_each_adapter_alone_with_one_captured_graph_per_shape(tiny_dirs,
                                                                                                   impl: str) -> None:
    """A sequence of batched evaluations of different slot sets (the sweep's rungs and slot ends) on CUDA graphs: each
    slot's per-item losses and greedy tokens equal those of that adapter scored alone on the per-adapter path, and the
    pack captured one graph per shape (held-out forward, prefill, decoding step), not one per slot set or call."""
    from lora_sweep.packer.step import eval_graph

    pm, _, data, prompts, kw = _cuda_case(tiny_dirs, impl, 21, 3, 6)
    alone = {slot: (heldout_loss(pm, [slot], data, batch_size=4, batched=False).per_item[slot]["eval_loss"],
                    generate_ids(pm, [slot], prompts, batch_size=4, batched=False, **kw)[slot]) for slot in (0, 1, 2)}
    for slots in ([2], [0, 2], [1], [0, 1, 2], [1, 2]):
        loss = heldout_loss(pm, slots, data, batch_size=4, batched=True)
        ids = generate_ids(pm, slots, prompts, batch_size=4, batched=True, **kw)
        for slot in slots:
            assert loss.per_item[slot]["eval_loss"] == pytest.approx(alone[slot][0], rel=1e-4, abs=1e-5)
            assert ids[slot] == alone[slot][1]
    assert eval_graph.graphs(pm) == (3, 3)
