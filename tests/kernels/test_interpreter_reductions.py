"""The kernels' reductions take the Triton interpreter's numpy path (``kernels._jit.SUM_COMBINE``, ``MAX_COMBINE``):
the interpreter knows Triton's own combines by identity and runs any other, even one that computes the same, element
by element in Python, which once made the CPU's Triton-step tests several times slower."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import need_triton

need_triton()  # before anything imports the Triton kernel modules

from triton.runtime import interpreter  # noqa: E402

from lora_sweep.kernels._jit import MAX_COMBINE, SUM_COMBINE  # noqa: E402
from lora_sweep.packer.model.load import load_base  # noqa: E402
from lora_sweep.packer.model.packed import PackedModel  # noqa: E402
from lora_sweep.packer.plan import AdapterSpec  # noqa: E402
from lora_sweep.packer.step.train import FixedBatch, SlotJob, train  # noqa: E402
from lora_sweep.packer.tiny.models import build_tiny_model  # noqa: E402
from tests.conftest import random_examples  # noqa: E402


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter's path: CUDA compiles the kernels")
def test_a_triton_step_reduces_nothing_element_by_element(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """One step of every reducing kernel: the fused RMSNorms (forward and backward), the loss through the head, the
    dropout's keep bits, DoRA's rescale and column norms, and the clip norm's sum of squares."""
    reduced: list[object] = []
    fast = interpreter.ReduceOps.apply_impl

    def slow(self, input):  # noqa: ANN001, ANN202, A002
        raise AssertionError(f"a reduction with the combine {self.combine_fn} ran element by element")

    def counted(self, input):  # noqa: ANN001, ANN202, A002
        reduced.append(self.combine_fn)
        return fast(self, input)

    monkeypatch.setattr(interpreter.ReduceOps, "generic_reduce", slow)
    monkeypatch.setattr(interpreter.ReduceOps, "apply_impl", counted)
    model_dir = build_tiny_model("llama", tmp_path / "tiny-llama-1", seed=0, num_layers=1)
    pm = PackedModel(load_base(str(model_dir))[0], impl="triton")
    assert pm.fused  # the norms on the kernels
    spec = AdapterSpec(rank=4, targets=("q_proj", "down_proj"), dora=True, dropout=0.1, max_steps=1, seed=1)
    jobs = [SlotJob(spec, FixedBatch(random_examples(2, 0)), key=0)]
    result = train(pm, 1, lambda slot: jobs.pop(0) if jobs else None, pad_id=0)
    assert result.steps == 1
    # the norms, the loss's max and sums, the keep bits, DoRA and the clip norm each reduced (once per program)
    assert set(reduced) == {SUM_COMBINE, MAX_COMBINE} and len(reduced) >= 6
