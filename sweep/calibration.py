"""The planner's calibration cache: measured memory models, and the base model's shape beside them.

A calibration is cached per (model files, dtype, device, shape and training options, torch and threads) in
``$LORA_SWEEP_CACHE`` (default ``~/.cache/lora-sweep``), ``calibration/<key>.json``. Beside the memory models the
entry keeps what a plan needs of the base model (``packer.plan.BaseShape``, read by ``packer.probe.base_shape``: its
adaptable projections, its parameter bytes and what one rank of an FSDP shard holds), so a second ``sweep plan``
reads both back and plans without loading the base's weights, or even transformers' modeling code: config-only, in
the time of the imports. Beside them, ``pack_step/<key>.json`` keeps the step time ``sweep plan`` measured on the
pack it sized (``sweep.pack_step``), keyed by the calibration's key and that pack's shape and slots, and
``bookkeeping/<key>.json`` what a trial budget's asks, rows and tells took (``sweep.bookkeeping``). The measuring is
the packer's (``packer.probe``); what is kept, and under which key, is the study's."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lora_sweep.packer.api import BaseShape, MemoryModel, Packer
from lora_sweep.store.api import cache_dir

if TYPE_CHECKING:
    from lora_sweep.sweep.config.spec import StudySpec

__all__ = ["calibrated", "cached_calibration", "cache_dir", "calibration_key",
           "probe_options", "CALIBRATION_VERSION", "SHARD_WORLDS", "cached_lengths", "cache_lengths",
           "tokenize_seconds",
           "PACK_STEP_VERSION", "cached_pack_step", "cache_pack_step", "cached_bookkeeping", "cache_bookkeeping"]

CALIBRATION_VERSION = 5
"""Bump when ``packer.probe.calibrate`` measures differently: older cache entries are then not read."""
PACK_STEP_VERSION = 6
"""Bump when ``sweep.pack_step`` times the sized pack differently (its steps, its slots, its rows) or keeps more of
it (2: the pack's start and its slots' turnover beside the step; 3: a batch of each evaluator on the ending slots;
4: and what its first batch took beyond it; 5: on the CPU timed until the steps hold ``PACK_TIMED_S``, after the
turnover; 6: each evaluator's batch timed until its batches hold ``EVAL_TIMED_S``)."""
SHARD_WORLDS = (2, 4, 8)
"""World sizes whose FSDP share the cache keeps (a host's GPUs); others are computed from the loaded model."""


def cached_calibration(spec: StudySpec, device: str,
                       calibrations: int = 1) -> tuple[list[MemoryModel], str, BaseShape] | None:
    """The cache's memory models (``calibrations`` of them), where they came from and the base's shape, for the
    study on ``device`` (``cuda``, ``cpu``); None when the cache holds fewer. Loads no model."""
    key = calibration_key(spec, device)
    path = _entry(key)
    record = _read(path, key)
    if record is None or "base" not in record or len(record["models"]) < calibrations:
        return None
    try:
        models = [MemoryModel(**m) for m in record["models"][:calibrations]]
        return models, f"cached ({path})", BaseShape.from_json(record["base"])
    except (ValueError, TypeError, KeyError):
        return None  # written by another version: measure again


def calibrated(spec: StudySpec, packer: Packer, calibrations: int = 1,
               log: Callable[[str], None] | None = None, *, load_s: float = 0.0,
               imports_s: float = 0.0) -> tuple[list[MemoryModel], str, BaseShape]:
    """The study's calibrated memory models (``calibrations`` of them), a line saying where they came from and the
    base's shape kept beside them: the cache when it holds as many for this model, device and shape, else measured
    now (one line through ``log`` first, as it takes a while) and cached with the base's shape, its forward's time
    (``forward_seconds``) and the ``load_s`` and ``imports_s`` the caller measured (``BaseShape``)."""
    device = str(packer.model.device)
    cached = cached_calibration(spec, device, calibrations)
    if cached is not None:
        return cached
    if log is not None:
        log(f"calibrating the memory model on {device}: {calibrations} x 4 probe packs of {packer.probe_steps} steps "
            f"at {spec.data.max_length} tokens (cached for the next plan or run)")
    shape = packer.shape(SHARD_WORLDS)  # before the probes: they wrap the projections, the shape is the same
    shape = dataclasses.replace(shape, forward_s=packer.forward_seconds(), load_s=load_s, imports_s=imports_s)
    t0 = time.perf_counter()
    models = [packer.calibrate(spec.data.max_length, pad_id=0, chunked_ce=spec.pack.chunked_ce,
                               activation_checkpointing=spec.pack.activation_checkpointing,
                               optimizer_in_backward=spec.train.optimizer_in_backward, **probe_options(spec))
              for _ in range(calibrations)]
    seconds = time.perf_counter() - t0
    key = calibration_key(spec, device)
    path = _entry(key)
    _write(path, {"key": key, "models": [dataclasses.asdict(m) for m in models], "base": shape.to_json(),
                  "seconds": round(seconds, 3), "at": time.time()})
    return models, f"measured in {seconds:.1f} s ({calibrations} x 4 probe packs; cached in {path})", shape


def _lengths_key(spec: StudySpec) -> dict[str, Any]:
    """What the training rows' token lengths depend on: the tokenizer (the model's files), the file, its reading."""
    data = spec.data
    return {"version": 1, "model": _files(spec.model.path, spec.model.gguf_file), "data": _files(str(data.train), None),
            "format": data.format, "max_length": data.max_length, "train_on_prompt": data.train_on_prompt}


def cached_lengths(spec: StudySpec) -> list[int] | None:
    """Token lengths of the study's training rows as the last plan tokenized them, or None: the time of a plan from
    the cache needs only these, not the tokenizer (whose load costs more than the rest of such a plan)."""
    key = _lengths_key(spec)
    record = _read(_entry(key, "lengths"), key)
    lengths = None if record is None else record.get("lengths")
    return lengths if isinstance(lengths, list) and all(isinstance(n, int) for n in lengths) else None


def cache_lengths(spec: StudySpec, lengths: list[int], seconds: float = 0.0) -> None:
    """Keep the token lengths of the study's training rows for ``cached_lengths``, and the ``seconds`` reading and
    tokenizing its data took (``tokenize_seconds``)."""
    key = _lengths_key(spec)
    _write(_entry(key, "lengths"), {"key": key, "lengths": lengths, "seconds": seconds})


def tokenize_seconds(spec: StudySpec) -> float:
    """Seconds a run takes to read and tokenize the study's data, as the plan that cached its lengths measured them
    (``cache_lengths``); 0 where none did."""
    key = _lengths_key(spec)
    record = _read(_entry(key, "lengths"), key)
    seconds = None if record is None else record.get("seconds")
    return float(seconds) if isinstance(seconds, (int, float)) else 0.0


def _pack_step_key(spec: StudySpec, device: str, pack: dict[str, Any]) -> dict[str, Any]:
    """What a sized pack's step time depends on: everything a calibration does (``calibration_key``: the model,
    the device, torch and threads, the training options) and the ``pack`` itself (its shape, its slots' adapters,
    how many steps were timed)."""
    return {"version": PACK_STEP_VERSION, "calibration": calibration_key(spec, device), "pack": pack}


def cached_pack_step(spec: StudySpec, device: str, pack: dict[str, Any]) -> tuple[dict[str, Any], Path] | None:
    """The record ``cache_pack_step`` kept for this study's ``pack`` on ``device``, and its file; None if none."""
    key = _pack_step_key(spec, device, pack)
    path = _entry(key, "pack_step")
    record = _read(path, key)
    return None if record is None else (record, path)


def cache_pack_step(spec: StudySpec, device: str, pack: dict[str, Any], record: dict[str, Any]) -> Path:
    """Keep ``record`` (what timing ``pack`` measured) for ``cached_pack_step``; returns its file."""
    key = _pack_step_key(spec, device, pack)
    path = _entry(key, "pack_step")
    _write(path, {**record, "key": key, "at": time.time()})
    return path


def cached_bookkeeping(key: dict[str, Any]) -> tuple[dict[str, Any], Path] | None:
    """The record ``cache_bookkeeping`` kept under ``key`` (``sweep.bookkeeping``'s), and its file; None if none."""
    path = _entry(key, "bookkeeping")
    record = _read(path, key)
    return None if record is None else (record, path)


def cache_bookkeeping(key: dict[str, Any], record: dict[str, Any]) -> Path:
    """Keep ``record`` (a trial budget's bookkeeping, timed) for ``cached_bookkeeping``; returns its file."""
    path = _entry(key, "bookkeeping")
    _write(path, {**record, "key": key, "at": time.time()})
    return path


def calibration_key(spec: StudySpec, device: str) -> dict[str, Any]:
    """What a calibration depends on: the model's files (names, sizes, modification times), dtype and
    quantization, the device (and GPU), the kernels, the sequence length and the training options the probe
    takes (``probe_options``), torch's version and CPU threads (``Packer.measured_on``). Computed from the spec,
    without the model; ``device`` as ``sweep plan`` resolves it (``cuda``) or as a pack's (``cuda:0``), the same key."""
    return {"version": CALIBRATION_VERSION, "model": _files(spec.model.path, spec.model.gguf_file),
            "dtype": spec.model.dtype, "quantize": spec.model.quantize, **Packer.measured_on(device),
            "kernels": spec.pack.kernels, "fused_base_ops": spec.pack.fused_base_ops,
            "seq_len": spec.data.max_length, "chunked_ce": spec.pack.chunked_ce,
            "activation_checkpointing": spec.pack.activation_checkpointing,
            "optimizer_in_backward": spec.train.optimizer_in_backward, **probe_options(spec)}


def probe_options(spec: StudySpec) -> dict[str, Any]:
    """The adapter options of the planner's probes for the study's space, as the packer sizes its dearest slot
    (``Packer.probe_options``: ``dora`` where a trial can be a DoRA slot, at the largest ``dropout`` it can train)
    from each setting's values over the space (``train.<name>``, or ``search.<name>``'s choices or range ends)."""
    return Packer.probe_options(lambda name: spec.setting_values(name, ranged=True))


def _entry(key: dict[str, Any], kind: str = "calibration") -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    return cache_dir() / kind / f"{digest}.json"


def _files(path: str, gguf_file: str | None) -> list[Any]:
    """(name, size, mtime) of a local model's files; a hub id as itself."""
    root = Path(path) / gguf_file if gguf_file else Path(path)
    if root.is_file():
        return [str(root), root.stat().st_size, root.stat().st_mtime_ns]
    if not root.is_dir():
        return [path]
    return [str(root), *[[f.name, f.stat().st_size, f.stat().st_mtime_ns] for f in sorted(root.iterdir())
                         if f.is_file()]]


def _read(path: Path, key: dict[str, Any]) -> dict[str, Any] | None:
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return None  # none yet, or a torn file: measure again
    if not isinstance(record, dict) or record.get("key") != json.loads(json.dumps(key)):
        return None
    return record


def _write(path: Path, record: dict[str, Any]) -> None:
    from lora_sweep.store.api import atomic_write_text

    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, json.dumps(record, indent=1))
    except OSError:
        pass  # a read-only home: the plan stands, the next one measures again
