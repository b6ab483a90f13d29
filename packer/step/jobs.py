"""What the training loop takes and gives back: slot jobs in; step reports, slot ends and run totals out.

A leaf, so that ``packer.step.loop`` (the step's parts) and ``packer.step.train`` (the loop) both use them
without an
import circle; ``packer.step.train`` re-exports them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from lora_sweep.packer.data.stream import target_tokens
from lora_sweep.packer.plan import AdapterSpec

__all__ = ["BatchSource", "FixedBatch", "SlotJob", "SlotEnd", "StepReport", "TrainResult", "Window", "Tally",
           "target_tokens", "STEP_NAMES"]

STEP_NAMES = {"cuda-graph": "fixed shapes, replayed as CUDA graphs", "eager": "fixed shapes, eagerly"}
"""``TrainResult.step`` values, and what each means in words."""


class BatchSource(Protocol):
    """A slot's data stream (``packer.data.rows.SlotStream`` is one)."""

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
class Window:
    """The micro-batches of a slot's current optimizer step (gradient accumulation, ``k`` of them).

    At the start of an optimizer step all ``k`` micro-batches are drawn at once, so that their target tokens N
    are known before the first is trained: each micro-batch then adds (sum of its token losses) / N to the
    backward (``weight``), and the accumulated gradient is that of the mean over all N tokens, as if the k
    micro-batches were one batch (transformers' ``num_items_in_batch``): independent of the split."""

    k: int
    queue: list[list[Any]] = field(default_factory=list)
    tokens: int = 0
    """Target tokens of the current optimizer step, all its micro-batches."""

    def draw(self, stream: BatchSource) -> list[Any]:
        """The next micro-batch; at the start of an optimizer step, draws all of that step's micro-batches."""
        if not self.queue:
            self.queue = [stream.next_batch() for _ in range(self.k)]
            self.tokens = sum(target_tokens(r) for rows in self.queue for r in rows)
        return self.queue.pop(0)

    @property
    def complete(self) -> bool:
        """Whether the micro-batch drawn last is its optimizer step's last: the slot steps after it."""
        return not self.queue

    def weight(self, count: int) -> float:
        """The factor turning a micro-batch's mean loss over its ``count`` target tokens into its share of the
        step's mean (1 without accumulation: the micro-batch mean is the step's mean)."""
        return 1.0 if self.k == 1 else count / max(self.tokens, 1)


@dataclass
class Tally:
    """The reported loss and input tokens of a slot's optimizer step, summed over its micro-batches as their
    losses arrive (which the step reads back later than it draws them)."""

    loss_sum: float = 0.0
    input_tokens: int = 0

    def add(self, loss: float, count: int, input_tokens: int, k: int) -> None:
        """One micro-batch: its mean loss over ``count`` target tokens and its non-padding tokens."""
        # without accumulation the step's loss is the micro-batch mean itself, not mean * count / count
        self.loss_sum = loss if k == 1 else self.loss_sum + loss * count
        self.input_tokens += input_tokens

    def take(self, tokens: int, k: int) -> tuple[float, int]:
        """(mean loss over the step's ``tokens`` target tokens, its input tokens); starts the next step's tally."""
        loss = self.loss_sum if k == 1 else self.loss_sum / max(tokens, 1)
        out = loss, self.input_tokens
        self.loss_sum, self.input_tokens = 0.0, 0
        return out


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
    """Seconds of the parallel kernel precompile before a graph key's first step."""
    warmup_s: float = 0.0
    """Seconds of the eager warm-up steps before each CUDA-graph capture."""
    capture_s: float = 0.0
    """Seconds spent capturing CUDA graphs."""
    graphs: int = 0
    """CUDA graphs captured (0: eager)."""
    shapes: set[tuple[int, int]] = field(default_factory=set)
    """The step shapes trained, (rows per slot, padded length): one CUDA graph each on a captured step (for each
    set of adapted layers and dropout / packing switch)."""
    step: str = ""
    """How the step ran (``STEP_NAMES``): ``cuda-graph`` (replayed as CUDA graphs) or ``eager`` (eagerly: on
    the CPU, with ``cuda_graphs: off``, or after a capture failed)."""
    fallback: str | None = None
    """Why a CUDA run's step ran eagerly although graphs were asked for: its configuration and the capture's error
    with the line that raised it (None: captured, on the CPU, or ``cuda_graphs: off``)."""
