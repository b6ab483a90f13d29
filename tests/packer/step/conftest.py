"""Fixtures of the step's tests."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from lora_sweep.packer.model.load import load_base
from lora_sweep.packer.model.packed import PackedModel
from lora_sweep.packer.plan import AdapterSpec
from lora_sweep.packer.step.train import train
from tests.conftest import Recorder
from tests.helpers import slot_jobs


@pytest.fixture
def torch_and_triton() -> Callable[..., dict]:
    """``run(model_dir, specs, device, snapshot=None)``: ``specs`` trained in one pack of 3 slots on the torch step and
    on the Triton step (the base's own ops, SDPA on CUDA); impl -> (its ``Recorder``, ``train``'s result).
    ``snapshot(pm)``: the Recorder's snapshot of a slot that ends."""

    def run(model_dir: Path, specs: list[AdapterSpec], device: str, snapshot=None) -> dict:  # noqa: ANN001
        runs = {}
        for impl in ("torch", "triton"):
            model, _ = load_base(str(model_dir), attn_implementation="sdpa" if device == "cuda" else "eager",
                                 device=device)
            pm = PackedModel(model, impl=impl, fused_base_ops=False)  # type: ignore[arg-type]
            queue, rec = slot_jobs(specs), Recorder(pm, None if snapshot is None else snapshot(pm))
            result = train(pm, 3, lambda slot, q=queue: q.pop(0) if q else None, pad_id=0, on_step=rec.on_step,
                           on_end=rec.on_end)
            runs[impl] = (rec, result)
        return runs

    return run
