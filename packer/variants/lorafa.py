"""LoRA-FA (Zhang et al., 2023, https://huggingface.co/papers/2308.03303; PEFT's ``create_lorafa_optimizer``): A
frozen at its initialisation, B trained with the gradient projected onto what a full fine-tune would do.

PEFT's ``LoraFAOptimizer`` (src/peft/optimizers/lorafa.py) steps B with

    g_B <- (1 / s^2) g_B (A A^T + delta I)^+,   delta = 1e-8

(the B that best reproduces the full gradient through the frozen A), then its HF-style AdamW: bias correction in
the step size, ``lr sqrt(1 - beta2^t) / (1 - beta1^t) * m / (sqrt(v) + eps)``; A has no gradient, so the trainer's
clip norm is B's raw gradient's. The pack does the same with device ops, so the captured step replays it for any mix
of slots: the slot's per-slot buffer is its gain 1/s^2 (0 for every other slot);

- ``before_norm``: A's gradient of the LoRA-FA slots is zeroed, so the clip norm is B's alone (and A's moments stay
  zero);
- ``before_step``: B^T's gradient of each layer is projected, ``(A A^T + delta I)^-1 g_{B^T} / s^2`` per slot, batched
  over the store's slots (``A A^T`` over the slot's first r rows: a padded row is zero and keeps a zero gradient).
  The inverse is PEFT's pseudo-inverse on a matrix that ``delta I`` makes invertible; ``inv_ex`` checks nothing on the
  host (a captured step cannot sync);
- ``optimizer``: A's decay 1 and step 0 (frozen), and eps over ``sqrt(1 - beta2^t)``, which turns the pack's
  torch-style AdamW (``m / (sqrt(v) / sqrt(1 - beta2^t) + eps)``) into PEFT's HF-style one exactly. PEFT decays B
  after its step (``B -= lr wd B``), the pack before it, as torch's AdamW: with weight decay the two differ by
  ``lr wd`` times the step.

The forward, the checkpoint (a plain LoRA: PEFT has no LoRA-FA config field) and the merge are plain LoRA's. The
kernels still compute A's gradient for every slot, so the pack takes none of LoRA-FA's activation-memory saving.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lora_sweep.packer.variants.base import OPT_COLUMNS, AdapterSpec, ShapeBuffers, SlotStore, Variant, require

if TYPE_CHECKING:
    import torch
    from torch import nn


__all__ = ["VARIANT", "Gains", "DELTA"]

DELTA = 1e-8
"""PEFT's ``delta`` added to ``A A^T`` before its pseudo-inverse."""
_KEEP = OPT_COLUMNS.index("keep")


class Gains:
    """LoRA-FA's per-slot buffer: (C,) 1/s^2 of each LoRA-FA slot, 0 for every other slot."""

    def __init__(self, store: SlotStore) -> None:
        import torch  # torch: not while a study file loads

        self.gain = torch.zeros(store.capacity, dtype=store.flat.dtype, device=store.device)  # (C,)
        self.slots: set[int] = set()

    def reset_slot(self, slot: int, on: bool) -> None:
        self.gain[slot] = 0.0
        self.slots.discard(slot)
        if on:
            self.slots.add(slot)

    def start(self, slot: int, spec: AdapterSpec) -> None:
        self.gain[slot] = 1.0 / spec.scale ** 2

    def copy_slot_from(self, other: Gains, slot: int) -> None:
        self.gain[slot] = other.gain[slot]
        self.slots.discard(slot)
        if slot in other.slots:
            self.slots.add(slot)


def _check(spec: AdapterSpec) -> None:
    require(isinstance(spec.lorafa, bool), "lorafa", "must be true or false", spec.lorafa)
    if spec.lorafa:
        for ok, other in ((not spec.dora, "dora"), (spec.lr_ratio == 1.0, "lr_ratio (LoRA+: A is frozen)"),
                          (not spec.principal, "a pissa / olora init")):
            require(ok, "lorafa", f"does not combine with {other}", spec.lorafa)


def _start(state: Gains, slot: int, spec: AdapterSpec, path: str, base: nn.Module) -> None:
    state.start(slot, spec)


def _optimizer(spec: AdapterSpec, row: dict[str, float], lr: float, step: int) -> None:
    row["decay_a"], row["step_a"] = 1.0, 0.0  # A frozen
    row["eps"] = spec.eps / row["bc2"]  # HF-style AdamW's eps (module docstring)


def _trained(store: SlotStore, shape: ShapeBuffers) -> torch.Tensor:
    """(C, RB, 1) 1 on each slot's first r rows, 0 on its padding."""
    import torch

    rows = torch.arange(store.rank_bucket, device=store.device)
    return (rows < shape.rank[:, None]).to(store.flat.dtype)[..., None]


def _before_norm(store: SlotStore, shape: ShapeBuffers) -> None:
    gains = store.states[VARIANT]
    plain = (gains.gain == 0).to(store.flat.dtype)[:, None, None]  # type: ignore[attr-defined]  # (C, 1, 1)
    for path in store.paths:
        store.a[path].grad.view(store.capacity, store.rank_bucket, -1).mul_(plain)  # type: ignore[union-attr]


def _before_step(store: SlotStore, shape: ShapeBuffers) -> None:
    import torch

    gain = store.states[VARIANT].gain  # type: ignore[attr-defined]  # (C,)
    c, rb = store.capacity, store.rank_bucket
    trained = _trained(store, shape)  # (C, RB, 1)
    eye = DELTA * torch.eye(rb, dtype=store.flat.dtype, device=store.device)  # (RB, RB)
    # a slot that keeps its gradient for more micro-batches is projected once, at its step
    stepping = ((gain > 0) & (shape.opt[:, _KEEP] == 0))[:, None, None]  # (C, 1, 1)
    for path in store.paths:
        a = store.a[path].detach().view(c, rb, -1) * trained  # (C, RB, D_in)
        inv = torch.linalg.inv_ex(a @ a.transpose(1, 2) + eye).inverse  # (C, RB, RB)
        grad = store.bt[path].grad.view(c, rb, -1)  # type: ignore[union-attr]  # (C, RB, D_out)
        projected = (inv @ grad) * (gain[:, None, None] * trained)
        grad.copy_(torch.where(stepping, projected, grad))


# --8<-- [start:variant]
VARIANT = Variant(name="lorafa", applies=lambda spec: spec.lorafa, fields=("lorafa",), check=_check, state=Gains,
                  start=_start, optimizer=_optimizer, before_norm=_before_norm, before_step=_before_step)
# --8<-- [end:variant]
