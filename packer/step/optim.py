"""The pack's optimizer step: per-slot gradient norm, clipping and AdamW, all from device tables.

torch's ``_multi_tensor_adam`` arithmetic with decoupled weight decay (``torch.optim.AdamW``) on the
layer-major buffers of ``packer.model.store.SlotStore``, with every per-slot number read from the step's optimizer
table (``ShapeBuffers.opt``) instead of Python scalars, so that a captured graph replays it for any mix of slots,
learning rates and schedule positions. The host fills the table (``optimizer_row``); a free slot, or a warm-up
step, gets the no-op row (``NOOP``): zero step size, decay 1, betas 1, which leaves weights and moments exactly
as they were. On the Triton path two kernels do it (``kernels.triton_adamw``); elsewhere a few torch ops per
layer on ``(C, rows * D)`` views with ``(C, 1)`` columns. DoRA's magnitudes (``packer.variants.magnitude``) are one more
row per slot and layer, in the same clip norm and step. B^T takes its own decay and step size from the row (LoRA+'s
ratio); a variant changes its slot's columns (``Variant.optimizer``) and the pack's gradients before the norm and
before the step (``Variant.before_norm`` / ``before_step``: LoRA-FA).
"""

from __future__ import annotations

import math

import torch

from lora_sweep.kernels import ops
from lora_sweep.packer.model.store import ShapeBuffers, SlotStore
from lora_sweep.packer.plan import AdapterSpec
from lora_sweep.packer.variants import OPT_COLUMNS

__all__ = ["adamw_step", "optimizer_row", "lr_schedule", "NOOP", "ACCUMULATE"]


def lr_schedule(spec: AdapterSpec):  # type: ignore[no-untyped-def]
    """step -> learning-rate multiplier, by the names and formulas of ``transformers.get_scheduler``."""
    from transformers import get_scheduler

    name = "constant_with_warmup" if spec.schedule == "constant" else spec.schedule
    holder = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=spec.lr)  # LambdaLR needs an optimizer
    return get_scheduler(name, holder, num_warmup_steps=spec.warmup_steps,
                         num_training_steps=spec.max_steps).lr_lambdas[0]

NOOP = (1.0, 0.0, 1.0, 0.0, 1.0, 1.0, 0.0, math.inf, 0.0, 1.0, 0.0)
"""Optimizer row that changes no weight or moment: decay 1, 1 - beta1 = 0, beta2 = 1, 1 - beta2 = 0, bias
correction 1, eps 1, step 0, no clipping; the gradient is zeroed; B's decay 1 and step 0."""
ACCUMULATE = (*NOOP[:8], 1.0, *NOOP[9:])
"""``NOOP`` keeping the gradient: the row of a slot whose optimizer step awaits more micro-batches."""


def optimizer_row(spec: AdapterSpec, lr: float, step: int) -> tuple[float, ...]:
    """The optimizer table row of a slot taking its ``step``-th update (1-based) at learning rate ``lr``: the
    scalars ``torch.optim.AdamW``'s foreach path computes, in double as there, for A and B alike; then the slot's
    variants change their columns (``Variant.optimizer``: LoRA+'s B rate, LoRA-FA's frozen A)."""
    b1, b2 = spec.betas
    decay, step_size = 1 - lr * spec.weight_decay, -(lr / (1 - b1 ** step))
    row = dict(zip(OPT_COLUMNS, (decay, 1 - b1, b2, 1 - b2, (1 - b2 ** step) ** 0.5, spec.eps, step_size,
                                 spec.max_grad_norm if spec.max_grad_norm is not None else math.inf, 0.0, decay,
                                 step_size), strict=True))
    for variant in spec.variants:
        if variant.optimizer is not None:
            variant.optimizer(spec, row, lr, step)
    return tuple(row.values())


@torch.no_grad()
def adamw_step(store: SlotStore, shape: ShapeBuffers, triton: bool) -> torch.Tensor:
    """Clip each slot's gradient to its norm, take its AdamW step, zero the gradients (keep them where the slot's
    row is ``ACCUMULATE``: a no-op step whose clip coefficient is 1, so the gradient stays exactly as it was).

    Returns:
        (C,) fp32 gradient norms before clipping, on the device (no host sync).
    """
    opt, c = shape.opt, store.capacity
    mag = store.mag
    for variant in store.states:  # device ops on the gradients, before the norm (LoRA-FA: A's dropped)
        if variant.before_norm is not None:
            variant.before_norm(store, shape)
    live = None if mag is None else (shape.rank > 0).to(torch.int64)  # (C,) a live slot's one row of m per layer
    if triton:
        sumsq = ops.segmented_sumsq(store.grad, store.segs, shape.rank, store.rank_bucket)
        if mag is not None:  # DoRA's magnitudes: in the slot's norm (zero for a plain slot) and its step
            sumsq = sumsq + ops.segmented_sumsq(mag.grad, mag.segs, live, 1)
    else:
        rb = store.rank_bucket
        trained = (torch.arange(rb, device=opt.device) < shape.rank[:, None]).to(store.flat.dtype)  # (C, RB)
        for p in store.paths:  # rows past the rank: zero padding, or a frozen principal correction's gradient
            for leaf in (store.a[p], store.bt[p]):
                leaf.grad.view(c, rb, -1).mul_(trained[..., None])  # type: ignore[union-attr]
        sumsq = sum(leaf.grad.view(c, -1).square().sum(dim=1)  # type: ignore[union-attr]
                    for p in store.paths for leaf in (store.a[p], store.bt[p]))
        if store.mag is not None and store.mag.slots:  # DoRA's magnitudes: in the slot's norm and its step
            sumsq = sumsq + sum(store.mag.views(p)[1].square().sum(dim=1) for p in store.paths)
    norms = sumsq.sqrt()  # type: ignore[union-attr]
    coef = torch.clamp(opt[:, 7] / (norms + 1e-6), max=1.0)  # clip_grad_norm_'s formula, per slot
    for variant in store.states:  # and after it (LoRA-FA: B's gradient projected)
        if variant.before_step is not None:
            variant.before_step(store, shape)
    if triton:
        ops.segmented_adamw_(store.flat, store.grad, store.exp_avg, store.exp_avg_sq, store.segs, shape.rank,
                                 coef, opt, store.rank_bucket)
        if mag is not None:  # with B's decay and step (the segment table's third column), as below
            ops.segmented_adamw_(mag.flat, mag.grad, mag.exp_avg, mag.exp_avg_sq, mag.segs, live, coef, opt, 1)
        return norms
    cols = [opt[:, i:i + 1].to(store.flat.dtype) for i in range(len(NOOP))]  # (a float64 store: the fp64 tests)
    decay_a, w1, b2, w2, bc2, eps, step_a, _, keep, decay_b, step_b = cols
    for p in store.paths:
        for leaf, decay, step in ((store.a[p], decay_a, step_a), (store.bt[p], decay_b, step_b)):
            param, grad, m, v = (t.view(c, -1) for t in store._views(leaf))
            grad.mul_(coef[:, None])
            # decay the trained rows only: a frozen row (gradient 0, moments 0) then stays exactly as it is
            param.view(c, rb, -1).mul_(torch.where(trained > 0, decay, 1.0)[..., None])
            m.lerp_(grad, w1)
            v.mul_(b2).addcmul_(grad * w2, grad)
            denom = v.sqrt().div_(bc2).add_(eps)
            param.add_((m / denom) * step)
            grad.mul_(keep)
        if store.mag is not None and store.mag.slots:  # with B's decay and step: PEFT's LoRA+ groups 1-d ones with B
            _adamw_rows(store.mag.views(p), coef, (decay_b, w1, b2, w2, bc2, eps, step_b, keep))
    return norms


def _adamw_rows(views: list[torch.Tensor], coef: torch.Tensor, cols: tuple[torch.Tensor, ...]) -> None:
    """The torch path's update of (C, n) rows (weights, gradients, moments) with (C, 1) optimizer columns."""
    param, grad, m, v = views
    decay, w1, b2, w2, bc2, eps, step, keep = cols
    grad.mul_(coef[:, None])
    param.mul_(decay)
    m.lerp_(grad, w1)
    v.mul_(b2).addcmul_(grad * w2, grad)
    param.add_((m / v.sqrt().div_(bc2).add_(eps)) * step)
    grad.mul_(keep)
