"""Tiny models round-trip through ``from_pretrained``; the tokenizer.

Run: python -m pytest tests/packer/tiny/test_tiny.py -q
"""

from __future__ import annotations

from pathlib import Path

import jinja2
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

from lora_sweep.errors import ConfigError
from lora_sweep.packer.tiny.models import (
    FAMILIES,
    _init_model,
    build_tiny_model,
    build_tokenizer,
    main,
    tiny_config,
)

TEXTS = ["Add the numbers.\n37+48\n", "Reverse the digits.\n0412", "  héllo, wörld!\n\n😀 x(y) don't 3.14"]


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    return build_tokenizer()


# --- models ---


@pytest.mark.parametrize("family", FAMILIES)
def test_model_round_trips_through_from_pretrained(family: str, tokenizer: PreTrainedTokenizerFast, tmp_path: Path):
    path = build_tiny_model(family, tmp_path / family, seed=3, tokenizer=tokenizer)
    assert path == tmp_path / family and (path / "model.safetensors").is_file()
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    loaded_tokenizer = AutoTokenizer.from_pretrained(path)

    # AutoTokenizer picks a family-specific class for some model types (Qwen2Tokenizer): it must encode the same.
    batch = loaded_tokenizer(TEXTS, padding=True, return_tensors="pt")
    assert batch["input_ids"].tolist() == tokenizer(TEXTS, padding=True)["input_ids"]
    assert len(loaded_tokenizer) == len(tokenizer) == model.config.vocab_size
    assert loaded_tokenizer.chat_template == tokenizer.chat_template
    config = model.config
    assert (config.pad_token_id, config.bos_token_id, config.eos_token_id) == (
        tokenizer.pad_token_id,
        tokenizer.bos_token_id,
        tokenizer.eos_token_id,
    )
    assert model.dtype == torch.float32

    reference = _init_model(tiny_config(family, len(tokenizer)), seed=3).eval()
    with torch.no_grad():
        logits = model(**batch).logits  # (B, T, V)
        expected = reference(**batch).logits
    assert logits.shape == (len(TEXTS), batch["input_ids"].shape[1], len(tokenizer))
    assert torch.equal(logits, expected)


@pytest.mark.parametrize("family", FAMILIES[:4])  # every family: tests/packer/model/test_families.py::test_tiny_sizes
def test_tiny_config_shapes(family: str):
    config = tiny_config(family, 300)
    if family == "gpt2":
        assert (config.n_embd, config.n_layer, config.n_head, config.n_positions) == (64, 2, 4, 512)
    else:
        got = (config.hidden_size, config.intermediate_size, config.num_hidden_layers)
        assert got == (64, 128, 2)
        assert (config.num_attention_heads, config.num_key_value_heads) == (4, 2)
        assert (config.max_position_embeddings, config.tie_word_embeddings) == (512, False)
    assert (config.vocab_size, config.pad_token_id, config.bos_token_id, config.eos_token_id) == (300, 0, 1, 2)


def test_seed_fixes_weights(tokenizer: PreTrainedTokenizerFast, tmp_path: Path):
    def weights(seed: int, name: str) -> dict[str, torch.Tensor]:
        return load_file(
            build_tiny_model("llama", tmp_path / name, seed=seed, tokenizer=tokenizer) / "model.safetensors"
        )

    a, again, other = weights(0, "a"), weights(0, "again"), weights(1, "other")
    assert a.keys() == again.keys() == other.keys()
    assert all(torch.equal(a[k], again[k]) for k in a)
    random_init = [k for k in a if a[k].std() > 0]  # norm weights start at 1 whatever the seed
    assert random_init and not any(torch.equal(a[k], other[k]) for k in random_init)


def test_build_leaves_global_rng_alone(tokenizer: PreTrainedTokenizerFast, tmp_path: Path):
    torch.manual_seed(123)
    expected = torch.rand(4)
    torch.manual_seed(123)
    build_tiny_model("gpt2", tmp_path, seed=7, tokenizer=tokenizer)
    assert torch.equal(torch.rand(4), expected)


def test_unknown_family_is_a_config_error(tokenizer: PreTrainedTokenizerFast, tmp_path: Path):
    with pytest.raises(ConfigError, match="llama, qwen2, mistral, gpt2"):
        tiny_config("bert", 320)
    with pytest.raises(ConfigError, match="'bert'"):
        build_tiny_model("bert", tmp_path / "m", tokenizer=tokenizer)
    assert not (tmp_path / "m").exists()


def test_cli_builds_a_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    main(["--family", "gpt2", "--out", str(tmp_path / "m"), "--seed", "1"])
    assert capsys.readouterr().out.strip() == str(tmp_path / "m")
    assert (tmp_path / "m" / "config.json").is_file() and (tmp_path / "m" / "tokenizer.json").is_file()


# --- tokenizer ---


def test_tokenizer_special_ids_and_round_trip(tokenizer: PreTrainedTokenizerFast):
    assert (tokenizer.pad_token, tokenizer.bos_token, tokenizer.eos_token) == ("<pad>", "<s>", "</s>")
    assert (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id) == (0, 1, 2)
    assert len(tokenizer) == 422  # byte alphabet + specials + every merge the default corpus allows
    for text in TEXTS:
        ids = tokenizer(text)["input_ids"]
        assert ids[0] == tokenizer.bos_token_id and ids.count(tokenizer.bos_token_id) == 1
        assert tokenizer.decode(ids, skip_special_tokens=True) == text
    assert tokenizer("a", "b")["input_ids"][0] == tokenizer.bos_token_id


def test_digits_are_single_tokens(tokenizer: PreTrainedTokenizerFast):
    for digit in "0123456789":
        assert len(tokenizer(digit, add_special_tokens=False)["input_ids"]) == 1
    tokens = tokenizer.convert_ids_to_tokens(tokenizer("x 2024+17=2041 1000000")["input_ids"])
    digit_tokens = [t for t in tokens if any(c.isdigit() for c in t)]
    assert digit_tokens == list("20241720411000000")


def test_tokenizer_training_is_deterministic(tokenizer: PreTrainedTokenizerFast):
    # Each training builds new Rust HashMaps with fresh hash keys, so a second run in this process is a real check.
    assert build_tokenizer().backend_tokenizer.to_str() == tokenizer.backend_tokenizer.to_str()
    assert build_tokenizer(["ab ab ab cd"], vocab_size=270).get_vocab() == build_tokenizer(["ab ab ab cd"]).get_vocab()


def test_vocab_size_below_bytes_is_a_config_error():
    with pytest.raises(ConfigError, match="vocab_size"):
        build_tokenizer(vocab_size=256)


def test_chat_template_renders(tokenizer: PreTrainedTokenizerFast):
    messages = [
        {"role": "system", "content": "Be exact."},
        {"role": "user", "content": "Add the numbers.\n2+3"},
        {"role": "assistant", "content": "5"},
    ]
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    assert text == "<s><|system|>\nBe exact.</s><|user|>\nAdd the numbers.\n2+3</s><|assistant|>\n5</s>"
    prompt = tokenizer.apply_chat_template(messages[:2], tokenize=False, add_generation_prompt=True)
    assert prompt == text.removesuffix("5</s>")

    encoded = tokenizer.apply_chat_template(messages, return_dict=True, return_assistant_tokens_mask=True)
    ids = encoded["input_ids"]
    assert ids[0] == tokenizer.bos_token_id and ids.count(tokenizer.bos_token_id) == 1
    answer = [i for i, m in zip(ids, encoded["assistant_masks"], strict=True) if m]
    assert answer == tokenizer("5</s>", add_special_tokens=False)["input_ids"]
    with pytest.raises(jinja2.TemplateError, match="unknown role"):
        tokenizer.apply_chat_template([{"role": "tool", "content": "x"}], tokenize=False)
