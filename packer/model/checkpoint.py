"""Save one slot as a PEFT LoRA adapter directory, and load one back into a slot.

The directory is what ``peft.PeftModel.from_pretrained`` reads (../shared/notes/formats-and-eval.md
§1): ``adapter_config.json`` and ``adapter_model.safetensors`` with keys
``base_model.model.<module path>.lora_{A,B}.weight``, A (r, D_in), B (D_out, r), no adapter name.
Files are written to a temporary directory beside the target, fsynced and renamed into place, so a reader
(or a kill) never sees a half-written adapter.

``AdapterWriter`` takes the writing off the caller's path: ``submit`` copies each slot's weights (one gather on
the device, then, from a GPU, one ``non_blocking`` copy into pinned host memory) and returns; its threads wait for
the copy, serialise the tensors with safetensors and rename the directory into place, and each write's future
holds the path once the directory is durable. The snapshot is stream-ordered before any later kernel, so the slot
may be refilled and trained at once. ``save_adapters`` is the same write, waited for.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers.pytorch_utils import Conv1D

from lora_sweep.errors import UserError
from lora_sweep.packer.model.packed import PackedModel

__all__ = ["AdapterWriter", "save_adapter", "save_adapters", "discard_adapter", "read_adapter", "adapter_config",
           "CONFIG_NAME", "WEIGHTS_NAME"]

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"


def adapter_config(pm: PackedModel, slot: int, base_model_name_or_path: str) -> dict:
    """PEFT ``LoraConfig`` fields of the slot's adapter (one uniform r; no patterns; bias none)."""
    spec = pm.specs[slot]
    paths = pm.slot_paths[slot]
    conv1d = any(isinstance(pm.layers[p].base, Conv1D) for p in paths)  # GPT-2 stores W as (D_in, D_out)
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name_or_path,
        "r": spec.rank,
        "lora_alpha": float(spec.alpha),
        "use_rslora": spec.rslora,
        "lora_dropout": spec.dropout,
        "target_modules": sorted({p.rsplit(".", 1)[-1] for p in paths}),
        "bias": "none",
        "use_dora": False,
        "fan_in_fan_out": conv1d,
        "modules_to_save": None,
        "rank_pattern": {},
        "alpha_pattern": {},
        "init_lora_weights": True,
        "layers_to_transform": None,
        "layers_pattern": None,
        "inference_mode": True,
    }
    for variant in spec.variants:  # a principal init's rank 2r, as PEFT converts it; DoRA's use_dora
        if variant.peft_config is not None:
            variant.peft_config(spec, config)
    return config


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
    with AdapterWriter(min(SAVE_THREADS, max(1, len(items)))) as writer:
        futures = writer.submit(pm, items, base_model_name_or_path=base_model_name_or_path, dtype=dtype)
        return [f.result() for f in futures]


class AdapterWriter:
    """Writes adapter directories on background threads (module docstring); a context manager that waits for its
    writes on exit (``close``).

    Args:
        threads: writes at once (the adapters of slots that end together are serialised and fsynced in parallel).
    """

    def __init__(self, threads: int = SAVE_THREADS) -> None:
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="adapter-writer")
        self._lock = threading.Lock()
        self.busy_s = 0.0
        """Seconds the threads spent writing (waiting for the copy included), summed over the threads."""

    def submit(self, pm: PackedModel, items: Sequence[tuple[int, str | Path, dict[str, str] | None]], *,
               base_model_name_or_path: str, dtype: torch.dtype | None = None) -> list[Future[Path]]:
        """Snapshot each slot's weights (``(slot, out_dir, metadata)`` each) and queue their writes; returns at once
        with one future per item, whose result is ``out_dir`` once the directory is in place and on disk (or whose
        exception is the write's: a full disk, a read-only folder)."""
        jobs = [(_snapshot(pm, slot, dtype), adapter_config(pm, slot, base_model_name_or_path), Path(out), meta)
                for slot, out, meta in items]
        return [self._pool.submit(self._write, *job) for job in jobs]

    def _write(self, snap: _Snapshot, config: dict, out_dir: Path, metadata: dict[str, str] | None) -> Path:
        t0 = time.perf_counter()
        try:
            return _write(snap.tensors(), config, out_dir, metadata)
        finally:
            with self._lock:
                self.busy_s += time.perf_counter() - t0

    def close(self) -> None:
        """Wait for every queued write, then stop the threads."""
        self._pool.shutdown(wait=True)

    def __enter__(self) -> AdapterWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass(frozen=True)
class _Snapshot:
    """One slot's PEFT tensors as one flat host buffer: ``names``, their ``shapes`` in order; ``ready``, the CUDA
    event after the device-to-host copy (None: the buffer is already filled)."""

    names: list[str]
    shapes: list[torch.Size]
    flat: torch.Tensor
    ready: torch.cuda.Event | None

    def tensors(self) -> dict[str, torch.Tensor]:
        """{name: tensor}, once the copy has landed; each its own copy of its slice (safetensors refuses tensors
        that share memory)."""
        if self.ready is not None:
            self.ready.synchronize()
        chunks = self.flat.split([s.numel() for s in self.shapes])
        return {n: c.view(s).clone() for n, s, c in zip(self.names, self.shapes, chunks, strict=True)}


def _snapshot(pm: PackedModel, slot: int, dtype: torch.dtype | None) -> _Snapshot:
    """The slot's PEFT tensors copied off the slot: one gather on the device, then one device-to-host copy of all
    of them. A copy per tensor waits for the device each time (two per projection: 336 for a 24-layer model); a
    cast or copy per tensor took ~50 ms of host time per slot on SmolLM2's 210 projections, with the GPU idle
    while trials end. The gather casts and lays out each B^T view as B. From a GPU the host copy is
    ``non_blocking`` into pinned memory, so the caller goes on at once; later kernels (the slot refilled) run
    after the gather on the same stream."""
    names, parts = [], []
    for path in pm.slot_paths[slot]:  # every row the forward reads: [A; A0] and [B, -B0] for a principal init
        rows = pm.layers[path].slot_weights(slot)
        names += [f"base_model.model.{path}.lora_A.weight", f"base_model.model.{path}.lora_B.weight"]
        parts += [rows.a.detach(), rows.bt.detach().T]
    for variant in pm.specs[slot].variants:  # DoRA: PEFT's key of the (D_out,) magnitude
        for path, t in (variant.peft_tensors(pm, slot) if variant.peft_tensors is not None else {}).items():
            names.append(f"base_model.model.{path}.{variant.peft_key}")
            parts.append(t.detach())
    dtype = dtype or parts[0].dtype
    sizes = [p.numel() for p in parts]
    gathered = torch.empty(sum(sizes), dtype=dtype, device=parts[0].device)  # (sum of sizes,): a fresh buffer
    torch._foreach_copy_([c.view(p.shape) for p, c in zip(parts, gathered.split(sizes), strict=True)], parts)
    if gathered.device.type != "cuda":
        return _Snapshot(names, [p.shape for p in parts], gathered.cpu(), None)
    host = torch.empty(gathered.shape, dtype=dtype, pin_memory=True)
    host.copy_(gathered, non_blocking=True)
    ready = torch.cuda.Event()
    ready.record()
    return _Snapshot(names, [p.shape for p in parts], host, ready)


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
    ``store`` has its own copy: it imports nothing of the packer's."""
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
