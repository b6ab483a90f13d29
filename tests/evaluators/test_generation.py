"""Batched multi-adapter generation equals one adapter at a time and PEFT's generate; prompts are training's."""

from __future__ import annotations

import itertools
import random

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from lora_sweep.errors import ConfigError, DataError
from lora_sweep.evaluators.generation import GENERATION, build_prompts, generate_ids, generation, references
from lora_sweep.evaluators.registry import EvalData, load_eval_data
from lora_sweep.packer.data.rows import IGNORE_INDEX, tokenize_rows
from lora_sweep.packer.tiny.data import arithmetic_rows
from lora_sweep.testing.evaluator import EvaluatorContract
from tests.damage import eval_cases, judge
from tests.evaluators.conftest import YESNO, load_pack

MAX_NEW = 6


def _peft_generate(t, slot: int, prompts: list[list[int]], eos: int) -> list[list[int]]:
    """The exported adapter in PEFT, one prompt at a time, with transformers' own greedy ``generate``."""
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(t.model_dir)),
                                      str(t.adapters[slot])).eval()
    out = []
    for p in prompts:
        ids = model.generate(input_ids=torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                             max_new_tokens=MAX_NEW, do_sample=False, pad_token_id=0, eos_token_id=eos)
        gen = ids[0, len(p):].tolist()
        out.append(gen[:gen.index(eos)] if eos in gen else gen)
    return out


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_batched_generation_equals_alone_and_peft(trained, family: str) -> None:
    t = trained(family)
    pm, tok = load_pack(t)
    data = EvalData(load_eval_data(YESNO, tok).rows[:6] + arithmetic_rows(6, seed=3, fmt="prompt_completion"),
                    "prompt_completion", tok)
    prompts = build_prompts(data)  # lengths differ: left padding inside every batch
    assert len({len(p) for p in prompts}) > 1
    kw = {"eos_id": tok.eos_token_id, "pad_id": tok.pad_token_id, "max_new_tokens": MAX_NEW}
    packed = generate_ids(pm, [2, 0, 1], prompts, batch_size=5, **kw)
    for slot in (0, 1, 2):
        assert generate_ids(pm, [slot], prompts, batch_size=1, **kw)[slot] == packed[slot]
    assert packed[0] != packed[2], "adapters must answer differently for the test to mean anything"
    assert _peft_generate(t, 1, prompts, tok.eos_token_id) == packed[1]


def test_exact_match_equals_peft(trained) -> None:
    t = trained("llama")
    pm, tok = load_pack(t)
    data = load_eval_data(YESNO, tok)
    result = generation(pm, [0, 1, 2], data, max_new_tokens=MAX_NEW, scorers=["exact_match", "contains"],
                        batch_size=8)
    refs = references(data)
    slot = 0  # the other slots answer as they do alone (test above), and slot 1 as in PEFT
    texts = [tok.decode(g, skip_special_tokens=True)
             for g in _peft_generate(t, slot, build_prompts(data), tok.eos_token_id)]
    expected = [float(x.strip() == r.strip()) for x, r in zip(texts, refs, strict=True)]
    assert result.per_item[slot]["exact_match"] == expected
    assert result.metrics[slot]["exact_match"] == pytest.approx(sum(expected) / len(expected))
    assert [s["generation"] for s in result.samples[slot]] == texts
    assert result.metrics[0]["exact_match"] > 0, "the always-yes adapter answers the yes items"


def test_sampling_is_the_same_packed_or_alone(trained) -> None:
    pm, tok = load_pack(trained("llama"))
    prompts = build_prompts(load_eval_data(YESNO, tok))[:5]
    kw = {"eos_id": None, "pad_id": 0, "max_new_tokens": 4, "temperature": 1.5, "seed": 3}
    packed = generate_ids(pm, [0, 1], prompts, batch_size=2, **kw)
    assert generate_ids(pm, [1], prompts, batch_size=5, **kw)[1] == packed[1]
    assert generate_ids(pm, [1], prompts, batch_size=5, **dict(kw, seed=4))[1] != packed[1]


@pytest.mark.parametrize("fmt", ["alpaca", "prompt_completion", "chat"])
@pytest.mark.parametrize("template", [True, False])
def test_prompts_are_the_training_prompts(tiny_dirs, fmt: str, template: bool) -> None:
    from lora_sweep.packer.model.load import load_base

    _, tok = load_base(str(tiny_dirs("llama")))
    if not template:
        tok.chat_template = None  # packer.data.rows falls back to PLAIN_CHAT_TEMPLATE
    rows = arithmetic_rows(4, seed=5, fmt=fmt)
    if fmt == "chat":  # a multi-turn row: the prompt ends before the last assistant turn
        rows[0] = {"messages": rows[0]["messages"] + [{"role": "user", "content": "again"},
                                                       {"role": "assistant", "content": "7"}]}
    data = EvalData(rows, fmt, tok)
    prompts, refs = build_prompts(data), references(data)
    for ex, prompt, ref in zip(tokenize_rows(rows, fmt, tok), prompts, refs, strict=True):
        tail = list(ex.input_ids[len(prompt):])
        assert list(ex.input_ids[:len(prompt)]) == prompt
        assert ex.labels[len(prompt) - 1] == IGNORE_INDEX and ex.labels[len(prompt)] != IGNORE_INDEX
        assert tok.decode(tail, skip_special_tokens=True).strip() == ref
    if fmt == "chat":
        assert refs[0] == "7" and tok.decode(prompts[0]).count("again") == 1


def test_bad_generation_input(trained) -> None:
    pm, tok = load_pack(trained("llama"), slots=(0,))
    data = load_eval_data(YESNO, tok)
    with pytest.raises(ConfigError, match=r"^generation\.options\.scorers: unknown metric 'bleu'"):
        generation(pm, [0], data, scorers=["bleu"])
    with pytest.raises(ConfigError, match=r"^generation\.options\.stop: must be a list"):
        generation(pm, [0], data, stop=[""])
    with pytest.raises(DataError, match="needs rows of format"):
        generation(pm, [0], EvalData([{"text": "hello"}], "text", tok))


class TestGenerationContract(EvaluatorContract):
    @pytest.fixture
    def evaluator(self):  # noqa: ANN201
        return GENERATION

    @pytest.fixture
    def options(self) -> dict:  # sampled: the seed makes it repeat
        return {"max_new_tokens": 2, "temperature": 0.8, "seed": 3, "scorers": ["exact_match", "contains"]}

    @pytest.fixture
    def data_file(self):  # noqa: ANN201
        return YESNO

    @pytest.fixture
    def bad_option(self) -> tuple:
        return ("scorers", ["rouge"])


def test_randomly_damaged_held_out_files_are_one_line_each(tmp_path) -> None:
    """1,000 seeded damaged held-out files, multiple-choice rows among them, read as an evaluator reads its data
    (a sample of ``python -m tests.damage eval``): each reads or is one ``UserError`` line, within 5 s."""
    for path, run in itertools.islice(eval_cases(tmp_path, random.Random(0)), 1000):
        assert judge(run, 5.0) is None, path.read_text()
