"""The frozen base and its adapter slots: ``packed.PackedModel`` and ``load_base`` (Hugging Face, GGUF in ``gguf``, NF4
in ``quant``), the packed LoRA layer (``layer``) and its injection (``inject``), the fused base ops (``fuse``),
the step's slot store (``store``), PEFT save/load (``checkpoint``) and FSDP2 sharding (``shard``), a
sharded base loaded by rows (``shard_load``)."""
