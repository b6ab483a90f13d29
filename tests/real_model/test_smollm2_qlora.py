"""QLoRA on a real pretrained model: SmolLM2-135M-Instruct with its projections in NF4, fp32, CPU.

Two slots train as one pack over the NF4 base; the all-linear one must end where PEFT + torch AdamW over the
dequantized weights ends (per-step losses, the first one included, and A/B), as on the tiny model
(``tests/packer/model/test_quant.py``); here the weights NF4 quantises have a real model's scales.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from lora_sweep.packer.data.rows import SlotStream, load_examples
from lora_sweep.packer.model.packed import PackedModel
from lora_sweep.packer.plan import AdapterSpec
from lora_sweep.packer.step.train import SlotJob
from tests.conftest import need_module
from tests.packer.model._quant import nf4_base, peft_over_dequantized, train_pack

pytestmark = pytest.mark.real_model
need_module("torchao", "qlora")

DATA = Path(__file__).resolve().parents[2] / "studies" / "data"
SPECS = [
    AdapterSpec(rank=4, alpha=16, lr=1e-3, micro_batch=2, targets=("all-linear",), max_steps=4, seed=2,
                warmup_steps=1, schedule="cosine"),
    AdapterSpec(rank=8, alpha=8, lr=2e-3, micro_batch=2, targets=("q_proj", "v_proj"), max_steps=4, seed=3),
]


def _jobs(model_dir: Path) -> list[SlotJob]:
    tok = AutoTokenizer.from_pretrained(model_dir)
    rows = load_examples(DATA / "codes-train.jsonl", tok, fmt="prompt_completion", max_length=48)[:32]
    return [SlotJob(spec, SlotStream(rows, spec.micro_batch, seed=spec.seed), key=i) for i, spec in enumerate(SPECS)]


def test_qlora_pack_equals_peft_over_dequantized_smollm2(smollm2_dir: Path) -> None:
    base = nf4_base(smollm2_dir)
    pm = PackedModel(base)
    pm.add_slot(7, SPECS[0])
    init_a = {p: a.detach().clone() for p, (a, _) in pm.slot_weights(7).items()}
    pm.remove_slot(7)
    packed = train_pack(base, _jobs(smollm2_dir), capacity=2)
    ref_losses, ref_weights = peft_over_dequantized(smollm2_dir, SPECS[0], _jobs(smollm2_dir)[0].stream, init_a)
    torch.testing.assert_close(torch.tensor(packed.losses[0]), torch.tensor(ref_losses), rtol=1e-5, atol=0)
    for path, (a, b) in packed.final[0].items():
        assert b.abs().max() > 0
        torch.testing.assert_close(a, ref_weights[path][0], rtol=0, atol=1e-4)
        torch.testing.assert_close(b, ref_weights[path][1], rtol=0, atol=1e-4)
