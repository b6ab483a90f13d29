"""Fused SiLU-gated product ``silu(gate) * up`` (the Llama / Qwen2 MLP's middle): one kernel each way.

Math, elementwise, in fp32 with one rounding of each result:

    s      = gate * sigmoid(gate)
    y      = s * up
    d_up   = dy * s
    d_gate = dy * up * sigmoid(gate) * (1 + gate * (1 - sigmoid(gate)))

Eager PyTorch runs it as ``silu``, ``mul`` and three backward kernels, keeping ``silu(gate)`` as a third
(T, I) tensor for the backward; these read gate and up once forward (write y) and gate, up, dy once backward
(write both gradients), recomputing the sigmoid, and keep only gate and up. Kernels call Triton builtins only
(``tl.exp``, not the jit'd ``tl.sigmoid``): see ``kernels.triton_lora``'s docstring on the interpreter.
"""

from __future__ import annotations

import torch

from lora_sweep.kernels import _jit
from lora_sweep.kernels._jit import tl, triton

__all__ = ["SiluMulFunction", "silu_mul_triton", "silu_mul_fwd", "silu_mul_bwd"]

_BLOCK = 2048  # elements per program: 4 KB of bf16 per operand


@triton.jit(do_not_specialize=["n"])
def _silu_mul_fwd_kernel(
    gate_ptr,  # (n,) gate projection output, flat
    up_ptr,  # (n,) up projection output, flat
    y_ptr,  # (n,) silu(gate) * up
    n,
    BLOCK: tl.constexpr,
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(gate_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    s = g / (1.0 + tl.exp(-g))
    tl.store(y_ptr + offs, (s * u).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["n"])
def _silu_mul_bwd_kernel(
    dy_ptr,  # (n,) gradient of y, flat
    gate_ptr,  # (n,) the forward's gate
    up_ptr,  # (n,) the forward's up
    dgate_ptr,  # (n,) gradient of gate
    dup_ptr,  # (n,) gradient of up
    n,
    BLOCK: tl.constexpr,
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    dy = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(gate_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    sig = 1.0 / (1.0 + tl.exp(-g))
    tl.store(dup_ptr + offs, (dy * g * sig).to(dup_ptr.dtype.element_ty), mask=mask)
    tl.store(dgate_ptr + offs, (dy * u * sig * (1.0 + g * (1.0 - sig))).to(dgate_ptr.dtype.element_ty), mask=mask)


def silu_mul_fwd(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of two contiguous tensors of one shape and dtype."""
    y = torch.empty_like(gate)
    n = gate.numel()
    if n:
        _jit.launch(_silu_mul_fwd_kernel, (triton.cdiv(n, _BLOCK),), gate, up, y, n, BLOCK=_BLOCK, num_warps=8)
    return y


def silu_mul_bwd(dy: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(d gate, d up) from dy and the forward's gate and up (contiguous, one shape and dtype)."""
    dgate, dup = torch.empty_like(gate), torch.empty_like(up)
    n = gate.numel()
    if n:
        _jit.launch(_silu_mul_bwd_kernel, (triton.cdiv(n, _BLOCK),), dy, gate, up, dgate, dup, n, BLOCK=_BLOCK,
                    num_warps=8)
    return dgate, dup


class SiluMulFunction(torch.autograd.Function):
    """``silu(gate) * up``, differentiable in both."""

    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """gate, up: contiguous, same shape and dtype -> same."""
        ctx.save_for_backward(gate, up)
        ctx.warming = _jit.warm_context()
        return silu_mul_fwd(gate, up)

    @staticmethod
    def backward(ctx, dy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        gate, up = ctx.saved_tensors
        return _jit.run_in(ctx.warming, silu_mul_bwd, dy.contiguous(), gate, up)  # type: ignore[return-value]


def silu_mul_triton(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``kernels.ops.silu_mul(..., impl="triton")``.

    Raises:
        RuntimeError: on the CPU with the Triton interpreter off.
        ValueError: gate and up differ in shape or dtype.
    """
    _jit.check_device(gate, "lora_sweep.kernels.triton_swiglu")
    if gate.shape != up.shape or gate.dtype != up.dtype:
        raise ValueError(f"silu_mul: gate {tuple(gate.shape)} {gate.dtype} and up {tuple(up.shape)} {up.dtype} "
                         "must match")
    return SiluMulFunction.apply(gate.contiguous(), up.contiguous())
