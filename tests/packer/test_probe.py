"""The planner's memory model, calibrated by the probe at small sizes, predicts a larger pack's peak."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from lora_sweep.packer.model.inject import all_linear_params
from lora_sweep.packer.model.load import load_base
from lora_sweep.packer.model.packed import PackedModel
from lora_sweep.packer.plan import adapter_param_count
from lora_sweep.packer.probe import calibrate
from lora_sweep.packer.tiny.models import build_tokenizer, tiny_config
from tests.helpers import step_growth


def _packed(tmp_path, vocab: int) -> PackedModel:
    """A 4-layer, 256-wide Llama of ``vocab`` tokens, saved and loaded back as a user's checkpoint is."""
    config = tiny_config("llama", vocab, hidden_size=256, num_layers=4)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "m")
    build_tokenizer().save_pretrained(tmp_path / "m")
    model, _ = load_base(str(tmp_path / "m"))
    return PackedModel(model)


@pytest.mark.parametrize("chunked_ce", [False, 1024], ids=["full-logits", "chunked-ce"])
def test_memory_model_predicts_measured_peak(tmp_path, chunked_ce) -> None:
    """Predicted step growth within 10% of the measured one. With chunked cross-entropy the first probe
    (4 rows x 96 = 384 tokens) is below one chunk (1024) and the pack (2304 tokens) far
    above: the loss's share must saturate at one chunk, not grow with the tokens."""
    # Wide enough that a step's activations (~200 MB) dwarf the weights, so the check has teeth; a 20k
    # vocabulary makes one chunk's logits (~80 MB) a real share of the chunked step.
    pm = _packed(tmp_path, 20_000)
    mm = calibrate(pm, 96, rows=(4, 12), chunked_ce=chunked_ce)
    assert mm.bytes_per_token > 0 and mm.bytes_per_token_rank > 0
    assert (mm.ce_chunk_tokens, mm.ce_chunk_bytes > 0) == ((1024, True) if chunked_ce else (0, False))
    # Compare what the step adds on top of the base part: that is what the model has to get right.
    growth_pred, growth_meas = step_growth(pm, mm, (4, 8, 16, 32), 6, 96, 20_000, chunked_ce=chunked_ce)
    assert growth_meas > 50e6, "the step must be large enough for the check to mean something"
    assert abs(growth_pred - growth_meas) <= 0.10 * growth_meas, (growth_pred / 1e6, growth_meas / 1e6)


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_a_dora_calibration_predicts_a_dora_packs_peak(tmp_path, dropout: float) -> None:
    """A space that can train DoRA calibrates with DoRA probes, with the largest dropout it can train
    (``Packer.probe_options``): a DoRA slot keeps more per token (its rescale's operands for the
    backward; with dropout, what dropout removed from its input times W too), and that model predicts a pack of such
    slots."""
    pm = _packed(tmp_path, 20_000)
    plain = calibrate(pm, 96, rows=(4, 12), dropout=dropout)
    mm = calibrate(pm, 96, rows=(4, 12), dora=True, dropout=dropout)
    assert mm.bytes_per_token > plain.bytes_per_token, (mm.bytes_per_token, plain.bytes_per_token)
    growth_pred, growth_meas = step_growth(pm, mm, (4, 8, 16, 32), 6, 96, 20_000, dora=True, dropout=dropout)
    assert abs(growth_pred - growth_meas) <= 0.10 * growth_meas, (growth_pred / 1e6, growth_meas / 1e6)


def test_memory_model_counts_what_a_parameter_costs_in_a_pack(tmp_path) -> None:
    """Rank-64 adapters on short rows: adapter memory outweighs activations. The step's store holds each slot at
    the pack's rank bucket with its gradient and both moments (16 B per parameter, what the probe measures); the
    probe must count that, or the planner over-fills packs of large ranks."""
    pm = _packed(tmp_path, 2_000)
    mm = calibrate(pm, 32, rows=(4, 12))
    assert mm.bytes_per_param >= 16
    growth_pred, growth_meas = step_growth(pm, mm, (64,) * 8, 1, 32, 2_000)
    shapes = [(layer.in_features, layer.out_features) for layer in pm.layers.values()]
    assert 16 * 8 * adapter_param_count(shapes, 64) > 0.5 * growth_meas, "adapter memory must dominate the step"
    assert abs(growth_pred - growth_meas) <= 0.10 * growth_meas, (growth_pred / 1e6, growth_meas / 1e6)


def test_planner_counts_adapter_parameters_after_the_probes_wrapped_the_model(tmp_path) -> None:
    """The planner sizes a pack after calibrating, when every projection is a ``PackedLoRALinear``; it
    must still count their adapter parameters (it counted none, and on an H200 under-predicted a 24-slot
    pack's peak by 21%)."""
    pm = _packed(tmp_path, 2_000)
    before = all_linear_params(pm.model, 16)
    calibrate(pm, 32, rows=(1, 3))
    assert before == 16 * sum(d_in + d_out for d_in, d_out in
                              [(layer.in_features, layer.out_features) for layer in pm.layers.values()])
    assert all_linear_params(pm.model, 16) == before


def test_a_base_shape_is_read_from_the_model_wrapped_or_not_and_survives_json(tiny_dirs) -> None:
    """``base_shape`` gives what a plan needs of the base without its weights: every adaptable projection (leaf,
    D_in, D_out), the parameter bytes, and per world size an FSDP rank's share; the same once a pack wrapped the
    projections; ``BaseShape`` round-trips through the JSON a cached calibration keeps."""
    import json

    from lora_sweep.packer.model.shard import base_share
    from lora_sweep.packer.plan import BaseShape
    from lora_sweep.packer.probe import base_shape, forward_seconds, plain_param_bytes

    model, _ = load_base(str(tiny_dirs("llama")))
    shape = base_shape(model, (2,))
    assert len(shape.projections) == 2 * 7 and ("q_proj", 64, 64) in shape.projections  # 2 layers of a tiny Llama
    assert shape.param_bytes == plain_param_bytes(model) == sum(p.numel() * p.element_size()
                                                                 for p in model.parameters())
    share = base_share(model, 2)
    assert (shape.shard_peak, shape.shard_load) == ({2: share.peak}, {2: share.load_peak})
    assert shape.adapter_params(16) == all_linear_params(model, 16)
    assert shape.has_targets([("q_proj", "v_proj"), ("all-linear",)]) and not shape.has_targets([("c_attn",)])
    pm = PackedModel(model)
    assert base_shape(pm.model) == BaseShape(shape.projections, shape.param_bytes)
    assert forward_seconds(pm, repeats=2) > 0
    assert BaseShape.from_json(json.loads(json.dumps(shape.to_json()))) == shape
