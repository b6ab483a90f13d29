"""The QLoRA tests' shared steps (tests/packer/model/test_quant.py, tests/real_model/test_smollm2_qlora.py): an NF4
base, a pack trained over it, and PEFT over the dequantized weights. Loading an NF4 base needs torchao (the qlora
extra): each caller skips without it first."""

from __future__ import annotations

from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model
from torch import nn

from lora_sweep.packer.data.rows import SlotStream
from lora_sweep.packer.model.load import load_base
from lora_sweep.packer.model.packed import PackedModel
from lora_sweep.packer.model.quant import NF4Linear, dequantize_base
from lora_sweep.packer.plan import AdapterSpec
from lora_sweep.packer.step.train import SlotJob, train
from tests.conftest import Recorder
from tests.helpers import adamw_steps

PAD = 0


def nf4_base(model_dir: Path) -> nn.Module:
    model, _ = load_base(str(model_dir), attn_implementation="eager", quantize="nf4")
    return model


def train_pack(model: nn.Module, jobs: list[SlotJob], capacity: int) -> Recorder:
    pm = PackedModel(model, impl="torch")
    queue = list(jobs)
    rec = Recorder(pm)
    train(pm, capacity, lambda slot: queue.pop(0) if queue else None, pad_id=PAD, on_step=rec.on_step,
          on_end=rec.on_end)
    return rec


def peft_over_dequantized(model_dir: Path, spec: AdapterSpec, stream: SlotStream,
                           init_a: dict[str, torch.Tensor]) -> tuple[list[float], dict]:
    """PEFT + torch AdamW on a plain copy of the base whose projections hold the dequantized NF4 weights."""
    base = nf4_base(model_dir)
    dequantize_base(base)
    assert not any(isinstance(m, NF4Linear) for m in base.modules())
    model = get_peft_model(base, LoraConfig(r=spec.rank, lora_alpha=spec.alpha, lora_dropout=0.0, bias="none",
                                            target_modules=sorted({p.rsplit(".", 1)[-1] for p in init_a})))
    model.eval()
    lora = dict(model.named_parameters())
    with torch.no_grad():
        for path, a in init_a.items():
            lora[f"base_model.model.{path}.lora_A.default.weight"].copy_(a)
    assert spec.max_grad_norm is not None  # (as the engine, PEFT's steps clip)
    losses, _ = adamw_steps(model, [p for p in model.parameters() if p.requires_grad], spec, stream)
    return losses, {p: (lora[f"base_model.model.{p}.lora_A.default.weight"].detach(),
                        lora[f"base_model.model.{p}.lora_B.default.weight"].detach()) for p in init_a}
