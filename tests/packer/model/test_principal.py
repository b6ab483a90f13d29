"""PiSSA / OLoRA over the shared base: the factors equal PEFT's own init, and the slot's frozen correction makes the
packed adapter PEFT's (W_res = W - s B0 A0) without touching the base."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from lora_sweep.errors import ConfigError
from lora_sweep.packer.data.rows import SlotStream
from lora_sweep.packer.model.load import load_base
from lora_sweep.packer.model.packed import PackedModel
from lora_sweep.packer.plan import AdapterSpec
from lora_sweep.packer.step.train import SlotJob, train
from lora_sweep.packer.variants.decompose import principal_factors
from tests.conftest import Recorder, random_examples


def _peft(model_dir, spec: AdapterSpec, targets: list[str]):  # noqa: ANN001, ANN202
    base = AutoModelForCausalLM.from_pretrained(str(model_dir), attn_implementation="eager")
    cfg = LoraConfig(r=spec.rank, lora_alpha=spec.alpha, use_rslora=spec.rslora, target_modules=targets,
                     init_lora_weights=spec.init, fan_in_fan_out=base.config.model_type == "gpt2")
    return get_peft_model(base, cfg)


@pytest.mark.parametrize(("family", "init", "targets", "rslora"), [
    ("llama", "pissa", ["q_proj", "down_proj"], False),
    ("llama", "olora", ["k_proj", "up_proj"], True),
    ("gpt2", "pissa", ["c_attn", "c_fc"], False),
])
def test_factors_are_pefts_and_the_correction_is_its_residual(tiny_dirs, family, init, targets, rslora) -> None:
    spec = AdapterSpec(rank=4, alpha=8, rslora=rslora, init=init, targets=tuple(targets))
    model, _ = load_base(str(tiny_dirs(family)), attn_implementation="eager")
    peft = dict(_peft(tiny_dirs(family), spec, targets).named_parameters())
    modules = dict(model.named_modules())
    for path, module in modules.items():
        if path.rsplit(".", 1)[-1] not in targets:
            continue
        a0, b0 = principal_factors(module, spec, path)
        key = f"base_model.model.{path}"
        torch.testing.assert_close(a0, peft[f"{key}.lora_A.default.weight"], rtol=0, atol=0)
        torch.testing.assert_close(b0, peft[f"{key}.lora_B.default.weight"], rtol=0, atol=0)
        w = module.weight.T if family == "gpt2" else module.weight  # (D_out, D_in)
        w_res = peft[f"{key}.base_layer.weight"]
        w_res = w_res.T if family == "gpt2" else w_res
        torch.testing.assert_close(w - spec.scale * b0 @ a0, w_res, rtol=0, atol=1e-6)  # PEFT rounds W_res to fp32


def test_olora_on_a_conv1d_and_dropout_are_refused(tiny_dirs) -> None:
    model, _ = load_base(str(tiny_dirs("gpt2")), attn_implementation="eager")
    layer = dict(model.named_modules())["transformer.h.0.attn.c_attn"]
    with pytest.raises(ConfigError, match="init: olora is not defined for GPT-2's Conv1D"):
        principal_factors(layer, AdapterSpec(rank=2, init="olora"), "transformer.h.0.attn.c_attn")
    with pytest.raises(ConfigError, match="init: pissa needs dropout 0"):
        AdapterSpec(init="pissa", dropout=0.1)


def test_the_decomposition_is_computed_once_per_module_and_rank(tiny_dirs, monkeypatch) -> None:
    model, _ = load_base(str(tiny_dirs("llama")), attn_implementation="eager")
    layer = dict(model.named_modules())["model.layers.0.self_attn.q_proj"]
    calls = []
    svd = torch.linalg.svd
    monkeypatch.setattr(torch.linalg, "svd", lambda *a, **k: calls.append(1) or svd(*a, **k))
    for alpha in (4, 8, 16):  # slots of one rank and any alpha share it
        principal_factors(layer, AdapterSpec(rank=2, alpha=alpha, init="pissa"))
    principal_factors(layer, AdapterSpec(rank=4, init="pissa"))
    assert len(calls) == 2


def test_training_a_principal_slot_leaves_the_shared_base_untouched(tiny_dirs) -> None:
    """The residual W - s B0 A0 lives in the slot's frozen rows, never in the base other slots share."""
    model, _ = load_base(str(tiny_dirs("llama")), attn_implementation="eager")
    before = [(p, p.detach().clone()) for p in model.parameters()]  # the base's own tensors, wrapped or not
    pm = PackedModel(model)
    spec = AdapterSpec(rank=4, init="pissa", max_steps=3, lr=1e-2)
    queue = [SlotJob(spec, SlotStream(random_examples(8, seed=1), 1, seed=0), key=0)]
    rec = Recorder(pm)
    train(pm, 1, lambda slot: queue.pop(0) if queue else None, pad_id=0, on_step=rec.on_step, on_end=rec.on_end)
    assert all(b.abs().max() > 0.01 for _, b in rec.final[0].values()), "B starts at B0, the principal part"
    assert all(torch.equal(p, copy) for p, copy in before)
