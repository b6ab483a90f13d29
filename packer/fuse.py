"""Run the frozen base's RMSNorms and SiLU-gated MLP middles as fused Triton kernels.

Once the LoRA side of a pack is cheap, a large base's step is its GEMMs plus eager elementwise ops:
on a Llama-3-8B step of 8 x 1024 tokens on an H200 the base's elementwise kernels took 30% of the
kernel time (167 of 557 ms; BENCHMARKS.md), most of it RMSNorm's fp32 passes. ``fuse_base_ops``
swaps, in place, each module of a class known to compute exactly transformers' Llama RMSNorm or
SiLU-gated MLP for a module that calls ``kernels.rms_norm`` / ``kernels.silu_mul`` (Liger-Kernel's
idea; torchtune reaches the same with ``torch.compile``). The swapped modules hold the original
parameters and children under the same names, so parameter paths and the projections the packer
wraps do not change. Modules of other classes (GPT-2's LayerNorm, Gemma's ``1 + w`` norm, a GELU
MLP) are left alone.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

import kernels
from kernels import Impl

__all__ = ["RMS_NORMS", "GATED_MLPS", "FusedRMSNorm", "FusedGatedMLP", "fuse_base_ops"]

RMS_NORMS = frozenset({"LlamaRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm", "MistralRMSNorm"})
"""Classes whose forward is ``weight * (x * rsqrt(mean(x^2) + eps)).to(x.dtype)`` with the mean in fp32 (checked
against each by ``tests/packer/test_fuse.py``)."""
GATED_MLPS = frozenset({"LlamaMLP", "Qwen2MLP", "Qwen3MLP", "MistralMLP"})
"""Classes whose forward is ``down_proj(act_fn(gate_proj(x)) * up_proj(x))``; fused when ``act_fn`` is SiLU."""


class FusedRMSNorm(nn.Module):
    """An RMSNorm of one of ``RMS_NORMS`` on ``kernels.rms_norm``; same ``weight`` and ``variance_epsilon``."""

    def __init__(self, norm: nn.Module, impl: Impl) -> None:
        super().__init__()
        self.weight = norm.weight
        self.variance_epsilon = float(norm.variance_epsilon)
        self.impl = impl

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (..., D) -> (..., D)."""
        return kernels.rms_norm(x, self.weight, self.variance_epsilon, impl=self.impl)

    def kernel_probe(self, rows: int, seq_len: int) -> tuple[tuple, Callable[[], None]]:
        """What decides this module's kernel variants, and a forward and backward on placeholders of a
        (``rows``, ``seq_len``) batch (``PackedModel.precompile``)."""
        d, dt = self.weight.shape[0], self.weight.dtype

        def run() -> None:
            x = torch.empty(rows, seq_len, d, dtype=dt, device=self.weight.device, requires_grad=True)
            with torch.enable_grad():
                y = self(x)
                y.backward(torch.empty_like(y))

        return (type(self), d, dt, self.weight.requires_grad), run

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}, impl={self.impl}"


class FusedGatedMLP(nn.Module):
    """A SiLU-gated MLP of one of ``GATED_MLPS`` whose middle is ``kernels.silu_mul``; same three projections."""

    def __init__(self, mlp: nn.Module, impl: Impl) -> None:
        super().__init__()
        self.gate_proj = mlp.gate_proj
        self.up_proj = mlp.up_proj
        self.down_proj = mlp.down_proj
        self.impl = impl

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (..., D) -> (..., D); the intermediate (..., I) is ``silu(gate_proj(x)) * up_proj(x)``."""
        return self.down_proj(kernels.silu_mul(self.gate_proj(x), self.up_proj(x), impl=self.impl))

    def kernel_probe(self, rows: int, seq_len: int) -> tuple[tuple, Callable[[], None]]:
        """As ``FusedRMSNorm.kernel_probe``, for the middle alone (the projections have their own)."""
        w = next(self.down_proj.parameters())  # the base weight, wrapped in PackedLoRALinear or not
        width, dt = self.gate_proj.out_features, w.dtype

        def run() -> None:
            gate, up = (torch.empty(rows, seq_len, width, dtype=dt, device=w.device, requires_grad=True)
                        for _ in range(2))
            with torch.enable_grad():
                y = kernels.silu_mul(gate, up, impl=self.impl)
                y.backward(torch.empty_like(y))

        return (type(self), dt), run  # no width: the kernel is compiled alike for any


def _is_silu(act: nn.Module) -> bool:
    """transformers' ``ACT2FN["silu"]``: ``nn.SiLU`` or, in some versions, its own ``SiLUActivation``."""
    return isinstance(act, nn.SiLU) or type(act).__name__ == "SiLUActivation"


def fuse_base_ops(model: nn.Module, impl: Impl = "triton") -> list[str]:
    """Swap every known RMSNorm and SiLU-gated MLP of ``model`` for its fused module, in place, and set ``impl``
    on every fused module, new or swapped in before (by an earlier pack over the same model).

    Args:
        model: a transformers causal LM (any module tree works; unknown classes are skipped).
        impl: what the fused modules call: ``triton`` (CUDA, or the interpreter) swaps; any other implementation
            swaps nothing and makes modules swapped before compute eagerly again (``kernels.reference``).

    Returns:
        Paths of the fused modules, in module order (empty for a model with none of these classes).
    """
    swaps: list[tuple[str, nn.Module]] = []
    fused: list[str] = []
    for path, module in model.named_modules():
        name = type(module).__name__
        if isinstance(module, (FusedRMSNorm, FusedGatedMLP)):
            module.impl = impl
            fused.append(path)
        elif impl == "triton" and name in RMS_NORMS:
            swaps.append((path, FusedRMSNorm(module, impl)))
        elif impl == "triton" and name in GATED_MLPS and _is_silu(module.act_fn):
            swaps.append((path, FusedGatedMLP(module, impl)))
    for path, new in swaps:  # after the walk: never change a tree while iterating it
        parent_path, _, leaf = path.rpartition(".")
        setattr(model.get_submodule(parent_path) if parent_path else model, leaf, new)
    order = {p: i for i, (p, _) in enumerate(model.named_modules())}
    return sorted(fused + [p for p, _ in swaps], key=order.__getitem__)
