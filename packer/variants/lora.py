"""Plain LoRA (Hu et al., 2021): ``y = W x + s B A x``, A drawn from the slot's generator, B zero.

Its one hook is the initialisation of PEFT's ``init_lora_weights`` that starts B at zero (``packer.variants.initial``):
``kaiming`` (PEFT's ``True``) or ``gaussian``. Every other part of a slot (forward, optimizer, checkpoint) is the
pack's own, which the other variants change.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lora_sweep.packer.variants.base import AdapterSpec, Variant

if TYPE_CHECKING:
    import torch
    from torch import nn


__all__ = ["VARIANT", "INITS"]

INITS = ("kaiming", "gaussian")
"""The initialisations drawn from a generator, with B = 0."""


def _init(a: torch.Tensor, bt: torch.Tensor, base: nn.Module, spec: AdapterSpec, path: str,
          generator: torch.Generator) -> None:
    from lora_sweep.packer.variants.initial import init_a  # torch: not while a study file loads

    init_a(a, spec, generator)  # B^T stays the zero the store reset it to


VARIANT = Variant(name="lora", applies=lambda spec: spec.init in INITS, fields=("init",), init=_init)
