"""Packed multi-adapter LoRA ops, and the frozen base's fused RMSNorm, SiLU-gated product and RoPE.

``packed_lora_eval`` is the entry point of the LoRA term (``packed_lora_eval_linear`` with the base GEMM; on a pack's
tables ``packed_lora``, with ``dora_scale`` after it for DoRA slots);
``rms_norm``, ``silu_mul`` and ``rope`` are those of the base's elementwise ops; ``linear_ce`` is a fixed-shape
batch's per-slot loss through the frozen output head. The implementation is an explicit argument so the Triton
kernels drop in without touching the packer. Imports without triton: the Triton modules (``kernels.triton_lora``,
``triton_dora``, ``triton_norm``, ``triton_swiglu``, ``triton_rope``, ``triton_ce``) are loaded on the first
``impl="triton"`` call, after a test's ``TRITON_INTERPRET=1`` has been set.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable
from pathlib import Path
from typing import Literal

import torch
import torch.nn.functional as F

from lora_sweep.kernels import reference
from lora_sweep.kernels._launch import (
    CHUNK_COL,
    FREE_FLT,
    SEG_FLT_COL,
    SEG_FLT_FIELDS,
    SEG_INT_COL,
    SEG_INT_FIELDS,
    TILE_COL,
    Chunk,
    SegFlt,
    SegInt,
    SegmentMeta,
    Tile,
    free_segment,
    segment_meta,
    to_device_async,
)
from lora_sweep.kernels.meta import LayerRanks, PackLayout, dropout_seed
from lora_sweep.kernels.reference import lora_loop, lora_masked_dense

__all__ = ["packed_lora_eval", "packed_lora_eval_linear", "packed_lora", "dora_scale", "dora_factors", "dropout_bits",
           "dropped_part", "precompile",
           "hash_compiler_early", "use_kernel_cache",
           "lora_operand_dtype",
           "rms_norm", "silu_mul", "rope", "rope_problem", "linear_ce", "segmented_sumsq", "segmented_adamw_",
           "segment_meta",
           "SegmentMeta",
           "SegInt", "SegFlt", "Tile", "Chunk", "SEG_INT_COL", "SEG_FLT_COL", "TILE_COL", "CHUNK_COL",
           "SEG_INT_FIELDS", "SEG_FLT_FIELDS", "FREE_FLT", "free_segment",
           "PackLayout", "LayerRanks",
           "dropout_seed", "IMPLS", "Impl", "resolve_impl", "triton_available", "to_device_async"]

Impl = Literal["torch", "loop", "triton", "auto"]
IMPLS: tuple[str, ...] = ("torch", "loop", "triton", "auto")
"""``torch``: masked-dense PyTorch (any device, a constant number of ops per layer); ``loop``: the
per-slot loop oracle; ``triton``: the Triton kernels (CUDA, or the CPU interpreter); ``auto``: triton
for CUDA inputs when triton is installed, else torch."""


def triton_available() -> bool:
    """Whether triton is installed (without importing it)."""
    return importlib.util.find_spec("triton") is not None


def resolve_impl(impl: Impl, device: torch.device) -> Impl:
    """The implementation ``impl`` means on ``device``: ``auto`` is triton for CUDA when triton is
    installed, else torch; any other name is itself."""
    if impl == "auto":
        return "triton" if device.type == "cuda" and triton_available() else "torch"
    return impl


def _triton_module(name: str = "triton_lora"):  # type: ignore[no-untyped-def]
    """``kernels.<name>`` (a Triton kernel module), imported on first use (after a test's ``TRITON_INTERPRET=1``)."""
    if not triton_available():
        raise ImportError("impl='triton' needs triton: pip install 'lora-sweep[triton]' (or use impl='auto')")
    return importlib.import_module(f"lora_sweep.kernels.{name}")


def packed_lora_eval(x: torch.Tensor, base_out: torch.Tensor, a_cat: torch.Tensor, bt_cat: torch.Tensor,
                layout: PackLayout, ranks: LayerRanks, *, impl: Impl = "torch") -> torch.Tensor:
    """Add every slot's LoRA term to the base output of one layer.

    Args:
        x: (B, L, D_in) layer input, rows grouped by slot as ``layout`` says.
        base_out: (B, L, D_out) output of the frozen base layer on ``x``.
        a_cat: (R, D_in) every slot's A stacked by rows (R = sum of ``ranks.rank``).
        bt_cat: (R, D_out) every slot's B^T stacked the same way.
        layout: row segments of the packed batch.
        ranks: per-slot rank (0 = slot skips this layer) and scale of this layer.
        impl: which implementation computes it.

    Returns:
        (B, L, D_out) tensor; differentiable in x, base_out, a_cat and bt_cat.

    Raises:
        ValueError: unknown ``impl``.
        ImportError: ``impl="triton"`` without triton installed.
    """
    if impl == "auto":
        impl = resolve_impl(impl, x.device)
    if impl == "torch":
        return lora_masked_dense(x, base_out, a_cat, bt_cat, layout, ranks)
    if impl == "loop":
        return lora_loop(x, base_out, a_cat, bt_cat, layout, ranks)
    if impl == "triton":
        return _triton_module().packed_lora_triton(x, base_out, a_cat, bt_cat, layout, ranks)
    raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")


def packed_lora_eval_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, a_cat: torch.Tensor,
                       bt_cat: torch.Tensor, layout: PackLayout, ranks: LayerRanks, *,
                       impl: Impl = "torch") -> torch.Tensor:
    """A frozen linear layer plus every slot's LoRA term: ``packed_lora_eval(x, F.linear(x, weight, bias), ...)``.

    The Triton path fuses the two (the LoRA term is written first and the cuBLAS GEMM accumulates onto
    it, forward and backward), saving the passes over the output that a separate add costs.

    Args:
        x: (B, L, D_in) layer input, rows grouped by slot as ``layout`` says.
        weight: (D_out, D_in) base weight.
        bias: (D_out,) base bias, or None.
        a_cat, bt_cat, layout, ranks, impl: as ``packed_lora_eval``.

    Returns:
        (B, L, D_out) tensor; differentiable in x, a_cat and bt_cat (and weight, bias if they require grad).
    """
    if impl == "auto":
        impl = resolve_impl(impl, x.device)
    if impl != "triton":
        return packed_lora_eval(x, F.linear(x, weight, bias), a_cat, bt_cat, layout, ranks, impl=impl)
    return _triton_module().packed_lora_triton(x, None, a_cat, bt_cat, layout, ranks, weight=weight, bias=bias)


def packed_lora(x: torch.Tensor, base_out: torch.Tensor | None, weight: torch.Tensor | None,
                       bias: torch.Tensor | None, a_cat: torch.Tensor, bt_cat: torch.Tensor,
                       meta: SegmentMeta, grads: tuple[torch.Tensor, torch.Tensor] | None = None,
                       ops: tuple[torch.Tensor, torch.Tensor] | None = None,
                       keep: torch.Tensor | None = None) -> torch.Tensor:
    """The Triton packed LoRA over prebuilt tables (``segment_meta``): no host work, no copy, so it can be
    captured in a CUDA graph. Same math as ``packed_lora_eval_linear`` (``weight`` given) or ``packed_lora_eval``
    (``base_out`` given).

    Args:
        x: (T, D_in) flattened layer input.
        base_out: (T, D_out) frozen base output, or None with ``weight``.
        weight: (D_out, D_in) frozen base weight, or None with ``base_out``.
        bias: (D_out,) or None.
        a_cat: (C * RB, D_in) every slot's A, slot g at rows ``g * RB``; rank padding zero.
        bt_cat: (C * RB, D_out) B^T laid out the same way.
        meta: the tables, with this layer's ``layer_id``.
        grads: (C * RB, D_in) and (C * RB, D_out) fp32 buffers the weight gradients are added to in place (the
            pack's gradient views), or None to hand them to autograd.
        ops: a_cat and bt_cat already in ``lora_operand_dtype(x.dtype)`` (cast once per step), or None.
        keep: the layer call's dropout bits (``dropout_bits(meta, x)``: a caller that needs them too draws them),
            or None to draw them here when ``meta.has_dropout``.

    Returns:
        (T, D_out); differentiable in x (and in a_cat and bt_cat unless ``grads`` takes their gradients).
    """
    return _triton_module().PackedLoRAFunction.apply(x, base_out, weight, bias, a_cat, bt_cat, meta, grads, ops,
                                                     keep)


def dropout_bits(meta: SegmentMeta, x: torch.Tensor) -> torch.Tensor:
    """Every slot's dropout keep mask of one layer call on x (T, D_in), as the Triton kernels draw it: (T, ceil(D_in /
    32)) int32 bits (``kernels.triton_dropout.keep_bits``)."""
    return _triton_module("triton_dropout").keep_bits(meta, x)


def dropped_part(x: torch.Tensor, bits: torch.Tensor, meta: SegmentMeta, sel: torch.Tensor,
                 capacity: int) -> torch.Tensor:
    """What dropout removed from the selected slots' tokens of x, ``x - drop(x)``, from the layer call's bits, on the
    Triton kernels (``kernels.triton_dropout.DroppedPartFunction``).

    Args:
        x: (T, D_in) the layer input, slot g owning the g-th block of T / C tokens.
        bits: ``dropout_bits(meta, x)``; sel: (k,) int64 the slots; capacity: C.

    Returns:
        (k * T / C, D_in), block i slot ``sel[i]``'s; differentiable in x.
    """
    return _triton_module("triton_dropout").DroppedPartFunction.apply(x.contiguous(), bits, meta, sel, capacity)


def dora_scale(y: torch.Tensor, ratio: torch.Tensor, gain: torch.Tensor, bias: torch.Tensor | None,
               grad: torch.Tensor, res: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """DoRA's per-slot column rescale of a pack's projection output, on the Triton kernels (``kernels.triton_dora``):
    ``y + (r - 1) (y - b - e)``, slot g owning the g-th block of T / C tokens; e = ``W (x - drop(x))`` on a DoRA
    slot with dropout (PEFT's DoRA term sees the dropped input), 0 elsewhere.

    Args:
        y: (T, D) ``packed_lora``'s output (base, bias and LoRA term).
        ratio: (C, D) fp32 ``m / ||W + s B A||`` per slot and column, 1 for a plain slot (a constant of the step).
        gain: (C, D) fp32 ``1 / ||W + s B A||`` for a DoRA slot adapting the layer, 0 elsewhere.
        bias: (D,) the base's bias, or None.
        grad: (C, D) fp32 the layer's magnitude gradients, which the backward adds ``gain * sum dout (y - b - e)``
            into.
        res: (e, pos), or None (e = 0 everywhere): e (k * T / C, D) in y's dtype, one block per slot with dropout,
            and pos (C,) each slot's block of e, -1 for none.

    Returns:
        (T, D); differentiable in y and e.
    """
    return _triton_module("triton_dora").dora_scale_triton(y, ratio, gain, bias, grad, res)


def dora_factors(wa: torch.Tensor, bt: torch.Tensor, aat: torch.Tensor, wsq: torch.Tensor, m: torch.Tensor,
                 on: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Every slot's DoRA factors of one projection on the Triton kernels (``kernels.triton_dora``): ``ratio = m / n``
    (1 for a slot that is not DoRA) and ``gain = 1 / n`` (0 for it), n = ``||W + s B A||`` per output row, detached.

    Args:
        wa: (C * RB, D_out) fp32 the slots' ``A W^T`` (slot g's rows ``g * RB ..``; rank padding zero).
        bt: (C * RB, D_out) fp32 their B^T.
        aat: (C, RB, RB) fp32 their ``A A^T``.
        wsq: (D_out,) squared row norms of the base weight W.
        m: (C, D_out) magnitudes; on: (C,) 1 for a DoRA slot adapting the layer; scale: (C,) the slots' scales.

    Returns:
        (C, D_out) fp32 ratio and gain.
    """
    return _triton_module("triton_dora").dora_factors_triton(wa, bt, aat, wsq, m, on, scale)


def lora_operand_dtype(act: torch.dtype) -> torch.dtype:
    """The dtype the Triton LoRA kernels read packed weights in for activations of ``act`` (fp32 or ``act``)."""
    return _triton_module().operand_dtype(act)


def segmented_sumsq(grad: torch.Tensor, segs: torch.Tensor, rank: torch.Tensor, rank_bucket: int) -> torch.Tensor:
    """Per-slot sum of squares of a pack's flat gradients (``kernels.triton_adamw``): (C,) fp32."""
    return _triton_module("triton_adamw").segmented_sumsq(grad, segs, rank, rank_bucket)


def segmented_adamw_(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                     segs: torch.Tensor, rank: torch.Tensor, coef: torch.Tensor, opt: torch.Tensor,
                     rank_bucket: int) -> None:
    """Clip, AdamW-update and zero a pack's flat buffers in one kernel (``kernels.triton_adamw``)."""
    _triton_module("triton_adamw").segmented_adamw_(param, grad, exp_avg, exp_avg_sq, segs, rank, coef, opt,
                                                    rank_bucket)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *, impl: Impl = "torch") -> torch.Tensor:
    """transformers' Llama-style RMSNorm: ``weight * (x / sqrt(mean(x^2) + eps)).to(x.dtype)``, mean square in fp32.

    Args:
        x: (..., D) input.
        weight: (D,) weight.
        eps: added to the mean square.
        impl: ``triton`` (``kernels.triton_norm``: one kernel each way), ``torch`` / ``loop`` (``reference.rms_norm``,
            eager PyTorch) or ``auto``.

    Returns:
        (..., D) in ``promote(weight, x)`` dtype; differentiable in x (and weight).
    """
    if resolve_impl(impl, x.device) == "triton":
        return _triton_module("triton_norm").rms_norm_triton(x, weight, eps)
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    return reference.rms_norm(x, weight, eps)


def silu_mul(gate: torch.Tensor, up: torch.Tensor, *, impl: Impl = "torch") -> torch.Tensor:
    """``silu(gate) * up`` (a gated MLP's middle); ``impl`` as in ``rms_norm`` (``triton``: ``kernels.triton_swiglu``).

    Args:
        gate: (..., I) gate projection output.
        up: (..., I) up projection output, same shape and dtype.

    Returns:
        (..., I); differentiable in both.
    """
    if resolve_impl(impl, gate.device) == "triton":
        return _triton_module("triton_swiglu").silu_mul_triton(gate, up)
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    return reference.silu_mul(gate, up)


def rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *,
         impl: Impl = "torch") -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary position embedding of q and k, transformers' ``apply_rotary_pos_emb(q, k, cos, sin)`` (``q * cos +
    rotate_half(q) * sin``, the same for k); ``impl`` as in ``rms_norm`` (``triton``: ``kernels.triton_rope``, one
    kernel each way for q and k together, the same bits as eager in any dtype).

    Args:
        q: (B, H, L, d) queries, any strides (in a model: a transposed view of (B, L, H * d)).
        k: (B, Hk, L, d) keys, Hk <= H (GQA), any strides.
        cos: (B or 1, L, d) the positions' cosines, in q's dtype (what transformers' rotary module returns).
        sin: (B or 1, L, d) their sines.

    Returns:
        (B, H, L, d), (B, Hk, L, d); on the Triton path with the strides of q and k, their gradients too.
        Differentiable in q and k (and, eagerly, in cos and sin).

    Raises:
        ValueError: on the Triton path, operands it does not take (``kernels.triton_rope.rope_problem``).
    """
    if resolve_impl(impl, q.device) == "triton":
        return _triton_module("triton_rope").rope_triton(q, k, cos, sin)
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    return reference.rope(q, k, cos, sin)


def rope_problem(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> str | None:
    """Why ``rope(..., impl="triton")`` would refuse these operands (None: it takes them; needs triton)."""
    return _triton_module("triton_rope").rope_problem(q, k, cos, sin)


def linear_ce(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor,
                     capacity: int, *, impl: Impl = "torch",
                     chunk: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-slot mean next-token cross-entropy of ``F.linear(hidden, weight, bias)`` for a frozen head, slot g owning
    rows ``g * T / C ..`` of a fixed-shape batch.

    ``triton`` (``kernels.triton_ce``): no fp32 logits; the logits are overwritten by their gradient in the forward
    and freed there, the gradient of ``hidden`` kept (T, H) for the backward; with no gradient to compute, the
    forward alone. ``torch`` / ``loop``: ``reference.linear_ce`` (fp32 logits, torch's cross-entropy).

    Args:
        hidden: (T, H) hidden states (after the final norm).
        weight: (V, H) the head's weight, frozen; bias: (V,) frozen, or None.
        targets: (T,) int64 next-token targets, already shifted; -100 where a row has no loss.
        capacity: C, slots; T is a multiple of it.
        impl: which implementation computes it.
        chunk: ``triton``: the logits of at most this many rows exist at a time (fixed row ranges, so a captured
            graph holds one chunk's logits, not T's); None: all at once. The other implementations ignore it.

    Returns:
        (C,) fp32 mean losses (0 for a slot without targets), differentiable in ``hidden``, and (C,) fp32 counts.
    """
    if resolve_impl(impl, hidden.device) == "triton":
        return _triton_module("triton_ce").linear_ce_triton(hidden, weight, bias, targets, capacity, chunk)
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    return reference.linear_ce(hidden, weight, bias, targets, capacity)


def precompile(run: Callable[[], object]) -> None:
    """Compile, in parallel, the Triton kernel variants that ``run`` launches (``kernels._jit.precompile``:
    launches become compile-only warm-ups while ``run`` executes)."""
    _triton_module("_jit").precompile(run)


def use_kernel_cache(root: Path, device: torch.device) -> Path | None:
    """Keep compiled Triton kernels under ``root`` across runs, keyed by Triton's version and the device
    (``kernels._jit.use_kernel_cache``; the user's ``TRITON_CACHE_DIR`` wins); None without triton."""
    return _triton_module("_jit").use_kernel_cache(root, device) if triton_available() else None


def hash_compiler_early() -> None:
    """Where the Triton kernels will run, start hashing Triton's compiler on a thread now, beside the Python work
    that comes before the first kernel (``kernels._jit.hash_compiler_early``); nothing without triton."""
    if triton_available():
        _triton_module("_jit").hash_compiler_early()
