"""Fused RMSNorm (Llama / Qwen2 / Mistral form) for the frozen base: one kernel forward, one backward.

Math, per token row x (D features), as transformers' ``LlamaRMSNorm`` computes it:

    rstd = 1 / sqrt(mean(x^2) + eps)                 fp32, saved (T,)
    y    = w * round_in(x * rstd)                    round_in: to x's dtype, as the module's ``.to(input_dtype)``
    dx   = rstd * (g - xhat * mean(g * xhat)),  g = dy * w, xhat = x * rstd       (rounding passed straight through)

Eager PyTorch spends ~6 kernels and ~14 passes over fp32 copies of x on it forward and backward, and keeps a fp32 copy
of x for the backward; these read x once forward (write y once) and x, dy once backward (write dx once), and keep only x
and rstd. On a Llama-3-8B step the eager norms are a large share of the base's kernel time (BENCHMARKS.md, "Kernel
tiles, operand dtypes and the fused norms"). The weight is the frozen base's: its gradient, when asked for, comes from a
PyTorch expression, not a kernel.

Shape legend: T rows (tokens, all leading dims flattened), D features, BD = next power of 2 >= D, BM rows per
program (more for narrow rows, so a program moves a few KB). Kernels call Triton builtins only (``tl.reduce``
with ``_jit.SUM_COMBINE``, ``tl.sqrt``): see ``kernels.triton_lora``'s docstring on the interpreter.
"""

from __future__ import annotations

import torch

from lora_sweep.kernels import _jit
from lora_sweep.kernels._jit import SUM_COMBINE, tl, triton

__all__ = ["RMSNormFunction", "rms_norm_triton", "rms_norm_fwd", "rms_norm_bwd"]

_MAX_D = 65536  # one row per program in registers; wider rows would spill


@triton.jit
def _tile(pid, n_rows, D, BM: tl.constexpr, BD: tl.constexpr):
    """Rows (BM,) int64, the mask (BM, BD) and the element offsets (BM, BD) of program ``pid``'s tile."""
    rows = (pid * BM + tl.arange(0, BM)).to(tl.int64)
    cols = tl.arange(0, BD)
    mask = (rows < n_rows)[:, None] & (cols < D)[None, :]
    return rows, mask, rows[:, None] * D + cols[None, :]


@triton.jit(do_not_specialize=["n_rows"])
def _rms_norm_fwd_kernel(
    x_ptr,  # (T, D) input, row-major
    w_ptr,  # (D,) weight
    y_ptr,  # (T, D) output, dtype of promote(w, x)
    rstd_ptr,  # (T,) fp32 1 / sqrt(mean(x^2) + eps)
    n_rows, D, eps,
    BM: tl.constexpr, BD: tl.constexpr,
):
    rows, mask, offs = _tile(tl.program_id(0), n_rows, D, BM, BD)
    cols = tl.arange(0, BD)
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.reduce(x * x, 1, SUM_COMBINE) / D + eps)  # (BM,)
    xn = (x * rstd[:, None]).to(x_ptr.dtype.element_ty).to(tl.float32)  # the module rounds to the input dtype
    w = tl.load(w_ptr + cols, mask=cols < D, other=0.0).to(tl.float32)
    tl.store(y_ptr + offs, (xn * w[None, :]).to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(rstd_ptr + rows, rstd, mask=rows < n_rows)


@triton.jit(do_not_specialize=["n_rows"])
def _rms_norm_bwd_kernel(
    dy_ptr,  # (T, D) gradient of y
    x_ptr,  # (T, D) the forward's input
    w_ptr,  # (D,) weight
    rstd_ptr,  # (T,) fp32 from the forward
    dx_ptr,  # (T, D) gradient of x, x's dtype
    n_rows, D,
    BM: tl.constexpr, BD: tl.constexpr,
):
    rows, mask, offs = _tile(tl.program_id(0), n_rows, D, BM, BD)
    cols = tl.arange(0, BD)
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=cols < D, other=0.0).to(tl.float32)
    rstd = tl.load(rstd_ptr + rows, mask=rows < n_rows, other=0.0)
    g = dy * w[None, :]
    xhat = x * rstd[:, None]
    c = tl.reduce(g * xhat, 1, SUM_COMBINE) / D  # (BM,)
    tl.store(dx_ptr + offs, ((g - xhat * c[:, None]) * rstd[:, None]).to(dx_ptr.dtype.element_ty), mask=mask)


def _blocks(d: int) -> tuple[int, int, int]:
    """(BD, BM, num_warps) for rows of ``d`` features: a tile of about 4096 elements or one row, whichever is
    more; warps grow with the tile (Liger's and the Triton layer-norm tutorial's heuristic)."""
    if d > _MAX_D:
        raise ValueError(f"rms_norm: rows of {d} features are wider than the kernel's {_MAX_D}")
    bd = triton.next_power_of_2(d)
    bm = max(1, min(16, 4096 // bd))
    tile = bd * bm
    return bd, bm, 4 if tile < 2048 else 8 if tile < 8192 else 16


def rms_norm_fwd(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward on flattened rows.

    Args:
        x: (T, D) contiguous input.
        weight: (D,) weight.
        eps: added to the mean square.

    Returns:
        y (T, D) in ``promote(weight, x)`` dtype, and rstd (T,) fp32.
    """
    n_rows, d = x.shape
    y = torch.empty((n_rows, d), dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    rstd = torch.empty(n_rows, dtype=torch.float32, device=x.device)
    bd, bm, warps = _blocks(d)
    if n_rows:
        _jit.launch(_rms_norm_fwd_kernel, (triton.cdiv(n_rows, bm),), x, weight, y, rstd, n_rows, d, eps,
                    BM=bm, BD=bd, num_warps=warps)
    return y, rstd


def rms_norm_bwd(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor) -> torch.Tensor:
    """Gradient of x, (T, D) in x's dtype, from dy (T, D), the forward's x (T, D), weight (D,) and rstd (T,)."""
    n_rows, d = x.shape
    dx = torch.empty_like(x)
    bd, bm, warps = _blocks(d)
    if n_rows:
        _jit.launch(_rms_norm_bwd_kernel, (triton.cdiv(n_rows, bm),), dy, x, weight, rstd, dx, n_rows, d,
                    BM=bm, BD=bd, num_warps=warps)
    return dx


class RMSNormFunction(torch.autograd.Function):
    """``y = w * round_in(x * rstd)`` on flattened rows, differentiable in x (and in w, for a weight that is not
    frozen: a PyTorch reduction, off the fast path)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """x: (T, D) contiguous; weight: (D,) -> (T, D)."""
        y, rstd = rms_norm_fwd(x, weight, eps)
        ctx.save_for_backward(x, weight, rstd)
        ctx.warming = _jit.warm_context()
        return y

    @staticmethod
    def backward(ctx, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return _jit.run_in(ctx.warming, RMSNormFunction._backward, ctx, dy)  # type: ignore[return-value]

    @staticmethod
    def _backward(ctx, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight, rstd = ctx.saved_tensors
        dy = dy.contiguous()
        dx = rms_norm_bwd(dy, x, weight, rstd) if ctx.needs_input_grad[0] else None
        dw = None
        if ctx.needs_input_grad[1]:
            xn = (x.float() * rstd[:, None]).to(x.dtype)
            dw = (dy.float() * xn.float()).sum(0).to(weight.dtype)
        return dx, dw, None


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``kernels.ops.rms_norm(..., impl="triton")``: x (..., D), weight (D,) -> (..., D).

    Raises:
        RuntimeError: x is on the CPU and the Triton interpreter is off.
        ValueError: D is wider than the kernel handles (65,536).
    """
    _jit.check_device(x, "lora_sweep.kernels.triton_norm")
    d = x.shape[-1]
    y = RMSNormFunction.apply(x.reshape(-1, d).contiguous(), weight.contiguous(), float(eps))
    return y.view(*x.shape[:-1], d)
