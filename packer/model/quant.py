"""QLoRA's frozen base: the base model's linear projections as 4-bit NF4 weights, shared by every slot.

NF4 as torchtune does it: torchao's ``NF4Tensor`` (``to_nf4``) holds each weight as 4-bit indices into the
16 NormalFloat levels, one absmax scale per block of 64 weights, and the scales themselves double-quantised
(8-bit, one fp32 factor per block of 256 scales, minus their mean), about 0.52 bytes per weight. The
projection runs ``linear_nf4``: the weight is dequantised to the activations' dtype for the GEMM and
dequantised again in the backward for the input gradient; it never has a gradient of its own.

The LoRA path does not change: ``NF4Linear`` replaces the ``nn.Linear`` modules of the base (every one but the
output head, as PEFT's ``load_in_4bit`` and torchtune's ``qlora_*`` builders do), ``packer.model.inject`` wraps the
targeted ones in ``PackedLoRALinear`` like any other projection, and a slot's adapter adds its term to the
NF4 projection's output. Embeddings, norms and the output head stay in the model's dtype.

Small weights: torchao needs the number of weights to be a multiple of 64 and the number of blocks a multiple
of the scale block (256). A projection whose block count is not a multiple of 256 (only tiny models have one)
double-quantises its scales in blocks of the largest power of two dividing its block count; a projection whose
size is not a multiple of 64 is refused.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from lora_sweep.errors import ConfigError
from lora_sweep.packer.loss import output_head
from lora_sweep.packer.model import QUANTIZE

__all__ = ["QUANTIZE", "NF4Linear", "quantize_base", "dequantize_base", "nf4_bytes", "BLOCK", "SCALE_BLOCK"]

BLOCK, SCALE_BLOCK = 64, 256
"""torchao's (and torchtune's) NF4 defaults: weights per absmax scale, scales per double-quantisation factor."""


def _torchao() -> Any:
    """torchao's NF4 module; a one-line error naming the extra when it is not installed."""
    try:  # quiet: the root __init__.py keeps torchao's import-time warnings off stderr
        from torchao.quantization.quantize_.workflows.nf4 import nf4_tensor
    except ImportError as err:
        raise ConfigError("model.quantize: nf4 needs torchao (pip install 'lora-sweep[qlora]')") from err
    return nf4_tensor


def _scale_block(n_blocks: int) -> int:
    """The double-quantisation block: 256, or for a small weight the largest power of two dividing its blocks."""
    if n_blocks % SCALE_BLOCK == 0:
        return SCALE_BLOCK
    return n_blocks & -n_blocks


class NF4Linear(nn.Module):
    """A frozen linear projection whose weight is an NF4 tensor.

    Args:
        weight: (D_out, D_in) torchao ``NF4Tensor``.
        bias: (D_out,) or None, in the activations' dtype, frozen.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)

    @classmethod
    def from_linear(cls, linear: nn.Linear, path: str = "") -> NF4Linear:
        """Quantise ``linear``'s weight (in its own dtype: float32 on CPU keeps the dequantised values exact).

        Raises:
            ConfigError: the weight's size is not a multiple of 64 (NF4's block).
        """
        w = linear.weight.detach()
        if w.numel() % BLOCK:
            raise ConfigError(f"model.quantize: nf4 needs every linear weight's size to be a multiple of {BLOCK}; "
                              f"{path or 'a projection'} is {tuple(w.shape)}")
        nf4 = _torchao().NF4Tensor.from_tensor(w.contiguous(), BLOCK, _scale_block(w.numel() // BLOCK))
        return cls(nf4, linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (..., D_in) -> (..., D_out): the GEMM on the weight dequantised to x's dtype (torchao's linear_nf4)."""
        y = _torchao().linear_nf4(x, self.weight)
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def dequantized(self) -> nn.Linear:
        """A plain ``nn.Linear`` with the dequantised weight (what the NF4 projection computes with)."""
        w = self.weight.get_original_weight()
        out = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None, device=w.device, dtype=w.dtype)
        with torch.no_grad():
            out.weight.copy_(w)
            if self.bias is not None:
                out.bias.copy_(self.bias)
        return out.requires_grad_(False)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, nf4 blocks={BLOCK}/{self.weight.scaler_block_size}"


def _replace(model: nn.Module, swap: type, make: Any) -> list[str]:
    """Replace every module of type ``swap`` but the output head with ``make(module, path)``; their paths."""
    head = output_head(model)
    paths = [p for p, m in model.named_modules() if type(m) is swap and m is not head and p]
    for path in paths:
        parent_path, _, leaf = path.rpartition(".")
        parent = model.get_submodule(parent_path) if parent_path else model
        setattr(parent, leaf, make(getattr(parent, leaf), path))
    return paths


def quantize_base(model: nn.Module, kind: str | None) -> list[str]:
    """Replace the base's ``nn.Linear`` projections (not the output head) by ``NF4Linear`` in place.

    Call before any slot is added (``PackedModel`` wraps what it finds). One weight at a time: the float
    weight is freed as soon as its NF4 copy exists, so the peak is the quantised model plus one weight.

    Args:
        model: the loaded base (any device; its weights' dtype is kept for the dequantised GEMMs).
        kind: ``nf4``, or None (nothing changes).

    Returns:
        The paths of the quantised projections (empty for None).

    Raises:
        ConfigError: an unknown ``kind``, torchao missing, or a weight NF4 cannot hold.
    """
    if kind is None:
        return []
    if kind not in QUANTIZE:
        raise ConfigError(f"model.quantize: must be one of {', '.join(QUANTIZE)} (got {kind!r})")
    head = output_head(model)
    for path, m in model.named_modules():  # checked before any is replaced: a refusal leaves the model as it was
        if type(m) is nn.Linear and m is not head and m.weight.numel() % BLOCK:
            raise ConfigError(f"model.quantize: nf4 needs every linear weight's size to be a multiple of {BLOCK}; "
                              f"{path} is {tuple(m.weight.shape)}")
    paths = _replace(model, nn.Linear, NF4Linear.from_linear)
    if not paths:
        raise ConfigError(f"model.quantize: {type(model).__name__} has no nn.Linear projection to quantise "
                          "(NF4 replaces nn.Linear layers; GPT-2's Conv1D is not supported)")
    model.requires_grad_(False)
    return paths


def dequantize_base(model: nn.Module) -> list[str]:
    """The inverse for merging: every ``NF4Linear`` back to an ``nn.Linear`` with its dequantised weight."""
    return _replace(model, NF4Linear, lambda m, path: m.dequantized())


def nf4_bytes(n_weights: int) -> float:
    """Bytes of ``n_weights`` weights in NF4: 4 bits each, one int8 scale per 64, one fp32 factor per 256 scales."""
    return n_weights * (0.5 + 1 / BLOCK + 4 / (BLOCK * SCALE_BLOCK))
