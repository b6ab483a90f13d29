"""LoRA dropout on the Triton step, on the CPU (in the interpreter; marked gpu: compiled, replayed as a CUDA
graph): at every step, each slot and each layer call, the kernels apply the mask that step's own tables give
(``kernels.triton_dropout.dropout_mask``: the slot's seed for this micro-batch, the layer's id), so the masks move
with the step, differ between slots and layers, and follow a slot into a refill.

The reference is the step's torch path with its mask source (``packer.model.store``'s ``dropout_keep_mask``,
torch's generator) replaced by the kernels' masks of the same step's tables: the Triton step must train the same
losses and adapters. A Triton step that froze its masks, shared them between slots or layers, or read another step's
seeds would train different adapters; the masks the reference used are checked to really differ.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import lora_sweep.packer.model.store as slot_store
from lora_sweep.kernels.ops import dropout_seed
from lora_sweep.packer.model.load import load_base
from lora_sweep.packer.model.packed import PackedModel
from lora_sweep.packer.plan import AdapterSpec
from lora_sweep.packer.step.train import train
from lora_sweep.packer.tiny.models import build_tiny_model
from tests.conftest import Recorder, need_triton

need_triton()  # before anything imports the Triton kernel modules

from tests.helpers import PAD, slot_jobs  # noqa: E402

SPECS = [  # three slots; the first ends after 2 steps and the fourth job refills its slot for the last step
    AdapterSpec(rank=2, alpha=4, lr=1e-2, micro_batch=2, targets=("q_proj", "v_proj"), max_steps=2, seed=11),
    AdapterSpec(rank=4, alpha=8, lr=1e-2, micro_batch=2, targets=("q_proj", "v_proj", "down_proj"), max_steps=3,
                seed=12, dropout=0.1),
    AdapterSpec(rank=8, alpha=8, lr=5e-3, micro_batch=1, targets=("v_proj", "down_proj"), max_steps=3, seed=13,
                dropout=0.3, max_grad_norm=0.05),
    AdapterSpec(rank=4, alpha=16, lr=1e-2, micro_batch=2, targets=("q_proj", "down_proj"), max_steps=1, seed=14,
                dropout=0.2),
]
"""Adapted projections q_proj, v_proj and down_proj, each run alone with its own layer id (so its own masks)."""


@pytest.fixture(scope="module")
def one_layer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama with one decoder layer: the interpreter's cost of a Triton step grows with the wrapped projections
    (most of it in the clip norms' reduction, one program per projection, slot and split), and three adapted
    projections of one layer already have three layer ids."""
    return build_tiny_model("llama", tmp_path_factory.mktemp("tiny-llama-1"), seed=0, num_layers=1)


def _train(model_dir, impl: str, device: str, monkeypatch: pytest.MonkeyPatch, kernel_masks):  # noqa: ANN001, ANN202
    # eager attention on the CPU; SDPA on CUDA, where transformers < 5.21's eager mask cannot be captured
    # (tests/packer/step/test_capture_matrix.py): the masks are under test, both paths share the attention
    attn = "sdpa" if device == "cuda" else "eager"
    model, _ = load_base(str(model_dir), attn_implementation=attn, device=device)
    # the base's norms and MLP eager on both paths (the masks are under test; the interpreter runs the step faster)
    pm = PackedModel(model, impl=impl, fused_base_ops=False)  # type: ignore[arg-type]
    masks = kernel_masks(pm) if impl == "torch" else None
    if masks is not None:
        monkeypatch.setattr(slot_store, "dropout_keep_mask", masks)
    jobs, rec = slot_jobs(SPECS), Recorder(pm)
    result = train(pm, 3, lambda slot: jobs.pop(0) if jobs else None, pad_id=PAD, on_step=rec.on_step,
                   on_end=rec.on_end)
    return rec, masks, result


@pytest.mark.parametrize("device", [
    pytest.param("cpu", marks=pytest.mark.slow),  # ~20 s on a 2-core CPU: three Triton steps in the interpreter
    pytest.param("cuda", marks=pytest.mark.gpu),  # compiled kernels, the step replayed as a CUDA graph
])
def test_triton_step_applies_each_steps_own_masks_per_slot_and_layer(one_layer: Path, device: str,
                                                                      monkeypatch: pytest.MonkeyPatch,
                                                                      kernel_masks) -> None:  # noqa: ANN001
    reference, masks, result = _train(one_layer, "torch", device, monkeypatch, kernel_masks)
    assert result.steps == 3 and result.jobs_started == 4  # the fourth job refilled slot 0
    assert masks is not None
    _check_masks({k: m.cpu() for k, m in masks.seen.items()})
    triton, _, result = _train(one_layer, "triton", device, monkeypatch, kernel_masks)
    assert (result.graphs > 0) == (device == "cuda")  # replayed as a CUDA graph there, eager on the CPU
    for key, spec in enumerate(SPECS):
        assert len(triton.losses[key]) == spec.max_steps
        torch.testing.assert_close(torch.tensor(triton.losses[key]), torch.tensor(reference.losses[key]), rtol=1e-5,
                                   atol=0)  # fp32, the same sums in another order
        for path, (a, b) in reference.final[key].items():
            torch.testing.assert_close(triton.final[key][path][0], a, rtol=0, atol=1e-5)
            torch.testing.assert_close(triton.final[key][path][1], b, rtol=0, atol=1e-5)
            assert b.abs().max() > 0


def _check_masks(seen: dict[tuple[int, int, int], torch.Tensor]) -> None:
    """The reference's masks, by (spec seed, step seed, layer id): each slot with dropout drew at its own seed of
    each of its steps (a refill starting at its own step 0) in every adapted layer; each is a real mask; no two
    alike."""
    layer_ids = {lid for _, _, lid in seen}
    assert len(layer_ids) == 3  # q, v and down
    for spec in SPECS:
        seeds = {(s, lid) for seed, s, lid in seen if seed == spec.seed}
        want = {dropout_seed(spec.seed, i) for i in range(spec.max_steps)} if spec.dropout > 0 else set()
        assert seeds == {(s, lid) for s in want for lid in layer_ids}, spec.seed
    p_of = {spec.seed: spec.dropout for spec in SPECS}
    for (seed, _, _), m in seen.items():  # zeros at about rate p, the survivors scaled by 1 / (1 - p)
        p = p_of[seed]
        assert abs((m == 0).float().mean().item() - p) < 0.05
        assert torch.all((m == 0) | torch.isclose(m, torch.tensor(1 / (1 - p))))
    # compared where both cover the same rows, positions and columns: a slot's mask depends on its own rows and
    # positions, not on the step's padded length
    entries, kinds = list(seen.items()), set()
    for i, ((seed, s, lid), m) in enumerate(entries):
        for (seed2, s2, lid2), m2 in entries[i + 1:]:
            if m.shape[2] != m2.shape[2]:
                continue
            rows, seq = min(m.shape[0], m2.shape[0]), min(m.shape[1], m2.shape[1])
            assert not torch.equal(m[:rows, :seq], m2[:rows, :seq]), ((seed, s, lid), (seed2, s2, lid2))
            kinds.add((seed == seed2, s == s2, lid == lid2))
    assert {(True, False, True), (False, False, True), (True, True, False)} <= kinds  # steps, slots, layers met
