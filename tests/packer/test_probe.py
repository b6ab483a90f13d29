"""The planner's memory model, calibrated by the probe at small sizes, predicts a larger pack's peak."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from packer.data import Example
from packer.model import PackedModel, load_base
from packer.plan import AdapterSpec, adapter_param_count
from packer.probe import calibrate, peak_memory
from packer.tiny import build_tokenizer, tiny_config
from packer.train import FixedBatch, SlotJob, train


@pytest.mark.parametrize("chunked_ce", [False, 640], ids=["full-logits", "chunked-ce"])
def test_memory_model_predicts_measured_peak(tmp_path, chunked_ce) -> None:
    """Predicted step growth within 10% of the measured one. With chunked cross-entropy the first probe
    (384 tokens) is below one chunk (640) and the pack (2304 tokens) far above: the loss's share must
    saturate at one chunk, not grow with the tokens."""
    # Wide enough that a step's activations (~200 MB) dwarf the weights, so the check has teeth; a 20k
    # vocabulary makes one chunk's logits (~100 MB) a real share of the chunked step.
    config = tiny_config("llama", 20_000, hidden_size=256, num_layers=4)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "m")
    build_tokenizer().save_pretrained(tmp_path / "m")
    model, _ = load_base(str(tmp_path / "m"))
    pm = PackedModel(model)
    seq = 96
    mm = calibrate(pm, seq, rows=(4, 12), chunked_ce=chunked_ce)
    assert mm.bytes_per_token > 0 and mm.bytes_per_token_rank > 0
    assert (mm.ce_chunk_tokens, mm.ce_chunk_bytes > 0) == ((640, True) if chunked_ce else (0, False))

    ranks, micro = (4, 8, 16, 32), 6
    gen = torch.Generator().manual_seed(1)
    jobs = []
    for i, r in enumerate(ranks):
        ids = torch.randint(3, 20_000, (micro, seq), generator=gen).tolist()
        spec = AdapterSpec(rank=r, targets=("all-linear",), micro_batch=micro, max_steps=2, seed=i)
        jobs.append(SlotJob(spec, FixedBatch([Example(tuple(x), tuple(x)) for x in ids])))
    shapes = [(layer.in_features, layer.out_features) for layer in pm.layers.values()]
    params = sum(adapter_param_count(shapes, r) for r in ranks)
    predicted = mm.predict(len(ranks) * micro * seq, params, sum(ranks))
    measured = peak_memory(lambda: train(pm, len(ranks), lambda s: jobs.pop(0) if jobs else None, pad_id=0,
                                         chunked_ce=chunked_ce), pm)
    # Compare what the step adds on top of the static part: that is what the model has to get right.
    growth_pred, growth_meas = predicted - mm.static_bytes, measured - mm.static_bytes
    assert growth_meas > 50e6, "the step must be large enough for the check to mean something"
    print(f"growth predicted {growth_pred / 1e6:.1f} MB, measured {growth_meas / 1e6:.1f} MB")
    assert abs(growth_pred - growth_meas) <= 0.10 * growth_meas, (growth_pred / 1e6, growth_meas / 1e6)


def test_memory_model_counts_what_a_parameter_costs_in_a_pack(tmp_path) -> None:
    """Rank-64 adapters on short rows: adapter memory outweighs activations. A pack gathers every slot's
    weights and gradients into per-layer copies beside the optimizer's 16 B per parameter; the probe
    (two slots, as packs have) must measure that, or the planner over-fills packs of large ranks."""
    config = tiny_config("llama", 2_000, hidden_size=256, num_layers=4)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "m")
    build_tokenizer().save_pretrained(tmp_path / "m")
    model, _ = load_base(str(tmp_path / "m"))
    pm = PackedModel(model)
    seq = 32
    mm = calibrate(pm, seq, rows=(4, 12))
    assert mm.bytes_per_param > 16
    ranks = (64,) * 8
    gen = torch.Generator().manual_seed(1)
    jobs = []
    for i, r in enumerate(ranks):
        ids = torch.randint(3, 2_000, (1, seq), generator=gen).tolist()
        spec = AdapterSpec(rank=r, targets=("all-linear",), micro_batch=1, max_steps=2, seed=i)
        jobs.append(SlotJob(spec, FixedBatch([Example(tuple(x), tuple(x)) for x in ids])))
    shapes = [(layer.in_features, layer.out_features) for layer in pm.layers.values()]
    params = sum(adapter_param_count(shapes, r) for r in ranks)
    predicted = mm.predict(len(ranks) * seq, params, sum(ranks))
    measured = peak_memory(lambda: train(pm, len(ranks), lambda s: jobs.pop(0) if jobs else None, pad_id=0), pm)
    growth_pred, growth_meas = predicted - mm.static_bytes, measured - mm.static_bytes
    assert 16 * params > 0.5 * growth_meas, "adapter memory must dominate for the check to mean something"
    assert abs(growth_pred - growth_meas) <= 0.10 * growth_meas, (growth_pred / 1e6, growth_meas / 1e6)
