"""The frozen base and its adapter slots: ``packed.PackedModel``; the base's loading in ``load`` (Hugging Face, GGUF
in ``gguf``, NF4 in ``quant``); the packed LoRA layer (``layer``) and its injection (``inject``), the fused base ops
(``fuse``), the step's slot store (``store``; the adapter variants' inits, buffers and terms are ``packer.variants``),
PEFT save (``checkpoint``), FSDP2 sharding (``shard``) and a sharded base loaded by rows (``shard_load``)."""

__all__ = ["QUANTIZE"]

QUANTIZE = ("nf4",)
"""Values of ``model.quantize`` (besides None: the base in its own dtype). Here, not in ``quant`` (which imports
torch), so that a study file is checked without loading torch."""
