"""One AdamW for every slot of a pack: per-slot hyperparameters, a constant number of launches.

``torch.optim.AdamW`` per slot launches its multi-tensor kernels once per slot, and
``clip_grad_norm_`` per slot adds more; with 32 slots that host work was ~45% of a packed step on
an H200. ``PackedAdamW`` runs the same update over all slots' tensors at once: each foreach op takes
a per-tensor scalar list (the tensor's slot's lr, betas, eps, weight decay, bias corrections), the
gradient norms of all slots come from one ``_foreach_norm`` and a segment sum, and clipping is one
multiply. The arithmetic and its order are ``torch.optim.adam._multi_tensor_adam`` with decoupled
weight decay (AdamW), so results equal per-slot ``torch.optim.AdamW`` up to rounding (tested).

The optimizer step in the backward (torchtune's ``optimizer_in_bwd``): ``begin_step`` fixes every stepping
slot's scalars and advances its counter once, the packed layers hand each layer's gradient pieces to
``backward_step`` as soon as autograd has accumulated them (``packer.layer.PackState.grad_sink``), which
applies the same AdamW arithmetic to those pieces of the weights and moments and lets the gradient go, and
``end_step`` steps whatever no gradient reached (a zero gradient, as in the whole-gradient step) and returns
the norms. AdamW is elementwise, so updating a slot layer by layer equals updating it at once; no slot then
holds a gradient buffer, only the layer being differentiated does. Clipping a slot's norm needs its whole
gradient first, so it is refused with this mode (as torchtune does).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from lora_sweep.packer.plan import AdapterSpec

__all__ = ["PackedAdamW", "lr_schedule"]


def lr_schedule(spec: AdapterSpec):  # type: ignore[no-untyped-def]
    """step -> learning-rate multiplier, by the names and formulas of ``transformers.get_scheduler``."""
    from transformers import get_scheduler

    name = "constant_with_warmup" if spec.schedule == "constant" else spec.schedule
    holder = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=spec.lr)  # LambdaLR needs an optimizer
    return get_scheduler(name, holder, num_warmup_steps=spec.warmup_steps,
                         num_training_steps=spec.max_steps).lr_lambdas[0]


@dataclass
class _Slot:
    spec: AdapterSpec
    param: torch.Tensor
    grad: torch.Tensor | None
    """None with the step in the backward: the slot keeps no gradient buffer."""
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    schedule: object
    step: int = 0


@dataclass
class _InBackward:
    """One step in the backward: the stepping slots' scalars, what has been updated, the gradient norms."""

    lr: dict[int, float]
    done: dict[int, set[int]] = field(default_factory=dict)
    """Slot -> element offsets (in its flat weights) of the pieces updated so far."""
    norms: list[tuple[int, torch.Tensor]] = field(default_factory=list)
    """(slot, 0-d norm of one gradient piece)."""


class PackedAdamW:
    """AdamW with per-slot hyperparameters, learning-rate schedule and gradient clipping.

    Each slot is one flat fp32 weight tensor and its flat gradient (``PackedModel.flat_buffers``),
    so every foreach op below touches N tensors for N slots, whatever the number of layers.
    """

    def __init__(self) -> None:
        self.slots: dict[int, _Slot] = {}
        self._storage: dict[int, int] = {}
        """Data pointer of a slot's flat weight storage -> slot (finds the slot of a weight view)."""
        self._pending: _InBackward | None = None
        """The step in the backward under way (between ``begin_step`` and ``end_step``)."""

    def add_slot(self, slot: int, param: torch.Tensor, grad: torch.Tensor | None, spec: AdapterSpec) -> None:
        """Fresh optimizer state (zero moments, step 0) for a slot's flat weights and gradients (None: the slot
        steps in the backward, ``begin_step``)."""
        self.slots[slot] = _Slot(spec, param, grad, torch.zeros_like(param), torch.zeros_like(param),
                                 lr_schedule(spec))
        self._storage[param.untyped_storage().data_ptr()] = slot

    def remove_slot(self, slot: int) -> None:
        s = self.slots.pop(slot)
        self._storage.pop(s.param.untyped_storage().data_ptr(), None)

    def lr(self, slot: int) -> float:
        """The learning rate the slot's next step uses."""
        s = self.slots[slot]
        return s.spec.lr * s.schedule(s.step)  # type: ignore[operator]

    @torch.no_grad()
    def step(self, slots: list[int]) -> torch.Tensor:
        """Clip each slot's gradient to its ``max_grad_norm``, update, and zero the gradients.

        Returns:
            (N,) float32 gradient norms before clipping, on the parameters' device (no host sync).
        """
        order = [self.slots[s] for s in slots]
        lr = [self.lr(s) for s in slots]  # the schedule at the step about to be taken
        params, grads = [s.param for s in order], [s.grad for s in order]
        if any(g is None for g in grads):
            raise ValueError("a slot without a gradient buffer steps in the backward (begin_step), not here")
        norms = torch.stack(torch._foreach_norm(grads, 2.0)).float()  # (N,)
        max_norm = torch.tensor([s.spec.max_grad_norm or math.inf for s in order], device=norms.device)
        coef = torch.clamp(max_norm / (norms + 1e-6), max=1.0)  # clip_grad_norm_'s formula, per slot
        torch._foreach_mul_(grads, list(coef.unbind()))
        for s in order:
            s.step += 1
        _adamw_(params, grads, [s.exp_avg for s in order], [s.exp_avg_sq for s in order], lr, order)
        torch._foreach_zero_(grads)
        return norms

    def begin_step(self, slots: list[int]) -> list[float]:
        """Start a step in the backward for ``slots`` (slots without clipping): fix each one's learning rate
        and advance its step counter, once; the backward then calls ``backward_step`` per layer.

        Returns:
            The learning rate of each slot's step.
        """
        if self._pending is not None:
            raise RuntimeError("begin_step: the previous step in the backward has not ended")
        for slot in slots:
            if self.slots[slot].spec.max_grad_norm is not None:
                raise ValueError(f"slot {slot}: max_grad_norm needs the whole gradient, not a step in the backward")
        lrs = [self.lr(slot) for slot in slots]
        for slot in slots:
            self.slots[slot].step += 1
        self._pending = _InBackward(dict(zip(slots, lrs, strict=True)), {slot: set() for slot in slots})
        return lrs

    @torch.no_grad()
    def backward_step(self, weights: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
        """AdamW on pieces of slots' weights (views into their flat weights, e.g. one layer's A of each slot)
        with their just-accumulated gradients ``grads`` (same shapes), all in one pass of foreach ops; the
        caller frees the gradients after. A piece of a slot that is not stepping is left alone.

        Raises:
            RuntimeError: outside ``begin_step`` / ``end_step``, or a piece updated twice in one step.
        """
        pending = self._pending
        if pending is None:
            raise RuntimeError("a gradient reached the optimizer outside begin_step/end_step")
        order, params, views, keep = [], [], [], []
        for w, g in zip(weights, grads, strict=True):
            slot = self._storage[w.untyped_storage().data_ptr()]
            if slot not in pending.lr:
                continue
            s = self.slots[slot]
            off = (w.data_ptr() - s.param.data_ptr()) // s.param.element_size()
            if off in pending.done[slot]:
                raise RuntimeError(f"slot {slot}: a weight got two gradients in one step in the backward")
            pending.done[slot].add(off)
            order.append(s)
            params.append(w)
            views.append(off)
            keep.append((slot, g))
        if not order:
            return
        gs = [g for _, g in keep]
        pending.norms += [(slot, n) for (slot, _), n in zip(keep, torch._foreach_norm(gs, 2.0), strict=True)]
        pieces = list(zip(order, views, params, strict=True))
        exp_avg = [s.exp_avg[o:o + w.numel()].view_as(w) for s, o, w in pieces]
        exp_avg_sq = [s.exp_avg_sq[o:o + w.numel()].view_as(w) for s, o, w in pieces]
        _adamw_(params, gs, exp_avg, exp_avg_sq, [pending.lr[slot] for slot, _ in keep], order)

    def end_step(self, chunks: dict[int, list[torch.Tensor]]) -> torch.Tensor:
        """End the step in the backward: every piece of ``chunks`` (slot -> its weight views, e.g. each layer's
        A and B^T) that no gradient reached steps with a zero gradient, as the whole-gradient step would.

        Returns:
            (N,) float32 gradient norms of the stepping slots, in ``begin_step``'s order (no host sync).
        """
        pending = self._pending
        if pending is None:
            raise RuntimeError("end_step without begin_step")
        for slot in pending.lr:
            missed = [w for w in chunks[slot] if (w.data_ptr() - self.slots[slot].param.data_ptr())
                      // w.element_size() not in pending.done[slot]]
            if missed:
                self.backward_step(missed, [torch.zeros_like(w) for w in missed])
        self._pending = None
        slots = list(pending.lr)
        device = self.slots[slots[0]].param.device if slots else torch.device("cpu")
        sq = torch.zeros(len(slots), device=device)
        if pending.norms:
            index = torch.tensor([slots.index(s) for s, _ in pending.norms], device=device)
            sq.index_add_(0, index, torch.stack([n.float() for _, n in pending.norms]) ** 2)
        return sq.sqrt()


def _adamw_(params: list[torch.Tensor], grads: list[torch.Tensor], exp_avg: list[torch.Tensor],
            exp_avg_sq: list[torch.Tensor], lr: list[float], order: list[_Slot]) -> None:
    """``torch.optim.adam._multi_tensor_adam``'s update with decoupled weight decay, in place, tensor i with the
    hyperparameters of slot ``order[i]`` (its step counter already advanced) at learning rate ``lr[i]``."""
    b1 = [s.spec.betas[0] for s in order]
    b2 = [s.spec.betas[1] for s in order]
    torch._foreach_mul_(params, [1 - a * s.spec.weight_decay for a, s in zip(lr, order, strict=True)])
    torch._foreach_lerp_(exp_avg, grads, [1 - b for b in b1])
    torch._foreach_mul_(exp_avg_sq, b2)
    torch._foreach_addcmul_(exp_avg_sq, grads, grads, [1 - b for b in b2])
    denom = torch._foreach_sqrt(exp_avg_sq)
    torch._foreach_div_(denom, [(1 - b**s.step) ** 0.5 for b, s in zip(b2, order, strict=True)])
    torch._foreach_add_(denom, [s.spec.eps for s in order])
    torch._foreach_addcdiv_(params, exp_avg, denom,
                            [-(a / (1 - b**s.step)) for a, b, s in zip(lr, b1, order, strict=True)])
