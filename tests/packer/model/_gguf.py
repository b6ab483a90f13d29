"""A tiny GGUF checkpoint written in the test with the ``gguf`` package, the way llama.cpp's converter lays one out.

A llama of 2 layers (hidden 64, 4 heads, 2 KV heads), its matrices stored Q8_0 so loading it really
dequantizes, and a GPT-2 style byte-level BPE tokenizer in the metadata (256 byte tokens, a few merges,
``<|endoftext|>``), which transformers' GGUF loader turns into a fast tokenizer.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

HIDDEN, FFN, LAYERS, HEADS, KV_HEADS = 64, 128, 2, 4, 2
_MERGES = [("Ġ", c) for c in "abcdefghijklmnopqrstuvwxyz"] + [("t", "h"), ("th", "e"), ("i", "n"), ("e", "r")]


def _byte_tokens() -> list[str]:
    """GPT-2's printable spelling of the 256 bytes (``bytes_to_unicode``), in byte order."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    spelled, extra = {}, 0
    for b in range(256):
        if b in printable:
            spelled[b] = chr(b)
        else:
            spelled[b] = chr(256 + extra)
            extra += 1
    return [spelled[b] for b in range(256)]


def tokenizer_tokens() -> tuple[list[str], list[str]]:
    """(tokens, merges) of the tiny byte-level BPE vocabulary; the last token is ``<|endoftext|>``."""
    tokens = _byte_tokens() + ["".join(m) for m in _MERGES] + ["<|endoftext|>"]
    return tokens, [" ".join(m) for m in _MERGES]


def write_tiny_gguf(path: str | Path, *, arch: str = "llama", seed: int = 0, tied: bool = False) -> Path:
    """Write the tiny model to ``path`` (a ``.gguf`` file); ``arch`` other than llama writes the same tensors
    under another architecture name (for the unsupported-architecture error)."""
    from gguf import GGMLQuantizationType, GGUFWriter, TokenType
    from gguf.quants import quantize

    path = Path(path)
    tokens, merges = tokenizer_tokens()
    rng = np.random.default_rng(seed)
    writer = GGUFWriter(str(path), arch)
    writer.add_name("tiny-gguf-llama")
    writer.add_context_length(256)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_block_count(LAYERS)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_dimension_count(HIDDEN // HEADS)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([TokenType.NORMAL] * (len(tokens) - 1) + [TokenType.CONTROL])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(len(tokens) - 1)
    writer.add_eos_token_id(len(tokens) - 1)
    writer.add_pad_token_id(len(tokens) - 1)

    def matrix(name: str, rows: int, cols: int) -> None:  # (rows, cols) as in PyTorch; stored Q8_0
        data = (rng.standard_normal((rows, cols)) * 0.05).astype(np.float32)
        writer.add_tensor(name, quantize(data, GGMLQuantizationType.Q8_0), raw_dtype=GGMLQuantizationType.Q8_0)

    def norm(name: str) -> None:
        writer.add_tensor(name, (1.0 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32))

    head_dim = HIDDEN // HEADS
    matrix("token_embd.weight", len(tokens), HIDDEN)
    for i in range(LAYERS):
        norm(f"blk.{i}.attn_norm.weight")
        matrix(f"blk.{i}.attn_q.weight", HIDDEN, HIDDEN)
        matrix(f"blk.{i}.attn_k.weight", KV_HEADS * head_dim, HIDDEN)
        matrix(f"blk.{i}.attn_v.weight", KV_HEADS * head_dim, HIDDEN)
        matrix(f"blk.{i}.attn_output.weight", HIDDEN, HIDDEN)
        norm(f"blk.{i}.ffn_norm.weight")
        matrix(f"blk.{i}.ffn_gate.weight", FFN, HIDDEN)
        matrix(f"blk.{i}.ffn_up.weight", FFN, HIDDEN)
        matrix(f"blk.{i}.ffn_down.weight", HIDDEN, FFN)
    norm("output_norm.weight")
    if not tied:
        matrix("output.weight", len(tokens), HIDDEN)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
