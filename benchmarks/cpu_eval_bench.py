"""CPU benchmark: N adapters evaluated packed (all slots per forward) vs one slot at a time, and batched on the
pack's fixed shapes.

A command, not a timed test (``sweep bench --cpu-eval``). It builds a tiny random-init model in a temporary
directory, adds N adapters with random non-zero weights (``benchmarks.cpu_bench.bench_specs``: ranks 4..32, several
target sets), and times held-out loss and greedy generation on the same arithmetic items three ways, after
one warm-up call of each: packed on the per-adapter path (``batched: false``, the CPU's default), one adapter at a
time on it, and batched on the fixed shapes (``batched: true``, ``packer.step.eval_graph``, eager here: what CUDA
replays as graphs). The three ways give the same numbers.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from lora_sweep.benchmarks.cpu_bench import bench_specs, environment
from lora_sweep.benchmarks.timing import check_row
from lora_sweep.evaluators._core import EvalData
from lora_sweep.evaluators.generation import generation
from lora_sweep.evaluators.heldout_loss import heldout_loss
from lora_sweep.packer.model.load import load_base
from lora_sweep.packer.model.packed import PackedModel
from lora_sweep.packer.tiny.data import arithmetic_rows
from lora_sweep.packer.tiny.models import build_tiny_model

__all__ = ["EvalBenchResult", "cpu_eval_bench"]


@dataclass(frozen=True)
class EvalBenchResult:
    """Wall-clock seconds of each way of evaluating the same adapters on the same items."""

    adapters: int
    items: int
    max_new_tokens: int
    packed_loss_s: float
    sequential_loss_s: float
    packed_generation_s: float
    sequential_generation_s: float
    environment: str
    batched_loss_s: float
    batched_generation_s: float

    def _ways(self) -> list[tuple[str, float, float, float]]:
        return [("held-out loss", self.packed_loss_s, self.sequential_loss_s, self.batched_loss_s),
                ("generation", self.packed_generation_s, self.sequential_generation_s, self.batched_generation_s)]

    def rows(self) -> list[dict]:
        """One row an evaluation and way: its wall seconds."""
        return [{"evaluation": name, "way": way, "wall_s": secs}
                for name, packed, seq, batched in self._ways()
                for way, secs in (("packed", packed), ("one at a time", seq), ("batched", batched))]

    def table(self) -> str:
        """A plain-text table for the terminal and BENCHMARKS.md."""
        lines = [f"{self.adapters} adapters x {self.items} items, {self.max_new_tokens} new tokens; {self.environment}",
                 f"{'evaluation':<18}{'packed s':>10}{'one at a time s':>17}{'packed speed-up':>17}{'batched s':>11}"]
        for name, packed, seq, batched in self._ways():
            lines.append(f"{name:<18}{packed:>10.2f}{seq:>17.2f}{seq / packed:>16.2f}x{batched:>11.2f}")
        return "\n".join(lines)


def _pack(model_dir: Path, adapters: int) -> tuple[PackedModel, object]:
    model, tokenizer = load_base(str(model_dir))
    pm = PackedModel(model)
    generator = torch.Generator().manual_seed(0)
    for slot, spec in enumerate(bench_specs(adapters, steps=1)):
        pm.add_slot(slot, spec)
        with torch.no_grad():
            for _, b in pm.slot_weights(slot).values():  # B = 0 at init: make every adapter change the model
                b.normal_(0.0, 0.05, generator=generator)
    return pm, tokenizer


def _timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def cpu_eval_bench(adapters: int = 8, items: int = 64, max_new_tokens: int = 8, *, batch_size: int = 8,
                   progress: Callable[[str], None] = print) -> EvalBenchResult:
    """Evaluate ``adapters`` adapters packed and one at a time; returns the timings.

    Args:
        adapters: number of adapters (slots).
        items: held-out arithmetic items (prompt/completion rows).
        max_new_tokens: generation length per answer.
        batch_size: items per slot in one forward (the same in both ways).
        progress: called with a line before each timed part.
    """
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_tiny_model("llama", Path(tmp) / "tiny-llama", seed=0)
        pm, tokenizer = _pack(model_dir, adapters)
        data = EvalData(arithmetic_rows(items, seed=1, fmt="prompt_completion"), "prompt_completion", tokenizer)
        warm = EvalData(data.rows[:2], data.fmt, tokenizer)
        slots = list(range(adapters))
        gen_opts = {"max_new_tokens": max_new_tokens, "batch_size": batch_size, "batched": False}
        fixed = {"max_new_tokens": max_new_tokens, "batch_size": batch_size, "batched": True}
        for run_slots in (slots, slots[:1]):  # warm-up: first-call allocations and kernel selection
            for opts in (gen_opts, fixed):
                heldout_loss(pm, run_slots, warm, batch_size=batch_size, batched=opts["batched"])
                generation(pm, run_slots, warm, **opts)
        progress("held-out loss, packed ...")
        packed_loss = _timed(lambda: heldout_loss(pm, slots, data, batch_size=batch_size, batched=False))
        progress("held-out loss, one adapter at a time ...")
        seq_loss = _timed(lambda: [heldout_loss(pm, [s], data, batch_size=batch_size, batched=False) for s in slots])
        progress("held-out loss, batched on the fixed shapes ...")
        batched_loss = _timed(lambda: heldout_loss(pm, slots, data, batch_size=batch_size, batched=True))
        progress("generation, packed ...")
        packed_gen = _timed(lambda: generation(pm, slots, data, **gen_opts))
        progress("generation, one adapter at a time ...")
        seq_gen = _timed(lambda: [generation(pm, [s], data, **gen_opts) for s in slots])
        progress("generation, batched on the fixed shapes ...")
        batched_gen = _timed(lambda: generation(pm, slots, data, **fixed))
    result = EvalBenchResult(adapters, items, max_new_tokens, packed_loss, seq_loss, packed_gen, seq_gen,
                             environment(), batched_loss, batched_gen)
    for row in result.rows():
        check_row(row, f"cpu_eval_bench {row['evaluation']}, {row['way']}")
    return result
