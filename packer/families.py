"""The causal-LM families the packer supports, one row each: what every other list of families derives from.

A family is a ``transformers`` model type (``config.model_type``). Its row says what the packer knows of it:

- ``fuses``: the class-name prefix of the family whose RMSNorm, SiLU-gated MLP and rotary attention compute exactly
  transformers' Llama formulas, so ``packer.model.fuse`` runs them on the fused Triton kernels (``LlamaRMSNorm``,
  ``LlamaMLP``, ``LlamaAttention``); None: the base runs as it is.
- ``sample_packing``: whether packed rows were checked to give each example the logits it has in its own row
  (``packer.data.packing.VERIFIED_FAMILIES``; tests/packer/data/test_packing.py); the others are refused sample
  packing. The model in hand is checked again before it trains on packed rows (``packer.step.isolation``).

Every family of the table has a tiny random-init model (``packer.tiny``: ``sweep tiny-model --family``), which the
family test matrix trains, fuses, exports and loads in PEFT (tests/packer/model/test_families.py,
tests/sweep/test_family_studies.py). A new family is one row here and its tiny config in ``packer.tiny``
(docs/guides/extending.md, "A new model family").

This module imports nothing heavy: the command line reads the names for ``sweep tiny-model``'s choices.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Family", "FAMILIES", "FAMILY_NAMES", "family"]


# --8<-- [start:family]
@dataclass(frozen=True)
class Family:
    """One supported model family."""

    name: str
    """``config.model_type``."""
    fuses: str | None = None
    """Class-name prefix of its RMSNorm / MLP / attention when ``packer.model.fuse`` runs them fused; None: not."""
    sample_packing: bool = True
    """Packed rows checked to keep each example's logits (else sample packing is refused)."""
# --8<-- [end:family]


FAMILIES: tuple[Family, ...] = (
    Family("llama", fuses="Llama"),
    Family("qwen2", fuses="Qwen2"),
    Family("mistral", fuses="Mistral"),
    Family("gpt2"),
    Family("gpt_neox"),
    Family("phi3"),
    # --8<-- [start:rows]
    Family("opt", sample_packing=False),  # its learned positions come from the padding mask, not position_ids
    Family("gemma"),
    Family("gemma2", sample_packing=False),
    Family("gemma3_text"),
    Family("qwen3", fuses="Qwen3"),
    # --8<-- [end:rows]
    Family("falcon"),
    Family("gptj"),
    Family("phi"),
    Family("stablelm"),
    Family("bloom", sample_packing=False),
    Family("codegen"),
    Family("olmo2"),
    Family("granite"),
    Family("mpt", sample_packing=False),
    Family("gpt_bigcode"),
    Family("cohere"),
    Family("gpt_neo", sample_packing=False),
    Family("starcoder2"),
    Family("nemotron"),
    Family("persimmon"),
)
"""Every supported family, in the order the docs and the tiny-model choices list them."""

FAMILY_NAMES: tuple[str, ...] = tuple(f.name for f in FAMILIES)
"""The families' model types, in table order."""


def family(name: str) -> Family | None:
    """The row of model type ``name``, or None for a family the table does not hold."""
    return next((f for f in FAMILIES if f.name == name), None)
