"""QLoRA: the base's projections as NF4 weights; a slot over them trains in a pack as it does alone, and as
PEFT does over the dequantized weights (fp32, CPU, the tiny Llama)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lora_sweep.errors import ConfigError
from lora_sweep.packer.data.rows import SlotStream
from lora_sweep.packer.model.load import load_base
from lora_sweep.packer.model.packed import PackedModel
from lora_sweep.packer.model.quant import NF4Linear, nf4_bytes, quantize_base
from lora_sweep.packer.plan import AdapterSpec
from lora_sweep.packer.probe import model_bytes
from lora_sweep.packer.step.train import SlotJob
from tests.conftest import need_module, random_examples
from tests.packer.model._quant import nf4_base, peft_over_dequantized, train_pack

need_module("torchao", "qlora")

STEPS = 6
SPECS = [
    AdapterSpec(rank=2, alpha=4, lr=3e-3, micro_batch=1, targets=("q_proj", "v_proj"), max_steps=STEPS, seed=1),
    AdapterSpec(rank=4, alpha=16, lr=1e-2, micro_batch=2, targets=("all-linear",), max_steps=STEPS + 2, seed=2,
                schedule="cosine", warmup_steps=2, weight_decay=0.1),
    AdapterSpec(rank=8, alpha=8, lr=5e-3, micro_batch=3, targets=("o_proj", "down_proj"), max_steps=STEPS, seed=3,
                max_grad_norm=0.05),
]


def _jobs(specs: list[AdapterSpec]) -> list[SlotJob]:
    return [SlotJob(spec, SlotStream(random_examples(40, seed=100 + i), spec.micro_batch, seed=spec.seed), key=i)
            for i, spec in enumerate(specs)]


def test_the_projections_become_torchao_nf4_with_double_quantised_scales(tiny_dirs) -> None:
    from torchao.quantization import NF4Tensor

    model = nf4_base(tiny_dirs("llama"))
    quantized = {p: m for p, m in model.named_modules() if isinstance(m, NF4Linear)}
    assert len(quantized) == 2 * 7 and type(model.lm_head) is nn.Linear  # every projection, not the output head
    for m in quantized.values():
        w = m.weight
        assert isinstance(w, NF4Tensor) and not w.requires_grad and w.block_size == 64
        assert w.quantized_data.dtype == torch.uint8 and w.quantized_scalers.dtype == torch.int8  # double-quantised
        x = torch.randn(2, 3, m.in_features)
        torch.testing.assert_close(m(x), x @ w.get_original_weight().T, rtol=0, atol=0)


def test_the_base_costs_about_half_a_byte_per_quantised_weight(tiny_dirs) -> None:
    plain, _ = load_base(str(tiny_dirs("llama")))
    model = nf4_base(tiny_dirs("llama"))
    n = sum(m.weight.numel() for m in model.modules() if isinstance(m, NF4Linear))
    saved = model_bytes(PackedModel(plain)) - model_bytes(PackedModel(model))
    extra = sum(m.weight.scaler_mean.numel() * 4 + 16 * 4 for m in model.modules() if isinstance(m, NF4Linear))
    assert saved > 0
    assert abs(saved - (4 * n - nf4_bytes(n))) <= extra + n * 4 / 64  # small weights' scale blocks are < 256


def test_a_weight_nf4_cannot_hold_is_refused_naming_it() -> None:
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(10, 3))
    with pytest.raises(ConfigError, match=r"model.quantize: .* multiple of 64; 1 is \(3, 10\)$"):
        quantize_base(model, "nf4")
    assert type(model[0]) is nn.Linear  # refused before anything was replaced
    with pytest.raises(ConfigError, match="must be one of nf4"):
        quantize_base(nn.Linear(64, 64), "int4")


def test_gpt2s_conv1d_base_is_refused_in_one_line(tiny_dirs) -> None:
    with pytest.raises(ConfigError, match=r"^model.quantize: GPT2LMHeadModel has no nn.Linear projection .*Conv1D"):
        load_base(str(tiny_dirs("gpt2")), quantize="nf4")


def test_qlora_slot_in_a_pack_equals_the_slot_alone_over_the_same_nf4_base(tiny_dirs) -> None:
    model = nf4_base(tiny_dirs("llama"))
    packed = train_pack(model, _jobs(SPECS), capacity=len(SPECS))
    for job in _jobs(SPECS):
        alone = train_pack(model, [job], capacity=1)
        assert len(packed.losses[job.key]) == job.spec.max_steps
        torch.testing.assert_close(torch.tensor(packed.losses[job.key]), torch.tensor(alone.losses[job.key]),
                                   rtol=1e-5, atol=0)
        for path, (a, b) in packed.final[job.key].items():
            ra, rb = alone.final[job.key][path]
            assert b.abs().max() > 0
            torch.testing.assert_close(a, ra, rtol=0, atol=1e-5)
            torch.testing.assert_close(b, rb, rtol=0, atol=1e-5)


def test_qlora_matches_peft_over_the_dequantized_weights(tiny_dirs) -> None:
    model_dir = tiny_dirs("llama")
    spec = SPECS[1]
    pm = PackedModel(nf4_base(model_dir))
    pm.add_slot(7, spec)
    init_a = {p: a.detach().clone() for p, (a, _) in pm.slot_weights(7).items()}
    job = _jobs(SPECS)[1]
    packed = train_pack(nf4_base(model_dir), [job], capacity=1)
    ref_losses, ref_weights = peft_over_dequantized(model_dir, spec, _jobs(SPECS)[1].stream, init_a)
    assert abs(packed.losses[1][0] - ref_losses[0]) <= 1e-5 * abs(ref_losses[0])  # the first step's loss
    torch.testing.assert_close(torch.tensor(packed.losses[1]), torch.tensor(ref_losses), rtol=1e-5, atol=0)
    for path, (a, b) in packed.final[1].items():
        assert b.abs().max() > 0
        torch.testing.assert_close(a, ref_weights[path][0], rtol=0, atol=1e-4)
        torch.testing.assert_close(b, ref_weights[path][1], rtol=0, atol=1e-4)


def test_nf4_changes_the_base_and_plain_lora_does_not_see_it(tiny_dirs) -> None:
    """The comparisons above would pass trivially if quantising changed nothing: it moves the first loss."""
    model_dir = tiny_dirs("llama")
    job = _jobs(SPECS[:1])[0]
    plain, _ = load_base(str(model_dir), attn_implementation="eager")
    assert train_pack(plain, [job], 1).losses[0][0] != train_pack(nf4_base(model_dir), _jobs(SPECS[:1]), 1).losses[0][0]


def test_the_memory_model_knows_the_nf4_base(tmp_path) -> None:
    """Calibrated over the NF4 base, the planner's base part is the quantised model's real bytes (about half a
    byte per projection weight, not the wrapper's placeholder size) and a larger pack's step is predicted within
    10% (the dequantised weight each projection makes for its GEMM included)."""
    from transformers import AutoModelForCausalLM

    from lora_sweep.packer.probe import calibrate
    from lora_sweep.packer.tiny.models import build_tokenizer, tiny_config
    from tests.helpers import step_growth

    config = tiny_config("llama", 20_000, hidden_size=256, num_layers=4)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "m")
    build_tokenizer().save_pretrained(tmp_path / "m")
    model, _ = load_base(str(tmp_path / "m"), quantize="nf4")
    pm = PackedModel(model)
    n = sum(m.weight.numel() for m in model.modules() if isinstance(m, NF4Linear))
    rest = sum(p.numel() * 4 for name, p in model.named_parameters() if "proj" not in name)
    mm = calibrate(pm, 96, rows=(4, 12))
    assert model_bytes(pm) == pytest.approx(nf4_bytes(n) + rest, rel=0.01)
    assert mm.base_bytes < rest + n  # well under 4 B (fp32) or even 1 B per projection weight
    growth_pred, growth_meas = step_growth(pm, mm, (4, 8, 16, 32), 6, 96, 20_000)
    assert growth_meas > 50e6
    assert abs(growth_pred - growth_meas) <= 0.10 * growth_meas, (growth_pred / 1e6, growth_meas / 1e6)
