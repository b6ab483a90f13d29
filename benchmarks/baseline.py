"""The one-trial-at-a-time baseline's optimizer and schedule: one adapter's own torch AdamW and transformers' schedule.

What the benchmarks time the packed step against (PEFT trained alone) and what the tests' PEFT oracles step with;
the pack itself steps every slot in one pass (``packer.step.optim``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from lora_sweep.packer.plan import AdapterSpec

__all__ = ["make_optimizer", "make_scheduler"]


def make_optimizer(params: Sequence[nn.Parameter], spec: AdapterSpec) -> torch.optim.Optimizer:
    """One adapter's own torch AdamW with ``spec``'s learning rate, betas, eps and weight decay."""
    # One fused multi-tensor kernel per adapter on CUDA; on CPU foreach (a handful of multi-tensor ops
    # instead of ~10 small ops per tensor, the CPU default). Same update rule either way.
    fast = {"fused": True} if params and params[0].is_cuda else {"foreach": True}
    return torch.optim.AdamW(params, lr=spec.lr, betas=spec.betas, eps=spec.eps, weight_decay=spec.weight_decay,
                             **fast)


def make_scheduler(optimizer: torch.optim.Optimizer, spec: AdapterSpec) -> torch.optim.lr_scheduler.LRScheduler:
    """Warm-up then ``spec.schedule``, by the names and formulas of ``transformers.get_scheduler``."""
    from transformers import get_scheduler

    name = "constant_with_warmup" if spec.schedule == "constant" else spec.schedule
    return get_scheduler(name, optimizer, num_warmup_steps=spec.warmup_steps, num_training_steps=spec.max_steps)
