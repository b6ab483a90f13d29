"""LoRA+ (Hayou et al., 2024; PEFT's ``loraplus_lr_ratio``): B learns at ``lr * lr_ratio``.

One hook, the optimizer row: B's decay and step size at the ratio's learning rate, as PEFT's
``create_loraplus_optimizer`` puts B (and 1-d parameters: DoRA's magnitudes, which take B's columns in the step) in a
group of that rate; the schedule scales every group alike.
"""

from __future__ import annotations

import math

from lora_sweep.packer.variants.base import AdapterSpec, Variant, require

__all__ = ["VARIANT"]


def _check(spec: AdapterSpec) -> None:
    ratio = spec.lr_ratio
    require(isinstance(ratio, int | float) and not isinstance(ratio, bool) and math.isfinite(ratio) and ratio > 0,
            "lr_ratio", "must be > 0", ratio)


def _optimizer(spec: AdapterSpec, row: dict[str, float], lr: float, step: int) -> None:
    lr_b = lr * spec.lr_ratio
    row["decay_b"] = 1 - lr_b * spec.weight_decay
    row["step_b"] = -(lr_b / (1 - spec.betas[0] ** step))


VARIANT = Variant(name="loraplus", applies=lambda spec: spec.lr_ratio != 1.0, fields=("lr_ratio",), check=_check,
                  optimizer=_optimizer)
