"""A slot's initial A: PEFT's ``init_lora_weights`` for the initialisations that start B at zero.

``kaiming`` is PEFT's default (``init_lora_weights=True``, Microsoft's reference: A as ``nn.Linear``'s own weight
init, Kaiming-uniform with a = sqrt(5)); ``gaussian`` draws A from N(0, 1/r^2) (PEFT's ``reset_lora_parameters``:
``nn.init.normal_(lora_A, std=1 / r)``). Either way B is zero, so the adapted model starts as the base. The draws come
from the slot's own generator, so they depend only on the slot's seed and the device kind.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from lora_sweep.packer.variants.base import AdapterSpec

__all__ = ["init_a"]


@torch.no_grad()
def init_a(a: torch.Tensor, spec: AdapterSpec, generator: torch.Generator) -> None:
    """Fill ``a`` (r, D_in), in place, with ``spec.init``'s initial A drawn from ``generator``.

    Raises:
        ValueError: an initialisation that does not start from B = 0 (``pissa``, ``olora``): not drawn here.
    """
    if spec.init == "kaiming":
        nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=generator)
    elif spec.init == "gaussian":
        nn.init.normal_(a, std=1 / spec.rank, generator=generator)
    else:
        raise ValueError(f"init {spec.init!r} is not drawn from a generator")
