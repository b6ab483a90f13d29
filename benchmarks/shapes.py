"""The real architectures' shapes the GPU benchmarks build random-init models of (throughput does not depend on
weight values). A leaf: it imports no other benchmark, so every benchmark may import it."""

from __future__ import annotations

import torch

__all__ = ["PROJ", "SHAPES", "SMOLLM2", "build_shape"]

PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The seven projections of a Llama/Qwen2 decoder layer: the LoRA targets of every benchmark adapter."""

SHAPES: dict[str, dict] = {
    "qwen2.5-0.5b": dict(model_type="qwen2", hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "qwen2.5-3b": dict(model_type="qwen2", hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
                       num_attention_heads=16, num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "llama3.2-3b": dict(model_type="llama", hidden_size=3072, intermediate_size=8192, num_hidden_layers=28,
                        num_attention_heads=24, num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=True),
    "qwen2.5-7b": dict(model_type="qwen2", hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                       num_attention_heads=28, num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False),
    "llama3-8b": dict(model_type="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False),
    "llama3-70b": dict(model_type="llama", hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                       num_attention_heads=64, num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False),
}
"""Config keyword arguments (``model_type`` first) of the shapes ``gpu_bench``, ``gpu_makespan``, ``qlora_bench``
(the 70B only in NF4, built layer by layer) and the rest name."""

SMOLLM2 = dict(model_type="llama", hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
               num_attention_heads=9, num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True)
"""SmolLM2-135M-Instruct's shape (the README demo's model), for ``gpu_graph``."""


def build_shape(name: str, *, device: str = "cuda", dtype: torch.dtype = torch.bfloat16,
                layers: int | None = None) -> torch.nn.Module:
    """A random-init (seed 0) causal LM of shape ``SHAPES[name]`` (``layers`` decoder layers if given), SDPA
    attention, built on ``device`` (where it runs: a 7B init on the CPU alone takes minutes)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    kw = dict(SHAPES[name], **({"num_hidden_layers": layers} if layers else {}))
    cfg = AutoConfig.for_model(kw.pop("model_type"), **kw)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device(device):
        return AutoModelForCausalLM.from_config(cfg, dtype=dtype)
