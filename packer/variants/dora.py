"""DoRA (Liu et al., 2024; PEFT's ``use_dora``): a trained magnitude per output column over the direction of
``W + s B A``.

Per-slot buffers: a (D_out,) magnitude per layer in the store (``packer.variants.magnitude.Magnitudes``), started at
the base weight's row norms, stepped with B's columns, saved as PEFT's ``lora_magnitude_vector``. The forward term is
the store's column rescale (``SlotStore.lora_out``: ``kernels.ops.dora_factors`` / ``dora_scale`` on the Triton path,
``magnitude.torch_term`` on the torch path).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lora_sweep.packer.variants.base import AdapterSpec, PackedModel, SlotStore, Variant, require

if TYPE_CHECKING:
    import torch
    from torch import nn

    from lora_sweep.packer.variants.magnitude import Magnitudes

__all__ = ["VARIANT"]


def _state(store: SlotStore) -> Magnitudes:
    from lora_sweep.packer.variants.magnitude import Magnitudes  # torch: not while a study file loads

    return Magnitudes(store.layers, store.capacity, store.device)


def _start(state: Magnitudes, slot: int, spec: AdapterSpec, path: str, base: nn.Module) -> None:
    from lora_sweep.packer.variants.magnitude import base_weight

    state.start(slot, path, base_weight(base))


def _peft_config(spec: AdapterSpec, config: dict[str, Any]) -> None:
    config["use_dora"] = True


def _peft_tensors(pm: PackedModel, slot: int) -> dict[str, torch.Tensor]:
    return pm.slot_magnitudes(slot)


def _merge(merged: torch.Tensor, magnitude: torch.Tensor) -> torch.Tensor:
    """PEFT's DoRA merge: each output row of ``W + s B A`` (D_out, D_in) rescaled to its magnitude (D_out,)."""
    import torch

    return merged * (magnitude / torch.linalg.norm(merged, dim=1))[:, None]


VARIANT = Variant(name="dora", applies=lambda spec: spec.dora, fields=("dora",),
                  check=lambda spec: require(isinstance(spec.dora, bool), "dora", "must be true or false", spec.dora),
                  whole_base="reads the whole float base weight (the row norms of W + s B A)",
                  state=_state, start=_start, peft_config=_peft_config, peft_tensors=_peft_tensors,
                  peft_key="lora_magnitude_vector", merge=_merge)
