"""PiSSA and OLoRA: A and B start from the base weight's principal part (``init: pissa | olora``).

PEFT removes the principal part from the base it wraps; a pack shares one base, so each such slot keeps it as a
frozen correction ``-s B0 A0`` in r more rows of its own (``packer.variants.decompose``): the slot reads 2r rows per
layer, which the store's bucket and the planner's memory term count (``rows``), and is saved as PEFT converts it,
a plain LoRA of rank 2r with alpha scaled to keep s (``peft_config``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lora_sweep.packer.variants.base import AdapterSpec, Variant, require

if TYPE_CHECKING:
    import torch
    from torch import nn


__all__ = ["VARIANT", "INITS"]

INITS = ("pissa", "olora")
"""PEFT's ``init_lora_weights`` values that start from the base weight's decomposition (SVD, QR)."""


def _applies(spec: AdapterSpec) -> bool:
    return spec.init in INITS


def _check(spec: AdapterSpec) -> None:
    require(not (_applies(spec) and spec.dropout > 0), "init", f"{spec.init} needs dropout 0 (the frozen principal "
            "part is a term of the LoRA branch here, and would see the dropped input)", spec.init)


def _init(a: torch.Tensor, bt: torch.Tensor, base: nn.Module, spec: AdapterSpec, path: str,
          generator: torch.Generator) -> None:
    from lora_sweep.packer.variants.decompose import write_principal  # torch: not while a study file loads

    write_principal(a, bt, base, spec, path)


def _peft_config(spec: AdapterSpec, config: dict[str, Any]) -> None:
    rows = 2 * spec.rank
    config["r"] = rows
    config["lora_alpha"] = spec.alpha * (rows / spec.rank) ** (0.5 if spec.rslora else 1.0)


VARIANT = Variant(name="principal", applies=_applies, fields=("init",), check=_check,
                  whole_base="decomposes the whole float base weight", rows=lambda spec: 2 * spec.rank, init=_init,
                  peft_config=_peft_config)
