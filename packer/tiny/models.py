"""Tiny random-init base models, for the demo and the tests (their arithmetic task: ``packer.tiny.data``).

Nothing is downloaded: the tokenizer is trained here with ``tokenizers`` and the model is a random
init of a stock ``transformers`` architecture. Both are written with ``save_pretrained``, so the engine
loads them through the same ``from_pretrained`` path as a user's checkpoint.

The documented way to build a tiny base model::

    python -m lora_sweep.packer.tiny.models --family llama --out models/tiny-llama --seed 0

or, from Python::

    from lora_sweep.packer.tiny.models import build_tiny_model
    path = build_tiny_model("llama", "models/tiny-llama", seed=0)
    model = AutoModelForCausalLM.from_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(path)

The demo data under ``studies/data`` is regenerated with ``python -m lora_sweep.packer.tiny.models --write-demo-data
studies/data``.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
from transformers import (
    AutoModelForCausalLM,
    GPT2Config,
    LlamaConfig,
    MistralConfig,
    PreTrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen2Config,
)

from lora_sweep.errors import ConfigError
from lora_sweep.packer.data.rows import ALPACA_PROMPT, ALPACA_PROMPT_NO_INPUT
from lora_sweep.packer.families import FAMILY_NAMES
from lora_sweep.packer.tiny.data import arithmetic_rows, write_demo_data
from lora_sweep.packer.tiny.families import EXTRA_FAMILIES, extra_config

__all__ = [
    "FAMILIES",
    "build_tiny_model",
    "build_tokenizer",
    "main",
    "tiny_config",
]

FAMILIES = FAMILY_NAMES
"""Architectures ``build_tiny_model`` can build (``transformers`` model types): every family of
``packer.families``; llama, qwen2, mistral and gpt2 configured here, the others in ``packer.tiny.families``."""

PAD, BOS, EOS, UNK = "<pad>", "<s>", "</s>", "<unk>"
# Trained first, so their ids are 0..3. Byte-level BPE never emits <unk>; it is declared so that Qwen2Tokenizer
# does not add its default unk "<|endoftext|>" past the model's vocabulary.
_SPECIALS = (PAD, BOS, EOS, UNK)
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2
# Qwen2's PRETOKENIZE_REGEX (transformers/models/qwen2/tokenization_qwen2.py).
_SPLIT_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
MAX_LENGTH = 512
"""Context length of the tiny models (``max_position_embeddings``) and the tokenizer's ``model_max_length``."""

# BOS comes from the template because apply_chat_template(tokenize=True) encodes with add_special_tokens=False;
# encode a rendered string with add_special_tokens=False too, or it gets two BOS. The {% generation %} block
# lets transformers return an assistant-token mask (return_assistant_tokens_mask=True).
CHAT_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- for message in messages -%}"
    "{%- if message['role'] not in ['system', 'user', 'assistant'] -%}"
    "{{- raise_exception('unknown role: ' ~ message['role']) -}}"
    "{%- endif -%}"
    "{{- '<|' ~ message['role'] ~ '|>\\n' -}}"
    "{%- if message['role'] == 'assistant' -%}"
    "{%- generation -%}{{- message['content'] ~ eos_token -}}{%- endgeneration -%}"
    "{%- else -%}{{- message['content'] ~ eos_token -}}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|assistant|>\\n' -}}{%- endif -%}"
)

_MIN_VOCAB = 256 + len(_SPECIALS)  # every byte is a token


def build_tokenizer(corpus: Iterable[str] | None = None, vocab_size: int = 512) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer and wrap it for ``transformers``.

    The pre-tokenizer isolates every digit, so digits are single tokens. The post-processor adds BOS to
    every encode; ``pad``/``bos``/``eos``/``unk`` are ``<pad>``/``<s>``/``</s>``/``<unk>`` with ids 0-3.
    Training is deterministic: the same corpus gives the same vocabulary and merges.

    Args:
        corpus: Training texts; default the arithmetic task's text and the chat template's role markers.
        vocab_size: Upper bound on the vocabulary (bytes + specials + merges); a small corpus can stop short,
            so size models with ``len(tokenizer)``.

    Returns:
        The tokenizer, with ``chat_template`` set (roles system/user/assistant, ``add_generation_prompt``).

    Raises:
        ConfigError: ``vocab_size`` is below 260 (256 bytes + 4 specials).
    """
    if vocab_size < _MIN_VOCAB:
        raise ConfigError(
            f"vocab_size must be >= {_MIN_VOCAB} (256 bytes + {len(_SPECIALS)} specials), got {vocab_size}"
        )
    # The pipeline Qwen2Tokenizer rebuilds from tokenizer.json (AutoTokenizer forces that class for model_type
    # qwen2), so every family loads the same tokenizer; its split regex isolates each digit (\p{N}).
    bpe = Tokenizer(models.BPE())
    bpe.normalizer = normalizers.NFC()
    bpe.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_SPLIT_REGEX), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(_SPECIALS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(_default_corpus() if corpus is None else corpus, trainer)
    assert [bpe.token_to_id(t) for t in (PAD, BOS, EOS)] == [PAD_ID, BOS_ID, EOS_ID]
    bpe.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(
                single=f"{BOS} $A", pair=f"{BOS} $A {BOS}:1 $B:1", special_tokens=[(BOS, BOS_ID)]
            ),
        ]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=UNK,
        chat_template=CHAT_TEMPLATE,
        model_max_length=MAX_LENGTH,
        clean_up_tokenization_spaces=False,  # decode(encode(text)) must give text back
    )


def _default_corpus() -> list[str]:
    # The prompt templates of packer.data.rows are in the corpus, repeated so BPE merges them into a few
    # tokens: an Alpaca row is then ~50 tokens instead of ~135, which is what keeps CPU demos fast.
    rows = arithmetic_rows(600, seed=0)
    texts = [f"{r['instruction']}\n{r['input']}\n{r['output']}" for r in rows]
    templates = [ALPACA_PROMPT, ALPACA_PROMPT_NO_INPUT, "User: \nAssistant: \n"] * 50
    return texts + templates + [f"<|{role}|>\n" for role in ("system", "user", "assistant")]


def tiny_config(
    family: str,
    vocab_size: int,
    *,
    hidden_size: int = 64,
    num_layers: int = 2,
    pad_token_id: int = PAD_ID,
    bos_token_id: int = BOS_ID,
    eos_token_id: int = EOS_ID,
) -> PreTrainedConfig:
    """Config of a tiny decoder: 4 heads (2 KV heads where the family has GQA), MLP width 2 x hidden.

    Args:
        family: One of ``FAMILIES`` (for those of ``packer.tiny.families``, its sizes).
        vocab_size: Embedding rows; use ``len(tokenizer)``.
        hidden_size: Model width; a multiple of 4 (the head count).
        num_layers: Decoder layers.
        pad_token_id: Defaults are the ids ``build_tokenizer`` assigns.
        bos_token_id: See ``pad_token_id``.
        eos_token_id: See ``pad_token_id``.

    Returns:
        The family's config (``LlamaConfig``, ``GPT2Config``, ...) in fp32.

    Raises:
        ConfigError: Unknown ``family``.
    """
    if family == "gpt2":
        return GPT2Config(
            vocab_size=vocab_size,
            n_embd=hidden_size,
            n_layer=num_layers,
            n_head=4,
            n_positions=MAX_LENGTH,
            pad_token_id=pad_token_id,
            bos_token_id=bos_token_id,
            eos_token_id=eos_token_id,
        )
    if family in EXTRA_FAMILIES:
        return extra_config(family, vocab_size, hidden_size=hidden_size, num_layers=num_layers,
                            max_length=MAX_LENGTH, pad_token_id=pad_token_id, bos_token_id=bos_token_id,
                            eos_token_id=eos_token_id)
    config_classes: dict[str, Callable[..., PreTrainedConfig]] = {
        "llama": LlamaConfig,
        "qwen2": Qwen2Config,
        "mistral": MistralConfig,
    }
    if family not in config_classes:
        raise ConfigError(f"unknown model family {family!r}; expected one of {', '.join(FAMILIES)}")
    return config_classes[family](
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=MAX_LENGTH,
        tie_word_embeddings=False,
        pad_token_id=pad_token_id,
        bos_token_id=bos_token_id,
        eos_token_id=eos_token_id,
    )


def _init_model(config: PreTrainedConfig, seed: int) -> PreTrainedModel:
    """Random fp32 init under ``seed``, leaving the caller's global RNG state as it was."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def build_tiny_model(
    family: str,
    out_dir: str | Path,
    *,
    seed: int = 0,
    hidden_size: int = 64,
    num_layers: int = 2,
    tokenizer: PreTrainedTokenizerFast | None = None,
) -> Path:
    """Build a random-init tiny model and save it, with its tokenizer, as a ``from_pretrained`` directory.

    Args:
        family: One of ``FAMILIES``.
        out_dir: Directory to write (created; existing files of the same name are overwritten).
        seed: Init seed; the same seed gives identical weights.
        hidden_size: Model width; a multiple of 4.
        num_layers: Decoder layers.
        tokenizer: Tokenizer to save with the model; default ``build_tokenizer()``.

    Returns:
        ``out_dir`` as a ``Path``.

    Raises:
        ConfigError: Unknown ``family``.
    """
    tokenizer = build_tokenizer() if tokenizer is None else tokenizer
    config = tiny_config(
        family,
        len(tokenizer),
        hidden_size=hidden_size,
        num_layers=num_layers,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    out_dir = Path(out_dir)
    _init_model(config, seed).save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def main(argv: list[str] | None = None) -> None:
    """Entry point of ``python -m lora_sweep.packer.tiny.models``; prints the paths it wrote."""
    parser = argparse.ArgumentParser(
        prog="python -m lora_sweep.packer.tiny.models", description="Build a tiny model or the demo data.")
    parser.add_argument("--family", choices=FAMILIES, help="architecture of the tiny model")
    parser.add_argument("--out", type=Path, help="directory to save the model and tokenizer in")
    parser.add_argument("--seed", type=int, default=0, help="init seed (default 0)")
    parser.add_argument("--hidden-size", type=int, default=64, help="model width, a multiple of 4 (default 64)")
    parser.add_argument("--layers", type=int, default=2, help="decoder layers (default 2)")
    parser.add_argument("--write-demo-data", type=Path, metavar="DIR", help="write the arithmetic demo JSONL to DIR")
    args = parser.parse_args(argv)
    if (args.family is None) != (args.out is None):
        parser.error("--family and --out go together")
    if args.family is None and args.write_demo_data is None:
        parser.error("give --family and --out, or --write-demo-data DIR")
    if args.write_demo_data is not None:
        for path in write_demo_data(args.write_demo_data):
            print(path)
    if args.family is not None:
        print(build_tiny_model(args.family, args.out, seed=args.seed, hidden_size=args.hidden_size,
                               num_layers=args.layers))


if __name__ == "__main__":
    main()
