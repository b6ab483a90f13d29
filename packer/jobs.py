"""What a training loop takes and gives back: slot jobs in; step reports, slot ends and run totals out.

Both loops, ``packer.train.train`` and the static-shape ``packer.static_loop.train_static`` it hands CUDA runs
to, speak these types, so they live in this leaf rather than in either loop (the static loop importing them from
``packer.train``, which imports it back, was an import circle). ``packer.train`` re-exports them: callers keep
importing them from there.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from lora_sweep.packer.plan import AdapterSpec

__all__ = ["BatchSource", "FixedBatch", "SlotJob", "SlotEnd", "StepReport", "TrainResult"]


class BatchSource(Protocol):
    """A slot's data stream (``packer.data.SlotStream`` is one)."""

    def next_batch(self) -> list[Any]: ...


class FixedBatch:
    """A ``BatchSource`` serving the same rows at every step: for memory probes and benchmarks, whose
    results do not depend on which tokens a step trains."""

    def __init__(self, rows: list[Any]) -> None:
        self.rows = rows

    def next_batch(self) -> list[Any]:
        return self.rows


@dataclass
class SlotJob:
    """One adapter to train in a slot: its hyperparameters, its data, and the caller's handle."""

    spec: AdapterSpec
    stream: BatchSource
    key: Any = None
    """Caller's identifier (the sweep passes the Optuna trial number)."""


@dataclass(frozen=True)
class StepReport:
    """What one slot did in one global step."""

    step: int
    """Global step of the pack (0-based): one forward/backward over every slot's micro-batch."""
    slot: int
    key: Any
    slot_step: int
    """Optimizer steps this adapter has taken, this one included (1-based)."""
    loss: float
    """Mean cross-entropy over this slot's target tokens in this step."""
    tokens: int
    """Target (loss) tokens of this optimizer step (all its accumulated micro-batches)."""
    input_tokens: int
    """Non-padding tokens of this optimizer step's rows."""
    lr: float
    grad_norm: float
    """Gradient norm before clipping."""


@dataclass(frozen=True)
class SlotEnd:
    """A job leaving its slot; its weights are still in the model while the caller is told."""

    slot: int
    job: SlotJob
    steps: int
    """Optimizer steps the adapter took."""
    reason: str
    """``finished`` (max_steps), ``stopped`` (should_stop) or ``interrupted`` (max_global_steps)."""


@dataclass
class TrainResult:
    """Totals of one call of ``train``."""

    steps: int = 0
    tokens: int = 0
    input_tokens: int = 0
    wall_s: float = 0.0
    jobs_started: int = 0
    ended: list[tuple[Any, int, str]] = field(default_factory=list)
    """(key, steps done, reason) of every job that ended, in order."""
    compile_s: float = 0.0
    """Static-shape path: seconds of the parallel kernel precompile before a graph key's first step."""
    warmup_s: float = 0.0
    """Static-shape path: seconds of the eager warm-up steps before each CUDA-graph capture."""
    capture_s: float = 0.0
    """Static-shape path: seconds spent capturing CUDA graphs."""
    graphs: int = 0
    """Static-shape path: CUDA graphs captured (0: eager)."""
