"""Save one slot as a PEFT LoRA adapter directory, and load one back into a slot.

The directory is what ``peft.PeftModel.from_pretrained`` reads (../shared/notes/formats-and-eval.md
§1): ``adapter_config.json`` and ``adapter_model.safetensors`` with keys
``base_model.model.<module path>.lora_{A,B}.weight``, A (r, D_in), B (D_out, r), no adapter name.
Files are written to a temporary directory beside the target and renamed into place, so a reader
(or a kill) never sees a half-written adapter.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers.pytorch_utils import Conv1D

from lora_sweep.errors import UserError
from lora_sweep.packer.model.packed import PackedModel

__all__ = ["save_adapter", "save_adapters", "discard_adapter", "read_adapter", "adapter_config",
           "CONFIG_NAME", "WEIGHTS_NAME"]

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"


def adapter_config(pm: PackedModel, slot: int, base_model_name_or_path: str) -> dict:
    """PEFT ``LoraConfig`` fields of the slot's adapter (one uniform r; no patterns; bias none)."""
    spec = pm.specs[slot]
    paths = pm.slot_paths[slot]
    conv1d = any(isinstance(pm.layers[p].base, Conv1D) for p in paths)  # GPT-2 stores W as (D_in, D_out)
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name_or_path,
        # a principal init is saved as PEFT converts it: a plain LoRA of rank 2r against the original base, alpha
        # scaled to keep s (``packer.model.principal``)
        "r": spec.rows,
        "lora_alpha": spec.alpha * (spec.rows / spec.rank) ** (0.5 if spec.rslora else 1.0),
        "use_rslora": spec.rslora,
        "lora_dropout": spec.dropout,
        "target_modules": sorted({p.rsplit(".", 1)[-1] for p in paths}),
        "bias": "none",
        "use_dora": spec.dora,
        "fan_in_fan_out": conv1d,
        "modules_to_save": None,
        "rank_pattern": {},
        "alpha_pattern": {},
        "init_lora_weights": True,
        "layers_to_transform": None,
        "layers_pattern": None,
        "inference_mode": True,
    }


SAVE_THREADS = 8
"""Adapters written at once: the files of slots that end together are serialized and fsynced in parallel
(with the one host copy per slot, the saves of slots that end together overlap instead of queueing)."""


def save_adapter(pm: PackedModel, slot: int, out_dir: str | Path, *, base_model_name_or_path: str,
                 dtype: torch.dtype | None = None, metadata: dict[str, str] | None = None) -> Path:
    """Write the slot's adapter as a PEFT directory, atomically.

    Args:
        pm: the packed model holding the slot.
        slot: slot id.
        out_dir: target directory (replaced if it exists).
        base_model_name_or_path: recorded in the config, as PEFT does.
        dtype: tensor dtype to save (default: the fp32 training weights).
        metadata: extra safetensors metadata (strings).

    Returns:
        ``out_dir`` as a Path.
    """
    return save_adapters(pm, [(slot, out_dir, metadata)], base_model_name_or_path=base_model_name_or_path,
                         dtype=dtype)[0]


def save_adapters(pm: PackedModel, items: Sequence[tuple[int, str | Path, dict[str, str] | None]], *,
                  base_model_name_or_path: str, dtype: torch.dtype | None = None) -> list[Path]:
    """Write several slots' adapters (``(slot, out_dir, metadata)`` each) as PEFT directories, atomically.

    The weights are copied to the host first, one copy per slot; the files are then written and
    fsynced by up to ``SAVE_THREADS`` threads. Returns when every directory is in place and on disk.
    """
    jobs = [(_host_tensors(pm, slot, dtype), adapter_config(pm, slot, base_model_name_or_path), Path(out), meta)
            for slot, out, meta in items]
    if len(jobs) <= 1:
        return [_write(*job) for job in jobs]
    with ThreadPoolExecutor(min(SAVE_THREADS, len(jobs))) as pool:
        return list(pool.map(lambda job: _write(*job), jobs))


def _host_tensors(pm: PackedModel, slot: int, dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    """The slot's PEFT tensors on the host. One device-to-host copy of all of them: a copy per tensor
    waits for the device each time (two per projection: 336 for a 24-layer model). They are gathered on the
    device by one multi-tensor copy (casting, and laying out each B^T view as B): a cast or copy per tensor
    took ~50 ms of host time per slot on SmolLM2's 210 projections, with the GPU idle while trials end."""
    names, parts = [], []
    for path in pm.slot_paths[slot]:  # every row the forward reads: [A; A0] and [B, -B0] for a principal init
        rows = pm.layers[path].slot_weights(slot)
        names += [f"base_model.model.{path}.lora_A.weight", f"base_model.model.{path}.lora_B.weight"]
        parts += [rows.a.detach(), rows.bt.detach().T]
    for path, m in pm.slot_magnitudes(slot).items():  # DoRA: PEFT's key of the (D_out,) magnitude
        names.append(f"base_model.model.{path}.lora_magnitude_vector")
        parts.append(m.detach())
    dtype = dtype or parts[0].dtype
    sizes = [p.numel() for p in parts]
    gathered = torch.empty(sum(sizes), dtype=dtype, device=parts[0].device)
    torch._foreach_copy_([c.view(p.shape) for p, c in zip(parts, gathered.split(sizes), strict=True)], parts)
    flat = gathered.cpu()
    # safetensors refuses tensors that share memory: each gets its own copy of its slice
    return {name: chunk.view(p.shape).clone() for name, p, chunk in zip(names, parts, flat.split(sizes), strict=True)}


def _scratch_prefix(out_dir: Path) -> str:
    """Name prefix of the temporary directories a write of ``out_dir`` makes beside it."""
    return f".{out_dir.name}."


def _write(tensors: dict[str, torch.Tensor], config: dict, out_dir: Path, metadata: dict[str, str] | None) -> Path:
    """Write one adapter directory: files in a temporary directory beside it, fsynced, renamed into place."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=_scratch_prefix(out_dir), dir=out_dir.parent))
    try:
        save_file(tensors, str(tmp / WEIGHTS_NAME), metadata={"format": "pt", **(metadata or {})})
        (tmp / CONFIG_NAME).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        for f in tmp.iterdir():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
        _fsync_dir(tmp)  # the files' names in it
        _replace_dir(tmp, out_dir)
        _fsync_dir(out_dir.parent)  # the rename: the store may record the trial COMPLETE right after
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def _fsync_dir(folder: Path) -> None:
    """Make a folder's entries durable (a power loss may otherwise undo a rename); not possible on Windows.
    ``sweep.store`` has its own copy: it imports nothing of the packer's."""
    with contextlib.suppress(OSError):
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _replace_dir(src: Path, dst: Path) -> None:
    """Move ``src`` to ``dst``; an existing ``dst`` is swapped out first and removed after."""
    if not dst.exists():
        os.replace(src, dst)
        return
    old = dst.with_name(f"{_scratch_prefix(dst)}old-{os.getpid()}")
    os.replace(dst, old)
    os.replace(src, dst)
    shutil.rmtree(old, ignore_errors=True)


def discard_adapter(out_dir: str | Path) -> None:
    """Remove an adapter directory and what interrupted writes of it left beside it (their temporary
    directories): for a trial that will never be told complete."""
    out_dir = Path(out_dir)
    for leftover in [out_dir, *out_dir.parent.glob(f"{_scratch_prefix(out_dir)}*")]:
        shutil.rmtree(leftover, ignore_errors=True)


def read_adapter(adapter_dir: str | Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config, tensors) of a PEFT adapter directory.

    Raises:
        UserError: the directory or one of its files is missing.
    """
    d = Path(adapter_dir)
    for name in (CONFIG_NAME, WEIGHTS_NAME):
        if not (d / name).is_file():
            raise UserError(f"{d / name}: not found (not a PEFT adapter directory)")
    return json.loads((d / CONFIG_NAME).read_text()), load_file(str(d / WEIGHTS_NAME))
