"""Tiny configs of the causal-LM families beyond ``packer.tiny``'s four: the family test matrix.

Each family is a stock ``transformers`` architecture built from its config (nothing downloaded) at the size
of the other tiny models: width ``hidden_size``, 4 attention heads (2 KV heads where the family has GQA),
MLP width 2 x hidden, ``num_layers`` layers, untied head unless the family always ties it. They cover the
shapes the packer has to get right: fused QKV (GPT-NeoX, Falcon, Bloom, Phi-3, CodeGen, MPT, GPT-BigCode) and
fused gate/up (Phi-3), biases, heads with a bias (GPT-J, Phi, CodeGen), tied heads (OPT, Gemma, Bloom),
projections fed flattened (B·L, D) hidden states (OPT's fc1/fc2), logits post-processed after the head
(Gemma-2's soft-capping, Granite's scaling), GPT-2's ``Conv1D`` (in ``packer.tiny``).

Every family here trains, exports and loads in PEFT (tests/packer/test_families.py, tests/sweep/test_families.py).
"""

from __future__ import annotations

from typing import Any

import transformers
from transformers import PreTrainedConfig

__all__ = ["EXTRA_FAMILIES", "extra_config"]

# family -> (config class name in transformers, the family's own names for the tiny sizes). "{h}" is the width,
# "{i}" the MLP width, "{n}" the layer count, "{p}" the context length; everything else is a literal.
_SPECS: dict[str, tuple[str, dict[str, Any]]] = {
    "gpt_neox": ("GPTNeoXConfig", {"hidden_size": "{h}", "intermediate_size": "{i}", "num_hidden_layers": "{n}",
                                   "num_attention_heads": 4, "max_position_embeddings": "{p}",
                                   "tie_word_embeddings": False}),
    "phi3": ("Phi3Config", {"hidden_size": "{h}", "intermediate_size": "{i}", "num_hidden_layers": "{n}",
                            "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": "{p}",
                            "original_max_position_embeddings": "{p}", "tie_word_embeddings": False}),
    "opt": ("OPTConfig", {"hidden_size": "{h}", "ffn_dim": "{i}", "num_hidden_layers": "{n}",
                          "num_attention_heads": 4, "max_position_embeddings": "{p}", "word_embed_proj_dim": "{h}"}),
    "gemma": ("GemmaConfig", {"hidden_size": "{h}", "intermediate_size": "{i}", "num_hidden_layers": "{n}",
                              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                              "max_position_embeddings": "{p}"}),
    "gemma2": ("Gemma2Config", {"hidden_size": "{h}", "intermediate_size": "{i}", "num_hidden_layers": "{n}",
                                "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                                "max_position_embeddings": "{p}", "sliding_window": 16}),
    "gemma3_text": ("Gemma3TextConfig", {"hidden_size": "{h}", "intermediate_size": "{i}", "num_hidden_layers": "{n}",
                                         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                                         "max_position_embeddings": "{p}", "sliding_window": 16}),
    "qwen3": ("Qwen3Config", {"hidden_size": "{h}", "intermediate_size": "{i}", "num_hidden_layers": "{n}",
                              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                              "max_position_embeddings": "{p}", "tie_word_embeddings": False}),
    "falcon": ("FalconConfig", {"hidden_size": "{h}", "num_hidden_layers": "{n}", "num_attention_heads": 4,
                                "max_position_embeddings": "{p}", "tie_word_embeddings": False}),
    "gptj": ("GPTJConfig", {"n_embd": "{h}", "n_inner": "{i}", "n_layer": "{n}", "n_head": 4, "rotary_dim": 8,
                            "n_positions": "{p}", "tie_word_embeddings": False}),
    "phi": ("PhiConfig", {"hidden_size": "{h}", "intermediate_size": "{i}", "num_hidden_layers": "{n}",
                          "num_attention_heads": 4, "max_position_embeddings": "{p}", "tie_word_embeddings": False}),
    "stablelm": ("StableLmConfig", {"hidden_size": "{h}", "intermediate_size": "{i}", "num_hidden_layers": "{n}",
                                    "num_attention_heads": 4, "num_key_value_heads": 2,
                                    "max_position_embeddings": "{p}", "tie_word_embeddings": False}),
    "bloom": ("BloomConfig", {"hidden_size": "{h}", "n_layer": "{n}", "n_head": 4}),
    "codegen": ("CodeGenConfig", {"n_embd": "{h}", "n_inner": "{i}", "n_layer": "{n}", "n_head": 4, "rotary_dim": 8,
                                  "n_positions": "{p}", "n_ctx": "{p}", "tie_word_embeddings": False}),
    "olmo2": ("Olmo2Config", {"hidden_size": "{h}", "intermediate_size": "{i}", "num_hidden_layers": "{n}",
                              "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": "{p}",
                              "tie_word_embeddings": False}),
    "granite": ("GraniteConfig", {"hidden_size": "{h}", "intermediate_size": "{i}", "num_hidden_layers": "{n}",
                                  "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": "{p}",
                                  "tie_word_embeddings": False, "logits_scaling": 4.0, "embedding_multiplier": 2.0,
                                  "residual_multiplier": 0.5, "attention_multiplier": 0.25}),
    "mpt": ("MptConfig", {"d_model": "{h}", "n_layers": "{n}", "n_heads": 4, "expansion_ratio": 2,
                          "max_seq_len": "{p}"}),
    "gpt_bigcode": ("GPTBigCodeConfig", {"n_embd": "{h}", "n_inner": "{i}", "n_layer": "{n}", "n_head": 4,
                                         "n_positions": "{p}", "multi_query": True}),
}

EXTRA_FAMILIES: tuple[str, ...] = tuple(_SPECS)
"""Families ``extra_config`` builds (``transformers`` model types)."""


def extra_config(family: str, vocab_size: int, *, hidden_size: int, num_layers: int, max_length: int,
                 pad_token_id: int, bos_token_id: int, eos_token_id: int) -> PreTrainedConfig:
    """The tiny fp32 config of one of ``EXTRA_FAMILIES`` (see the module docstring for the sizes).

    Args:
        family: One of ``EXTRA_FAMILIES``; the caller has checked it.
        vocab_size: Embedding rows.
        hidden_size: Model width; a multiple of 4 (the head count).
        num_layers: Decoder layers.
        max_length: Context length.
        pad_token_id: Special token ids, as in ``packer.tiny.tiny_config``.
        bos_token_id: See ``pad_token_id``.
        eos_token_id: See ``pad_token_id``.
    """
    class_name, sizes = _SPECS[family]
    fill = {"{h}": hidden_size, "{i}": 2 * hidden_size, "{n}": num_layers, "{p}": max_length}
    kwargs = {k: fill.get(v, v) if isinstance(v, str) else v for k, v in sizes.items()}
    config_class = getattr(transformers, class_name)
    return config_class(vocab_size=vocab_size, pad_token_id=pad_token_id, bos_token_id=bos_token_id,
                        eos_token_id=eos_token_id, **kwargs)
