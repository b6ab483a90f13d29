"""Adapter variants: one object per variant of LoRA (``base.Variant``), one module each.

``of(spec)`` is a slot's variants: the built-ins whose ``applies`` holds, in ``BUILT_IN``'s order. Torch-free at
import (``packer.plan`` checks a spec's fields with them while a study file loads).
"""

from __future__ import annotations

from lora_sweep.packer.variants import dora, lora, lorafa, loraplus, principal
from lora_sweep.packer.variants.base import OPT_COLUMNS, AdapterSpec, SlotState, Variant, require

__all__ = ["BUILT_IN", "FIELDS", "INITS", "of", "check", "Variant", "SlotState", "OPT_COLUMNS", "require"]

BUILT_IN: tuple[Variant, ...] = (lora.VARIANT, principal.VARIANT, dora.VARIANT, loraplus.VARIANT, lorafa.VARIANT)
"""Every variant the pack knows; a slot's are those whose ``applies`` holds."""

FIELDS = tuple(dict.fromkeys(f for v in BUILT_IN for f in v.fields))
"""The ``AdapterSpec`` fields the variants own, each once."""

INITS = (*lora.INITS, *principal.INITS)
"""A's and B's initialisations, PEFT's ``init_lora_weights``: ``kaiming`` (PEFT's ``True``: A Kaiming-uniform with
a = sqrt(5), B zero), ``gaussian`` (A normal with std 1/r, B zero), ``pissa`` (A, B from the base weight's
principal singular vectors) or ``olora`` (from its QR decomposition)."""


def check(spec: AdapterSpec) -> None:
    """Every variant's rules on ``spec``'s fields (``ConfigError`` naming the first key that breaks one)."""
    require(spec.init in INITS, "init", f"must be one of {', '.join(INITS)} (or true: kaiming)", spec.init)
    for variant in BUILT_IN:
        variant.check(spec)


def of(spec: AdapterSpec) -> tuple[Variant, ...]:
    """The variants of a slot of ``spec``."""
    return tuple(v for v in BUILT_IN if v.applies(spec))
