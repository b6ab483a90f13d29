"""Tiny configs of the causal-LM families beyond ``packer.tiny.models``'s four: the family test matrix.

Each family is a stock ``transformers`` architecture built from its config (nothing downloaded) at the size
of the other tiny models: width ``hidden_size``, 4 attention heads (2 KV heads where the family has GQA),
MLP width 2 x hidden (Bloom's is fixed at 4 x), ``num_layers`` layers. They cover what the packer has to get
right: fused QKV (GPT-NeoX, Falcon, Bloom, Persimmon, Phi-3, CodeGen, MPT, GPT-BigCode) and fused gate/up (Phi-3),
biases, heads with a bias (GPT-J, Phi, CodeGen), heads tied to the embeddings where the family ties by default
(OPT, Gemma, Bloom, MPT, GPT-BigCode), projections fed flattened (B·L, D) hidden states (OPT's fc1/fc2), local and
sliding-window attention (GPT-Neo, Gemma-2/3, Starcoder2), non-gated MLPs, logits post-processed after the head
(Gemma-2's soft-capping, Granite's and Cohere's scaling: refused by ``chunked_ce``), and GPT-2's ``Conv1D``
in ``packer.tiny.models``.

Every family trains, exports and loads in PEFT: tests/packer/model/test_families.py, tests/sweep/test_family_studies.py.
"""

from __future__ import annotations

from typing import Any

from transformers import (
    BloomConfig,
    CodeGenConfig,
    CohereConfig,
    FalconConfig,
    Gemma2Config,
    Gemma3TextConfig,
    GemmaConfig,
    GPTBigCodeConfig,
    GPTJConfig,
    GPTNeoConfig,
    GPTNeoXConfig,
    GraniteConfig,
    MptConfig,
    NemotronConfig,
    Olmo2Config,
    OPTConfig,
    PersimmonConfig,
    Phi3Config,
    PhiConfig,
    PreTrainedConfig,
    Qwen3Config,
    StableLmConfig,
    Starcoder2Config,
)

__all__ = ["EXTRA_FAMILIES", "extra_config"]

def _configs(h: int, n: int, p: int) -> dict[str, tuple[type[PreTrainedConfig], dict[str, Any]]]:
    """family -> (config class, its keyword arguments) for width ``h``, ``n`` layers, context ``p``; the MLP is
    2 x h wide where the family lets it be set (Bloom's is 4 x h)."""
    common = {"hidden_size": h, "num_hidden_layers": n, "num_attention_heads": 4, "max_position_embeddings": p}
    llama_like = {**common, "intermediate_size": 2 * h, "tie_word_embeddings": False}
    gqa = {**llama_like, "num_key_value_heads": 2}
    gemma = {**common, "intermediate_size": 2 * h, "num_key_value_heads": 2, "head_dim": h // 4}  # tied head
    gpt_style = {"n_embd": h, "n_inner": 2 * h, "n_layer": n, "n_head": 4, "n_positions": p}
    return {
        "gpt_neox": (GPTNeoXConfig, llama_like),
        "phi3": (Phi3Config, {**gqa, "original_max_position_embeddings": p}),
        "opt": (OPTConfig, {**common, "ffn_dim": 2 * h, "word_embed_proj_dim": h}),
        "gemma": (GemmaConfig, gemma),
        "gemma2": (Gemma2Config, {**gemma, "sliding_window": 16}),  # final_logit_softcapping=30 by default
        "gemma3_text": (Gemma3TextConfig, {**gemma, "sliding_window": 16}),
        # --8<-- [start:tiny]
        "qwen3": (Qwen3Config, {**gqa, "head_dim": h // 4}),
        # --8<-- [end:tiny]
        "falcon": (FalconConfig, {**common, "ffn_hidden_size": 2 * h, "tie_word_embeddings": False}),
        "gptj": (GPTJConfig, {**gpt_style, "rotary_dim": 8, "tie_word_embeddings": False}),
        "phi": (PhiConfig, llama_like),
        "stablelm": (StableLmConfig, gqa),
        "bloom": (BloomConfig, {"hidden_size": h, "n_layer": n, "n_head": 4}),
        "codegen": (CodeGenConfig, {**gpt_style, "n_ctx": p, "rotary_dim": 8, "tie_word_embeddings": False}),
        "olmo2": (Olmo2Config, gqa),
        "granite": (GraniteConfig, {**gqa, "logits_scaling": 4.0, "embedding_multiplier": 2.0,
                                    "residual_multiplier": 0.5, "attention_multiplier": 0.25}),
        "mpt": (MptConfig, {"d_model": h, "n_layers": n, "n_heads": 4, "expansion_ratio": 2, "max_seq_len": p}),
        "gpt_bigcode": (GPTBigCodeConfig, {**gpt_style, "multi_query": True}),
        "cohere": (CohereConfig, {**gqa, "logit_scale": 0.5}),
        "gpt_neo": (GPTNeoConfig, {"hidden_size": h, "num_layers": n, "num_heads": 4, "intermediate_size": 2 * h,
                                   "attention_types": [[["global", "local"], n // 2]], "window_size": 8,
                                   "max_position_embeddings": p}),
        "starcoder2": (Starcoder2Config, {**gqa, "sliding_window": 16}),
        "nemotron": (NemotronConfig, {**gqa, "head_dim": h // 4}),
        "persimmon": (PersimmonConfig, {**llama_like, "qk_layernorm": True}),
    }


EXTRA_FAMILIES: tuple[str, ...] = tuple(_configs(64, 2, 512))
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
        pad_token_id: Special token ids, as in ``packer.tiny.models.tiny_config``.
        bos_token_id: See ``pad_token_id``.
        eos_token_id: See ``pad_token_id``.
    """
    config_class, kwargs = _configs(hidden_size, num_layers, max_length)[family]
    return config_class(vocab_size=vocab_size, pad_token_id=pad_token_id, bos_token_id=bos_token_id,
                        eos_token_id=eos_token_id, **kwargs)
