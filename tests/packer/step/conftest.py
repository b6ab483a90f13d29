"""Fixtures of the step's tests."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import lora_sweep.packer.model.store as slot_store
from lora_sweep.kernels.ops import SEG_INT_COL, PackLayout
from lora_sweep.packer.model.load import load_base
from lora_sweep.packer.model.packed import PackedModel
from lora_sweep.packer.plan import AdapterSpec
from lora_sweep.packer.step.train import train
from tests.conftest import Recorder
from tests.helpers import slot_jobs


@pytest.fixture
def kernel_masks() -> type[KernelMasks]:
    """``KernelMasks``: the torch step's dropout masks made the Triton kernels' (patch it over the store's
    ``dropout_keep_mask``)."""
    return KernelMasks


@pytest.fixture
def torch_and_triton(monkeypatch: pytest.MonkeyPatch) -> Callable[..., dict]:
    """``run(model_dir, specs, device, snapshot=None)``: ``specs`` trained in one pack of 3 slots on the torch step and
    on the Triton step (the base's own ops, SDPA on CUDA); impl -> (its ``Recorder``, ``train``'s result).
    ``snapshot(pm)``: the Recorder's snapshot of a slot that ends. The torch step draws the kernels' dropout masks
    (``KernelMasks``), so slots with dropout train alike too."""

    def run(model_dir: Path, specs: list[AdapterSpec], device: str, snapshot=None) -> dict:  # noqa: ANN001
        runs = {}
        for impl in ("torch", "triton"):
            model, _ = load_base(str(model_dir), attn_implementation="sdpa" if device == "cuda" else "eager",
                                 device=device)
            pm = PackedModel(model, impl=impl, fused_base_ops=False)  # type: ignore[arg-type]
            if impl == "torch":
                monkeypatch.setattr(slot_store, "dropout_keep_mask", KernelMasks(pm))
            queue, rec = slot_jobs(specs), Recorder(pm, None if snapshot is None else snapshot(pm))
            result = train(pm, 3, lambda slot, q=queue: q.pop(0) if q else None, pad_id=0, on_step=rec.on_step,
                           on_end=rec.on_end)
            runs[impl] = (rec, result)
        return runs

    return run


class KernelMasks:
    """Stands in for ``packer.model.store.dropout_keep_mask``: slot g's rows of the multiplier the Triton kernels draw
    from the tables of the step being run (``dropout_mask`` on ``SlotStore.shape.meta`` with the layer's id),
    recorded by (the slot's spec seed, its step seed, layer id)."""

    def __init__(self, pm: PackedModel) -> None:
        self.pm = pm
        self.seen: dict[tuple[int, int, int], torch.Tensor] = {}
        self._full: dict[tuple, torch.Tensor] = {}

    def __call__(self, layout: PackLayout, g: int, layer_id: int, d_in: int, seq_len: int,
                 device: torch.device) -> torch.Tensor:
        from lora_sweep.kernels.triton_dropout import dropout_mask  # after the test set the interpreter up

        shape = self.pm.store.shape
        seeds = tuple(shape.meta.seg_int[:, SEG_INT_COL.seed].tolist())
        assert seq_len == shape.seq_len and seeds[g] == layout.seed[g]  # the host layout is the tables' copy
        key = (layer_id, seeds, seq_len, d_in)  # the slots draw from one call's tables: one launch per layer call
        if key not in self._full:
            b = shape.ids.shape[0]
            meta = shape.meta._replace(layer_id=layer_id)
            self._full[key] = dropout_mask(meta, b * seq_len, d_in, device).view(b, seq_len, d_in)
        rows = self._full[key][g * shape.rows:(g + 1) * shape.rows]  # (rows, L, D_in)
        self.seen[(self.pm.specs[g].seed, seeds[g], layer_id)] = rows
        return rows
