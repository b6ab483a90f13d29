"""How many slots a pack gets, and what a study will cost, before any training: ``sweep plan``.

The memory model (``packer.plan.MemoryModel``) is calibrated on the study's own model and device by
``packer.probe.calibrate``; the worst-case slot of the search space (largest rank and micro-batch,
widest target set, full sequence length) decides how many fit.

A calibration is cached per (model files, device, shape and training options, torch and threads): in
``$LORA_SWEEP_CACHE`` (default ``~/.cache/lora-sweep``), ``calibration/<key>.json``. A second ``sweep plan``,
or a ``packing: auto`` run after it, reads the memory model back instead of probing again. What it is worth:
the memory terms are exact for the probed shapes (on CUDA the allocator's peak, on the CPU counted tensor
bytes) and linear between them; the time terms come from two timed probes of two steps each, as noisy as the
host is busy (a loaded shared CPU can be off by a large factor: the plan's time is a guide, its slots are not).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import random
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn

from lora_sweep.packer.data import Example
from lora_sweep.packer.errors import ConfigError
from lora_sweep.packer.inject import all_linear_params, resolve_targets
from lora_sweep.packer.model import PackedModel
from lora_sweep.packer.packing import batches_per_epoch
from lora_sweep.packer.plan import MemoryModel
from lora_sweep.packer.probe import available_memory, calibrate
from lora_sweep.sweep.spec import StudySpec

__all__ = ["auto_slots", "check_targets", "largest_rank", "PlanReport", "plan_pack", "trial_micro_steps",
           "MEMORY_FRACTION", "MAX_AUTO_SLOTS", "calibrated", "cache_dir", "calibration_key"]

MEMORY_FRACTION = 0.85
"""Share of the device's available memory a pack may plan for (the rest: fragmentation, evaluation)."""
MAX_AUTO_SLOTS = 64
CALIBRATION_VERSION = 2
"""Bump when ``packer.probe.calibrate`` measures differently: older cache entries are then not read."""


@dataclass(frozen=True)
class PlanReport:
    """What ``sweep plan`` prints."""

    device: str
    slots: int
    worst_rank: int
    worst_micro_batch: int
    seq_len: int
    available_bytes: int
    predicted_peak_bytes: int
    memory: MemoryModel
    predicted_step_s: float
    predicted_total_s: float | None
    pack_steps: int | None
    step_range_s: tuple[float, float] | None = None
    """(fastest, slowest) predicted step over the calibrations; None after a single one."""
    calibrations: int = 1
    quantize: str | None = None
    """``model.quantize`` (``nf4``: the static part is the NF4 base, measured as such)."""
    calibration: str = ""
    """Where the memory model came from: measured (how long it took) or the cache (its file)."""

    def table(self) -> str:
        gib = 1024**3
        total = "-" if self.predicted_total_s is None else \
            f"{self.predicted_total_s:.0f} s ({self.pack_steps} pack steps)"
        rows = [
            ("device", self.device),
            ("slots per pack", str(self.slots)),
            ("worst-case slot", f"rank {self.worst_rank}, micro-batch {self.worst_micro_batch}, seq {self.seq_len}"),
            ("memory available (planned share)", f"{self.available_bytes / gib:.2f} GiB ({MEMORY_FRACTION:.0%})"),
            ("predicted peak of a full pack", f"{self.predicted_peak_bytes / gib:.3f} GiB"),
            ("static (base model" + (f", {self.quantize} projections" if self.quantize else "") + ")",
             f"{self.memory.static_bytes / gib:.3f} GiB"),
            ("per token / per token x rank", f"{self.memory.bytes_per_token / 1024:.1f} KiB / "
                                             f"{self.memory.bytes_per_token_rank:.0f} B"),
            ("per adapter parameter", f"{self.memory.bytes_per_param:.1f} B"),
            ("predicted step", self._step_text()),
            ("calibration", self.calibration or "-"),
            ("accuracy", "memory: measured at the probed sizes, linear between them (the slots); time: two "
                         "timed probes, as noisy as the host is busy (a guide)"),
            ("predicted time for the trial budget (no pruning)", total),
        ]
        width = max(len(k) for k, _ in rows)
        return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


    def _step_text(self) -> str:
        text = f"{self.predicted_step_s * 1000:.0f} ms"
        if self.step_range_s is None:
            return text
        low, high = self.step_range_s
        spread = f"{high / low:.1f}x" if low > 0 else "unbounded"
        return (f"{text} (median of {self.calibrations} calibrations; range {low * 1000:.0f}-{high * 1000:.0f} ms, "
                f"spread {spread})")


def check_targets(spec: StudySpec, model: nn.Module) -> None:
    """Every target set the study can train names projections ``model`` has (as ``sweep run`` requires).

    Raises:
        ConfigError: ``search.targets.<set>`` (or ``train.targets``) names a module the model lacks.
    """
    searched = any(p.name == "targets" for p in spec.search.params)
    sets = spec.search.target_sets.items() if searched else [("", spec.train.targets)]
    for name, modules in sets:
        try:
            resolve_targets(model, modules)
        except ConfigError as err:
            key = f"search.targets.{name}" if searched else "train.targets"
            raise ConfigError(f"{key}: {str(err).removeprefix('targets: ')}") from None


def _largest(spec: StudySpec, name: str, fixed: object) -> int:
    """The largest value of setting ``name`` over the space (``fixed`` when it is not searched)."""
    p = next((p for p in spec.search.params if p.name == name), None)
    return int(fixed) if p is None else max(int(v) for v in (p.choices if p.kind == "categorical" else [p.high]))


def largest_rank(spec: StudySpec) -> int:
    """The largest rank a trial of the space can have: what a pack is planned for and sized by."""
    return _largest(spec, "rank", spec.train.rank)


def _worst(spec: StudySpec) -> tuple[int, int]:
    """(largest rank, largest micro-batch) over the space; the worst slot targets every projection."""
    return largest_rank(spec), _largest(spec, "micro_batch", spec.train.micro_batch)


def trial_micro_steps(spec: StudySpec, micro: int, examples: Sequence[Example] | None = None) -> int:
    """Pack steps (micro-batches) the longest trial takes: its optimizer steps times its accumulation.

    Optimizer steps: the largest ``max_steps`` of the space, or with ``train.epochs`` (``max_steps`` not searched)
    and the ``examples``, the epochs' steps at micro-batch ``micro`` as a trial counts them
    (``sweep._trial_data.epoch_steps``: ``ceil(epochs * ceil(micro-batches per epoch / accumulation))``, each
    epoch capped at ``max_steps_per_epoch``)."""
    train = spec.train
    accum = _largest(spec, "gradient_accumulation_steps", train.gradient_accumulation_steps)
    searched = {p.name for p in spec.search.params}
    if train.epochs is not None and "max_steps" not in searched and examples:
        batches = batches_per_epoch(examples, micro, sample_packing=train.sample_packing,
                                    row_len=spec.data.max_length, seed=spec.seed)
        per_epoch = max(1, -(-batches // accum))
        if train.max_steps_per_epoch is not None:
            per_epoch = min(per_epoch, train.max_steps_per_epoch)
        steps = max(1, math.ceil(train.epochs * per_epoch))
    else:
        steps = _largest(spec, "max_steps", train.max_steps)
    return steps * accum


def plan_pack(spec: StudySpec, pm: PackedModel, *, mean_len: float | None = None,
              calibrations: int = 1, examples: Sequence[Example] | None = None,
              log: Callable[[str], None] | None = None) -> PlanReport:
    """Calibrate the memory model and size the pack; ``mean_len`` (tokens per row) sharpens the time.

    ``calibrations`` > 1 calibrates that many times and predicts with the median step (the report
    gives the range); memory comes from that calibration too. The time counts every trial's micro-batches
    (``trial_micro_steps``: optimizer steps x accumulation; with ``train.epochs``, from ``examples``).
    """
    rank, micro = _worst(spec)
    seq = spec.data.max_length
    models, where = calibrated(spec, pm, calibrations, log=log)
    mm = models[0]
    available = int(available_memory(pm.device) * MEMORY_FRACTION)
    params = all_linear_params(pm.model, rank)
    fit = mm.max_slots(available, micro * seq, params, rank, limit=MAX_AUTO_SLOTS)
    if spec.packing.max_slots != "auto":
        slots = int(spec.packing.max_slots)
    else:
        slots = max(1, min(fit, spec.budget.trials or MAX_AUTO_SLOTS))
    step_tokens = int(slots * micro * (mean_len or seq))
    times = [m.step_seconds(step_tokens) for m in models]
    step_s = statistics.median_low(times)
    mm = models[times.index(step_s)]
    steps = None
    if spec.budget.trials is not None:
        steps = -(-spec.budget.trials * trial_micro_steps(spec, micro, examples) // slots)
    return PlanReport(str(pm.device), slots, rank, micro, seq, available,
                      mm.predict(slots * micro * seq, slots * params, slots * rank, rank), mm, step_s,
                      None if steps is None else steps * step_s, steps,
                      (min(times), max(times)) if len(models) > 1 else None, len(models), spec.model.quantize,
                      where)


def auto_slots(spec: StudySpec, pm: PackedModel, log: Callable[[str], None] | None = None) -> int:
    """Slots for ``packing: {max_slots: auto}`` (the calibration announced through ``log``)."""
    return plan_pack(spec, pm, log=log).slots


def calibrated(spec: StudySpec, pm: PackedModel, calibrations: int = 1,
               log: Callable[[str], None] | None = None) -> tuple[list[MemoryModel], str]:
    """The study's calibrated memory models (``calibrations`` of them) and a line saying where they came from:
    the cache when it holds as many for this model, device and shape, else measured now (one line through
    ``log`` first, as it takes a while) and cached."""
    key = calibration_key(spec, pm)
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    path = cache_dir() / "calibration" / f"{digest}.json"
    cached = _read_cache(path, key)
    if cached is not None and len(cached) >= calibrations:
        return cached[:calibrations], f"cached ({path})"
    if log is not None:
        log(f"calibrating the memory model on {pm.device}: {calibrations} x 4 probe packs of 2 steps at "
            f"{spec.data.max_length} tokens (cached for the next plan or run)")
    t0 = time.perf_counter()
    models = [calibrate(pm, spec.data.max_length, rows=(1, 3), pad_id=0, chunked_ce=spec.packing.chunked_ce,
                        activation_checkpointing=spec.packing.activation_checkpointing,
                        optimizer_in_backward=spec.train.optimizer_in_backward) for _ in range(calibrations)]
    seconds = time.perf_counter() - t0
    _write_cache(path, key, models, seconds)
    return models, f"measured in {seconds:.1f} s ({calibrations} x 4 probe packs; cached in {path})"


def cache_dir() -> Path:
    """``$LORA_SWEEP_CACHE``, else ``$XDG_CACHE_HOME/lora-sweep``, else ``~/.cache/lora-sweep``."""
    if os.environ.get("LORA_SWEEP_CACHE"):
        return Path(os.environ["LORA_SWEEP_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "lora-sweep"


def calibration_key(spec: StudySpec, pm: PackedModel) -> dict[str, Any]:
    """What a calibration depends on: the model's files (names, sizes, modification times), dtype and
    quantization, the device (and GPU), the kernels, the sequence length and the training options the probe
    takes, torch's version and CPU threads."""
    import torch

    device = str(pm.device)
    if pm.device.type == "cuda":
        device += f" {torch.cuda.get_device_name(pm.device)}"
    return {"version": CALIBRATION_VERSION, "model": _files(spec.model.path, spec.model.gguf_file),
            "dtype": str(next(pm.model.parameters()).dtype), "quantize": spec.model.quantize, "device": device,
            "kernels": spec.packing.kernels, "fused_base_ops": spec.packing.fused_base_ops,
            "seq_len": spec.data.max_length, "chunked_ce": spec.packing.chunked_ce,
            "activation_checkpointing": spec.packing.activation_checkpointing,
            "optimizer_in_backward": spec.train.optimizer_in_backward, "torch": torch.__version__,
            "threads": torch.get_num_threads()}


def _files(path: str, gguf_file: str | None) -> list[Any]:
    """(name, size, mtime) of a local model's files; a hub id as itself."""
    root = Path(path) / gguf_file if gguf_file else Path(path)
    if root.is_file():
        return [str(root), root.stat().st_size, root.stat().st_mtime_ns]
    if not root.is_dir():
        return [path]
    return [str(root), *[[f.name, f.stat().st_size, f.stat().st_mtime_ns] for f in sorted(root.iterdir())
                         if f.is_file()]]


def _read_cache(path: Path, key: dict[str, Any]) -> list[MemoryModel] | None:
    try:
        record = json.loads(path.read_text())
        if record.get("key") != json.loads(json.dumps(key)):
            return None
        return [MemoryModel(**m) for m in record["models"]]
    except (OSError, ValueError, TypeError, KeyError):
        return None  # none yet, or written by another version: measure again


def _write_cache(path: Path, key: dict[str, Any], models: list[MemoryModel], seconds: float) -> None:
    from lora_sweep.sweep.store import atomic_write_text

    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, json.dumps({"key": key, "models": [dataclasses.asdict(m) for m in models],
                                            "seconds": round(seconds, 3), "at": time.time()}, indent=1))
    except OSError:
        pass  # a read-only home: the plan stands, the next one measures again


def padded_mean_length(lengths: list[int], rows: int, samples: int = 50, seed: int = 0) -> float:
    """Mean padded length per row of random batches of ``rows`` rows (what a step really computes)."""
    rng = random.Random(seed)
    if not lengths:
        return 0.0
    return sum(max(rng.choices(lengths, k=rows)) for _ in range(samples)) / samples
