"""``model.device`` resolved against the CUDA devices this process sees.

Its own module, of torch alone: ``sweep plan`` resolves the device before anything of the run's machinery
(``sweep.resume`` brings in Optuna, the results store and transformers) is imported.
"""

from __future__ import annotations

import os

from lora_sweep.errors import UserError

__all__ = ["resolve_device"]


def resolve_device(device: str) -> str:
    """``model.device`` as a torch device: ``auto`` picks CUDA when visible.

    Raises:
        UserError: ``cuda`` or ``cuda:N`` is asked for and no such CUDA device is visible.
    """
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise UserError(f"model.device: {device}, but no CUDA device is visible (torch {torch.__version__}, "
                            f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}); "
                            f"use device: auto or cpu")
        index = int(device.partition(":")[2] or 0)
        if index >= torch.cuda.device_count():
            raise UserError(f"model.device: {device}, but only {torch.cuda.device_count()} CUDA device(s) are visible")
    return device
