"""The planner's memory model, calibrated by the probe at small sizes, predicts a larger pack's peak."""

from __future__ import annotations

import torch

from packer.data import Example
from packer.model import PackedModel, load_base
from packer.plan import AdapterSpec, adapter_param_count
from packer.probe import calibrate, peak_memory
from packer.tiny import build_tiny_model
from packer.train import SlotJob, train


class _Fixed:
    def __init__(self, rows: list[Example]) -> None:
        self.rows = rows

    def next_batch(self) -> list[Example]:
        return self.rows


def test_memory_model_predicts_measured_peak(tmp_path) -> None:
    # Wide enough that a step's activations (~200 MB) dwarf the weights, so the check has teeth.
    model_dir = build_tiny_model("llama", tmp_path / "m", hidden_size=256, num_layers=4)
    model, _ = load_base(str(model_dir))
    pm = PackedModel(model)
    seq = 96
    mm = calibrate(pm, seq, rows=(4, 12))
    assert mm.bytes_per_token > 0 and mm.bytes_per_token_rank > 0

    ranks, micro = (4, 8, 16, 32), 6
    gen = torch.Generator().manual_seed(1)
    jobs = []
    for i, r in enumerate(ranks):
        ids = torch.randint(3, 400, (micro, seq), generator=gen).tolist()
        spec = AdapterSpec(rank=r, targets=("all-linear",), micro_batch=micro, max_steps=2, seed=i)
        jobs.append(SlotJob(spec, _Fixed([Example(tuple(x), tuple(x)) for x in ids])))
    shapes = [(layer.in_features, layer.out_features) for layer in pm.layers.values()]
    params = sum(adapter_param_count(shapes, r) for r in ranks)
    predicted = mm.predict(len(ranks) * micro * seq, params, sum(ranks))
    measured = peak_memory(lambda: train(pm, len(ranks), lambda s: jobs.pop(0) if jobs else None, pad_id=0),
                           pm)
    # Compare what the step adds on top of the static part: that is what the model has to get right.
    growth_pred, growth_meas = predicted - mm.static_bytes, measured - mm.static_bytes
    assert growth_meas > 50e6, "the step must be large enough for the check to mean something"
    print(f"growth predicted {growth_pred / 1e6:.1f} MB, measured {growth_meas / 1e6:.1f} MB")
    assert abs(growth_pred - growth_meas) <= 0.10 * growth_meas, (growth_pred / 1e6, growth_meas / 1e6)
