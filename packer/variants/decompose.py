"""PiSSA and OLoRA over a shared base: a slot's initial A0, B0 from the base weight, and the frozen correction.

PEFT starts such an adapter from the base weight's principal part and removes it from the base:
``W_res = W - s B0 A0``, trained as ``W_res x + s B A x`` from A = A0, B = B0 (``LoraLayer.pissa_init`` /
``olora_init``). Every slot of a pack shares one unmodified base, so here the slot carries the removal itself:
``W_res x = W x - s B0 A0 x``, a frozen LoRA-shaped term. The pack stores it as rank rows ``r .. 2r`` of the slot's
A and B^T (``packer.model.store``): A rows A0, B^T rows ``-B0^T``, which the forward reads with the trained rows
(the slot's forward rank is 2r, ``AdapterSpec.rows``) and the optimizer never walks (it takes the first r rows).
The same 2r rows are PEFT's conversion of the trained adapter into a plain LoRA against the original base
(``save_pretrained(path_initial_model_for_weight_conversion=...)``: ``A' = [A; A0]``, ``B' = [B, -B0]``, rank 2r),
which is how the slot is saved.

Factors, as PEFT computes them in fp32 from W (D_out, D_in):

- ``pissa``: ``W = V S U^T`` (``torch.linalg.svd``, thin); ``A0 = diag(sqrt(S_r / s)) U_r^T``,
  ``B0 = V_r diag(sqrt(S_r / s))``, so ``s B0 A0`` is the rank-r principal part of W;
- ``olora``: ``W = Q R`` (``torch.linalg.qr``); ``A0 = R_r`` (first r rows), ``B0 = Q_r`` (first r columns).

The decomposition is computed once per base module and rank (``_CACHE``, across slots and packs).
"""

from __future__ import annotations

import weakref

import torch
from torch import nn
from transformers.pytorch_utils import Conv1D

from lora_sweep.errors import ConfigError
from lora_sweep.packer.variants.base import AdapterSpec

__all__ = ["principal_factors", "write_principal"]

_CACHE: weakref.WeakKeyDictionary[nn.Module, dict[tuple[str, int], tuple[torch.Tensor, ...]]] = \
    weakref.WeakKeyDictionary()
"""Base module -> (init, rank) -> its truncated decomposition (``pissa``: V_r, S_r, U_r^T; ``olora``: Q_r, R_r)."""


def _weight(base: nn.Module, init: str, path: str) -> torch.Tensor:
    """The base projection's weight as (D_out, D_in) fp32, as PEFT reads it."""
    w = getattr(base, "weight", None)
    if not isinstance(w, torch.Tensor) or type(w.data) is not torch.Tensor or not w.dtype.is_floating_point:
        raise ConfigError(f"init: {init} needs the whole floating-point base weight (layer {path} holds a "
                          f"{type(w.data if isinstance(w, torch.Tensor) else w).__name__}: a quantized or sharded "
                          "base is not decomposed)")
    w = w.detach().to(torch.float32)
    if isinstance(base, Conv1D):
        if init == "olora":  # PEFT's olora_init does not transpose a fan_in_fan_out weight: its factors don't fit
            raise ConfigError(f"init: olora is not defined for GPT-2's Conv1D layers (layer {path})")
        w = w.T  # PEFT's pissa_init: transpose(weight, fan_in_fan_out)
    return w


def _decomposition(base: nn.Module, init: str, rank: int, path: str) -> tuple[torch.Tensor, ...]:
    per_module = _CACHE.setdefault(base, {})
    if (init, rank) not in per_module:
        w = _weight(base, init, path)
        if init == "pissa":
            v, s, uh = torch.linalg.svd(w, full_matrices=False)
            per_module[(init, rank)] = (v[:, :rank].clone(), s[:rank].clone(), uh[:rank].clone())
        else:
            q, r = torch.linalg.qr(w)
            per_module[(init, rank)] = (q[:, :rank].contiguous(), r[:rank].contiguous())
    return per_module[(init, rank)]


def principal_factors(base: nn.Module, spec: AdapterSpec, path: str = "") -> tuple[torch.Tensor, torch.Tensor]:
    """PEFT's initial (A0 (r, D_in), B0 (D_out, r)), fp32, of ``spec.init`` (``pissa`` / ``olora``) on ``base``.

    Raises:
        ConfigError: a weight that is not a plain float tensor (a quantized base), or ``olora`` on a Conv1D.
    """
    parts = _decomposition(base, spec.init, spec.rank, path)
    if spec.init == "olora":
        q, r = parts
        return r, q
    v, s, uh = parts
    root = torch.sqrt(s / spec.scale)  # PEFT: Sr /= scaling, then sqrt on both sides
    return torch.diag(root) @ uh, v @ torch.diag(root)


@torch.no_grad()
def write_principal(a: torch.Tensor, bt: torch.Tensor, base: nn.Module, spec: AdapterSpec, path: str = "") -> None:
    """Fill a slot's 2r rows of one layer, in place: A (2r, D_in) = [A0; A0], B^T (2r, D_out) = [B0^T; -B0^T]
    (trained rows first, then the frozen correction; module docstring)."""
    a0, b0 = principal_factors(base, spec, path)
    r = spec.rank
    a[:r] = a0
    a[r:] = a0
    bt[:r] = b0.T
    bt[r:] = -b0.T
