"""How many slots a pack gets, and what a study will cost, before any training: ``sweep plan``.

The memory model (``packer.plan.MemoryModel``) is calibrated on the study's own model and device by
``packer.probe.calibrate``; the worst-case slot of the search space (largest rank and micro-batch,
widest target set, full sequence length) decides how many fit.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from packer.inject import all_linear_params
from packer.model import PackedModel
from packer.plan import MemoryModel
from packer.probe import available_memory, calibrate
from sweep.spec import StudySpec

__all__ = ["auto_slots", "PlanReport", "plan_pack", "MEMORY_FRACTION", "MAX_AUTO_SLOTS"]

MEMORY_FRACTION = 0.85
"""Share of the device's available memory a pack may plan for (the rest: fragmentation, evaluation)."""
MAX_AUTO_SLOTS = 64


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

    def table(self) -> str:
        gib = 1024**3
        total = "-" if self.predicted_total_s is None else f"{self.predicted_total_s:.0f} s ({self.pack_steps} steps)"
        rows = [
            ("device", self.device),
            ("slots per pack", str(self.slots)),
            ("worst-case slot", f"rank {self.worst_rank}, micro-batch {self.worst_micro_batch}, seq {self.seq_len}"),
            ("memory available (planned share)", f"{self.available_bytes / gib:.2f} GiB ({MEMORY_FRACTION:.0%})"),
            ("predicted peak of a full pack", f"{self.predicted_peak_bytes / gib:.3f} GiB"),
            ("static (base model)", f"{self.memory.static_bytes / gib:.3f} GiB"),
            ("per token / per token x rank", f"{self.memory.bytes_per_token / 1024:.1f} KiB / "
                                             f"{self.memory.bytes_per_token_rank:.0f} B"),
            ("per adapter parameter", f"{self.memory.bytes_per_param:.1f} B"),
            ("predicted step", f"{self.predicted_step_s * 1000:.0f} ms"),
            ("predicted time for the trial budget (no pruning)", total),
        ]
        width = max(len(k) for k, _ in rows)
        return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def _worst(spec: StudySpec) -> tuple[int, int]:
    """(largest rank, largest micro-batch) over the space; the worst slot targets every projection."""
    def values(name: str, fixed: object) -> list:
        p = next((p for p in spec.search.params if p.name == name), None)
        if p is None:
            return [fixed]
        return list(p.choices) if p.kind == "categorical" else [p.high]

    rank = max(int(v) for v in values("rank", spec.train.rank))
    micro = max(int(v) for v in values("micro_batch", spec.train.micro_batch))
    return rank, micro


def plan_pack(spec: StudySpec, pm: PackedModel, *, mean_len: float | None = None) -> PlanReport:
    """Calibrate the memory model and size the pack; ``mean_len`` (tokens per row) sharpens the time."""
    rank, micro = _worst(spec)
    seq = spec.data.max_length
    mm = calibrate(pm, seq, rows=(1, 3), pad_id=0, chunked_ce=spec.packing.chunked_ce,
                   activation_checkpointing=spec.packing.activation_checkpointing)
    available = int(available_memory(pm.device) * MEMORY_FRACTION)
    params = all_linear_params(pm.model, rank)
    fit = mm.max_slots(available, micro * seq, params, rank, limit=MAX_AUTO_SLOTS)
    if spec.packing.max_slots != "auto":
        slots = int(spec.packing.max_slots)
    else:
        slots = max(1, min(fit, spec.budget.trials or MAX_AUTO_SLOTS))
    step_tokens = int(slots * micro * (mean_len or seq))
    step_s = mm.step_seconds(step_tokens)
    steps = None
    if spec.budget.trials is not None:
        max_steps = max(int(v) for v in ([spec.train.max_steps] + [p.high for p in spec.search.params
                                                                  if p.name == "max_steps"]))
        steps = -(-spec.budget.trials * max_steps // slots)
    return PlanReport(str(pm.device), slots, rank, micro, seq, available,
                      mm.predict(slots * micro * seq, slots * params, slots * rank, rank), mm, step_s,
                      None if steps is None else steps * step_s, steps)


def auto_slots(spec: StudySpec, pm: PackedModel) -> int:
    """Slots for ``packing: {max_slots: auto}``."""
    return plan_pack(spec, pm).slots


def padded_mean_length(lengths: list[int], rows: int, samples: int = 50, seed: int = 0) -> float:
    """Mean padded length per row of random batches of ``rows`` rows (what a step really computes)."""
    rng = random.Random(seed)
    if not lengths:
        return 0.0
    return sum(max(rng.choices(lengths, k=rows)) for _ in range(samples)) / samples
