"""Fused rotary position embedding of q and k (transformers' Llama / Qwen2 / Mistral / Qwen3 form): one kernel
forward, one backward, each for q and k together.

Math, per token (b, l) and head, with h = d / 2, x = (x1, x2) the two halves of a head's row, cos = (c1, c2),
sin = (s1, s2) the token's rows (transformers' ``apply_rotary_pos_emb``, ``q * cos + rotate_half(q) * sin``):

    out[:h] = rnd(rnd(x1 * c1) + rnd(-x2 * s1))        dx[:h] = rnd(rnd(g1 * c1) + rnd(g2 * s2))
    out[h:] = rnd(rnd(x2 * c2) + rnd( x1 * s2))        dx[h:] = rnd(rnd(g2 * c2) - rnd(g1 * s1))

rnd rounds to the io dtype; math in fp32. These are the roundings of eager PyTorch's separate ``mul`` and
``add`` kernels (each computes in fp32 and rounds once; ``neg`` and ``cat`` are exact), so the results are the
same bits. The backward is autograd's of that formula: ``mul``'s backward gives rnd(g * cos) and rnd(g * sin),
``cat`` / ``neg`` / the two slices route rnd(g * sin)'s halves to the other half (negated for x2), and the three
contributions to dx are added, one of the two slice terms being an exact zero at each position. With
s' = (-s2, -s1) the backward is the forward's formula on g, so one kernel serves both (``BACKWARD``). fp32 runs
with ``enable_fp_fusion=False``: otherwise the compiler contracts ``x1 * c1 - x2 * s1`` into an fma, one
rounding fewer than eager's kernels.

Eager PyTorch runs it as ~10 kernels forward (mul, neg, cat, mul, add for q and for k) and more backward (muls,
neg, zero fill + copy per slice backward, adds), and its q / k gradients come out contiguous in (B, H, L, d), so
the ``view(B, L, H, d).transpose(1, 2)`` upstream copies them back. Here q and k are read in place through their
strides (in the model: transposed views of (B, L, H * d) projections), the outputs and gradients are
``empty_like`` (the inputs' strides), and the upstream transpose and view's backward need no copy.

Shape legend: B batch, H query heads, Hk key heads (Hk <= H under GQA), L positions, d head width, T = B * L
tokens; cos / sin (Bc, L, d) with Bc = B or 1 (broadcast over the batch). Grid: (T / BT, H + Hk), one program per
block of BT tokens and one head of q or k. Kernels call Triton builtins only: see ``kernels.triton_lora``'s
docstring on the interpreter.
"""

from __future__ import annotations

import torch

from lora_sweep.kernels import _jit
from lora_sweep.kernels._jit import tl, triton

__all__ = ["RopeFunction", "rope_triton", "rope_launch", "rope_problem"]

_TILE = 2048  # elements of a (BT, BHALF) tile per program
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit
def _rnd(x, dt: tl.constexpr):
    """fp32 x rounded to ``dt``'s precision (to nearest, ties to even), kept in fp32. bf16 by its bits: the
    interpreter's fp32 -> bf16 cast truncates; compiled, this is the ``cvt.rn`` result (NaN kept as it is)."""
    r = x
    if dt == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = bits + 0x7FFF + ((bits >> 16) & 1)
        r = tl.where(x == x, ((bits >> 16) << 16).to(tl.float32, bitcast=True), x)
    elif dt != tl.float32:
        r = x.to(dt).to(tl.float32)
    return r


@triton.jit
def _rotate(x_ptr, o_ptr, head, t_b, t_l, j, mask, half,
            sx_b, sx_h, sx_l, sx_d, so_b, so_h, so_l, so_d, c1, c2, s1, s2):
    """Rotate one head's (BT, BHALF) half-rows of x into o: o1 = rnd(x1 c1) - rnd(x2 s1), o2 = rnd(x2 c2) +
    rnd(x1 s2), each product rounded to o's dtype before the sum, as eager's separate kernels do."""
    dt = o_ptr.dtype.element_ty
    x_off = (t_b * sx_b + head * sx_h + t_l * sx_l)[:, None] + (j * sx_d)[None, :]
    o_off = (t_b * so_b + head * so_h + t_l * so_l)[:, None] + (j * so_d)[None, :]
    x1 = tl.load(x_ptr + x_off, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + x_off + half * sx_d, mask=mask, other=0.0).to(tl.float32)
    o1 = _rnd(_rnd(x1 * c1, dt) - _rnd(x2 * s1, dt), dt)  # exact in dt: the store's cast changes nothing
    o2 = _rnd(_rnd(x2 * c2, dt) + _rnd(x1 * s2, dt), dt)
    tl.store(o_ptr + o_off, o1.to(dt), mask=mask)
    tl.store(o_ptr + o_off + half * so_d, o2.to(dt), mask=mask)


@triton.jit(do_not_specialize=["n_tok"])
def _rope_kernel(
    q_ptr, k_ptr,  # (B, H, L, d), (B, Hk, L, d): q and k (forward) or their output gradients (backward), strided
    qo_ptr, ko_ptr,  # same shapes: the rotated q and k (forward) or the gradients of q and k (backward)
    cos_ptr, sin_ptr,  # (Bc, L, d) strided; batch stride 0 when broadcast
    n_tok, L, H, half,
    sq_b, sq_h, sq_l, sq_d, sqo_b, sqo_h, sqo_l, sqo_d,
    sk_b, sk_h, sk_l, sk_d, sko_b, sko_h, sko_l, sko_d,
    sc_b, sc_l, sc_d, ss_b, ss_l, ss_d,
    BACKWARD: tl.constexpr, BT: tl.constexpr, BHALF: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64) * BT + tl.arange(0, BT)  # (BT,) flat token b * L + l
    head = tl.program_id(1).to(tl.int64)  # < H: a head of q; else of k
    t_b, t_l = t // L, t % L
    j = tl.arange(0, BHALF)
    mask = (t < n_tok)[:, None] & (j < half)[None, :]
    c_off = (t_b * sc_b + t_l * sc_l)[:, None] + (j * sc_d)[None, :]
    s_off = (t_b * ss_b + t_l * ss_l)[:, None] + (j * ss_d)[None, :]
    c1 = tl.load(cos_ptr + c_off, mask=mask, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + c_off + half * sc_d, mask=mask, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + s_off, mask=mask, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + s_off + half * ss_d, mask=mask, other=0.0).to(tl.float32)
    if BACKWARD:  # dx = the forward's formula on g with sin' = (-s2, -s1); rnd(-v) = -rnd(v) exactly
        s1, s2 = -s2, -s1
    if head < H:
        _rotate(q_ptr, qo_ptr, head, t_b, t_l, j, mask, half,
                sq_b, sq_h, sq_l, sq_d, sqo_b, sqo_h, sqo_l, sqo_d, c1, c2, s1, s2)
    else:
        _rotate(k_ptr, ko_ptr, head - H, t_b, t_l, j, mask, half,
                sk_b, sk_h, sk_l, sk_d, sko_b, sko_h, sko_l, sko_d, c1, c2, s1, s2)


def rope_launch(q: torch.Tensor, k: torch.Tensor, q_out: torch.Tensor, k_out: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor, *, backward: bool) -> None:
    """One launch over q and k: ``q_out, k_out = rope(q, k)`` (forward) or the gradients of q, k from those of
    the outputs (``backward``: q, k are then the output gradients). Any strides; cos / sin (Bc, L, d), Bc in
    {1, B}."""
    b, h, seq, d = q.shape
    n_tok = b * seq
    if n_tok == 0 or d == 0 or h + k.shape[1] == 0:
        return
    bhalf = triton.next_power_of_2(d // 2)
    bt = max(1, min(64, _TILE // bhalf))
    sc, ss = list(cos.stride()), list(sin.stride())
    if cos.shape[0] == 1:
        sc[0] = ss[0] = 0  # one row of positions for every batch row
    _jit.launch(_rope_kernel, (triton.cdiv(n_tok, bt), h + k.shape[1]), q, k, q_out, k_out, cos, sin,
                n_tok, seq, h, d // 2, *q.stride(), *q_out.stride(), *k.stride(), *k_out.stride(), *sc, *ss,
                BACKWARD=backward, BT=bt, BHALF=bhalf, num_warps=4, enable_fp_fusion=False)


class RopeFunction(torch.autograd.Function):
    """``(q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin)``, differentiable in q and k (cos and
    sin are constants: the positions' table)."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q: (B, H, L, d), k: (B, Hk, L, d), any strides; cos, sin: (Bc, L, d) -> (B, H, L, d), (B, Hk, L, d)
        with the strides of q and k."""
        q_out, k_out = torch.empty_like(q), torch.empty_like(k)
        rope_launch(q, k, q_out, k_out, cos, sin, backward=False)
        ctx.save_for_backward(cos, sin)
        ctx.layouts = ((q_out.shape, q_out.stride()), (k_out.shape, k_out.stride()))
        ctx.warming = _jit.warm_context()
        return q_out, k_out

    @staticmethod
    def backward(ctx, dq_out: torch.Tensor, dk_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return _jit.run_in(ctx.warming, RopeFunction._backward, ctx, dq_out, dk_out)  # type: ignore[return-value]

    @staticmethod
    def _backward(ctx, dq_out: torch.Tensor, dk_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        cos, sin = ctx.saved_tensors
        (q_shape, q_stride), (k_shape, k_stride) = ctx.layouts
        # the strides q and k had: the transpose and view upstream then pass the gradients on without a copy
        dq = torch.empty_strided(q_shape, q_stride, dtype=dq_out.dtype, device=dq_out.device)
        dk = torch.empty_strided(k_shape, k_stride, dtype=dk_out.dtype, device=dk_out.device)
        rope_launch(dq_out, dk_out, dq, dk, cos, sin, backward=True)
        need_q, need_k = ctx.needs_input_grad[:2]
        return dq if need_q else None, dk if need_k else None, None, None


def rope_triton(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``kernels.ops.rope(..., impl="triton")``: q (B, H, L, d), k (B, Hk, L, d), cos / sin (Bc, L, d) with Bc in
    {1, B} -> rotated q and k, with the strides of q and k.

    Raises:
        RuntimeError: on the CPU with the Triton interpreter off.
        ValueError: shapes, dtypes or devices that transformers' formula would not take as they are (it would
            broadcast or promote), or cos / sin that require a gradient (the kernel gives none).
    """
    _jit.check_device(q, "lora_sweep.kernels.triton_rope")
    problem = rope_problem(q, k, cos, sin)
    if problem:
        raise ValueError(f"rope: {problem}")
    return RopeFunction.apply(q, k, cos, sin)


def rope_problem(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> str | None:
    """Why the kernel does not take these operands as they are (None: it does)."""
    if q.dim() != 4 or k.dim() != 4 or cos.dim() != 3 or cos.shape != sin.shape:
        return (f"q {tuple(q.shape)}, k {tuple(k.shape)} must be (B, H, L, d) and cos {tuple(cos.shape)}, sin "
                f"{tuple(sin.shape)} one (B or 1, L, d)")
    b, _, seq, d = q.shape
    if k.shape[0] != b or k.shape[2:] != q.shape[2:] or cos.shape[0] not in (1, b) or cos.shape[1:] != (seq, d):
        return f"q {tuple(q.shape)}, k {tuple(k.shape)} and cos {tuple(cos.shape)} disagree on B, L or d"
    if d % 2:
        return f"the head width {d} is odd"
    if len({q.dtype, k.dtype, cos.dtype, sin.dtype}) != 1 or q.dtype not in _DTYPES:
        return f"dtypes {q.dtype}, {k.dtype}, {cos.dtype}, {sin.dtype} must be one of {_DTYPES}"
    if len({q.device, k.device, cos.device, sin.device}) != 1:
        return "q, k, cos and sin must be on one device"
    if cos.requires_grad or sin.requires_grad:
        return "cos and sin must not require grad"
    return None
