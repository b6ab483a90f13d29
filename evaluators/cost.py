"""Cost metrics of a trial, from numbers the trainer reports: always available, no model needed.

A pack's wall time and peak memory are shared by the trials in it; a trial is charged its share of the
pack's trained (target) tokens, the unit of work of a packed step. Memory optionally splits off the frozen
base (``base_bytes``), which every slot of the pack uses alike and is charged in equal parts.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lora_sweep.packer.api import PackedModel

__all__ = ["COST_METRICS", "adapter_params", "slot_adapter_params", "device_seconds", "memory_share",
           "cost_metrics"]

COST_METRICS = {
    "adapter_params": "minimize",
    "train_tokens": "minimize",
    "device_seconds": "minimize",
    "peak_memory_mb": "minimize",
}
"""Cost metric name -> direction."""


def adapter_params(shapes: Iterable[tuple[int, int]], rank: int) -> int:
    """LoRA parameters of one adapter: ``sum(rank * (D_in + D_out))`` over its target layers.

    Args:
        shapes: (D_in, D_out) of every adapted layer.
        rank: the adapter's rank r.
    """
    return sum(rank * (d_in + d_out) for d_in, d_out in shapes)


def slot_adapter_params(model: PackedModel, slot: int) -> int:
    """LoRA parameters of the adapter in ``slot`` (A: (r, D_in) and B: (D_out, r) of every layer)."""
    return sum(p.numel() for p in model.slot_parameters(slot))


def _share(trial_tokens: float, pack_tokens: float) -> float:
    if trial_tokens < 0 or pack_tokens < 0 or trial_tokens > pack_tokens:
        raise ValueError(f"need 0 <= trial_tokens <= pack_tokens (got {trial_tokens}, {pack_tokens})")
    return trial_tokens / pack_tokens if pack_tokens > 0 else 0.0


def device_seconds(pack_seconds: float, trial_tokens: float, pack_tokens: float) -> float:
    """Device time charged to a trial: the pack's seconds times the trial's share of its trained tokens.

    Args:
        pack_seconds: wall-clock seconds of the packed run (``TrainResult.wall_s``) times devices used.
        trial_tokens: the trial's trained tokens (sum of its ``StepReport.tokens``).
        pack_tokens: all trained tokens of the pack (``TrainResult.tokens``).
    """
    return pack_seconds * _share(trial_tokens, pack_tokens)


def memory_share(peak_bytes: float, trial_tokens: float, pack_tokens: float, *, n_trials: int = 1,
                 base_bytes: float = 0.0) -> float:
    """Bytes of the pack's peak memory charged to a trial.

    ``base_bytes / n_trials + (peak_bytes - base_bytes) * trial_tokens / pack_tokens``: the frozen base is
    shared equally by the ``n_trials`` trials of the pack, the rest (activations, adapters, optimizer states)
    by trained tokens.
    """
    if n_trials < 1 or not 0 <= base_bytes <= peak_bytes:
        raise ValueError(f"need n_trials >= 1 and 0 <= base_bytes <= peak_bytes (got {n_trials}, {base_bytes}, "
                         f"{peak_bytes})")
    return base_bytes / n_trials + (peak_bytes - base_bytes) * _share(trial_tokens, pack_tokens)


def cost_metrics(*, adapter_params: int, trial_tokens: int, pack_tokens: int, pack_seconds: float,
                 peak_bytes: float | None = None, n_trials: int = 1, base_bytes: float = 0.0) -> dict[str, float]:
    """The cost metrics of one trial (``COST_METRICS``; ``peak_memory_mb`` only when ``peak_bytes`` is known)."""
    out = {
        "adapter_params": float(adapter_params),
        "train_tokens": float(trial_tokens),
        "device_seconds": device_seconds(pack_seconds, trial_tokens, pack_tokens),
    }
    if peak_bytes is not None:
        out["peak_memory_mb"] = memory_share(peak_bytes, trial_tokens, pack_tokens, n_trials=n_trials,
                                             base_bytes=base_bytes) / 2**20
    return out
