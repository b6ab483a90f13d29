"""Held-out loss of every slot in one packed pass equals PEFT on the exported adapter, item by item."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from lora_sweep.errors import ConfigError, DataError
from lora_sweep.evaluators.heldout_loss import HELDOUT_LOSS, heldout_loss
from lora_sweep.evaluators.registry import EvalData, load_eval_data
from lora_sweep.packer.data.batch import collate
from lora_sweep.packer.data.rows import tokenize_rows
from lora_sweep.testing.evaluator import EvaluatorContract
from tests.evaluators.conftest import YESNO, load_pack

ARITH_EVAL = Path(__file__).resolve().parents[2] / "studies" / "data" / "arith-eval.jsonl"


def _reference_losses(model: torch.nn.Module, data: EvalData) -> tuple[float, list[float]]:
    """Token-mean loss over the set and per-row means, computed by transformers itself, one row at a time."""
    examples = tokenize_rows(data.rows, data.fmt, data.tokenizer, max_length=data.max_length)
    total, tokens, per_row = 0.0, 0, []
    with torch.no_grad():
        for ex in examples:
            b = collate([0], [[ex]], 0, dropout=[0.0], seeds=[0])
            loss = model(input_ids=b.input_ids, attention_mask=b.attention_mask, labels=b.labels).loss.item()
            n = sum(1 for t in ex.labels[1:] if t != -100)
            total, tokens = total + loss * n, tokens + n
            per_row.append(loss)
    return total / tokens, per_row


def test_heldout_loss_equals_peft_on_exported_adapters(trained) -> None:
    t = trained("llama")
    pm, tok = load_pack(t)
    data = load_eval_data(ARITH_EVAL, tok)
    data = EvalData(data.rows[:20] + load_eval_data(YESNO, tok).rows[:6], data.fmt, tok)
    result = heldout_loss(pm, [0, 1, 2], data, batch_size=7)  # 3 batches, the last one short
    base_loss, _ = _reference_losses(AutoModelForCausalLM.from_pretrained(str(t.model_dir)), data)
    for slot in (0, 1, 2):
        peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(t.model_dir)),
                                               str(t.adapters[slot])).eval()
        ref_loss, ref_rows = _reference_losses(peft_model, data)
        metrics = result.metrics[slot]
        assert abs(metrics["eval_loss"] - base_loss) > 0.05, "the adapter must differ from the base model"
        assert metrics["eval_loss"] == pytest.approx(ref_loss, rel=1e-5)
        assert metrics["perplexity"] == pytest.approx(math.exp(ref_loss), rel=1e-5)
        assert result.per_item[slot]["eval_loss"] == pytest.approx(ref_rows, rel=1e-5)


def test_packed_equals_one_slot_at_a_time(trained) -> None:
    pm, tok = load_pack(trained("llama"))
    data = load_eval_data(YESNO, tok)
    packed = heldout_loss(pm, [2, 0, 1], data, batch_size=5)
    for slot in (0, 1, 2):
        alone = heldout_loss(pm, [slot], data, batch_size=24)
        assert alone.metrics[slot]["eval_loss"] == pytest.approx(packed.metrics[slot]["eval_loss"], rel=1e-6)
        assert alone.per_item[slot]["eval_loss"] == pytest.approx(packed.per_item[slot]["eval_loss"], rel=1e-5)
    assert packed.per_item[0]["eval_loss"] != pytest.approx(packed.per_item[1]["eval_loss"], rel=1e-3)


def test_bad_options_and_formats(trained, tmp_path) -> None:
    pm, tok = load_pack(trained("llama"), slots=(0,))
    data = load_eval_data(YESNO, tok)
    with pytest.raises(ConfigError, match=r"^heldout_loss\.options: unknown option 'batch'"):
        heldout_loss(pm, [0], data, batch=3)
    with pytest.raises(ConfigError, match=r"^heldout_loss\.options\.batch_size: must be an integer >= 1"):
        heldout_loss(pm, [0], data, batch_size=0)
    mc = load_eval_data(Path(__file__).parent / "data" / "yesno-mc.jsonl", tok)
    with pytest.raises(DataError, match="needs rows of format"):
        heldout_loss(pm, [0], mc)
    with pytest.raises(DataError, match="file not found"):
        load_eval_data(tmp_path / "missing.jsonl", tok)


class TestHeldoutLossContract(EvaluatorContract):
    @pytest.fixture
    def evaluator(self):  # noqa: ANN201
        return HELDOUT_LOSS

    @pytest.fixture
    def options(self) -> dict:
        return {"batch_size": 4}

    @pytest.fixture
    def data_file(self) -> Path:
        return YESNO

    @pytest.fixture
    def bad_option(self) -> tuple:
        return ("batch_size", 0)
