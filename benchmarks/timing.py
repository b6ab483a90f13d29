"""Slot jobs on random token rows and the step timers the GPU benchmarks share. A leaf beside ``shapes``: it
imports no benchmark but ``shapes``, so ``gpu_bench`` and the benchmarks it runs (``gpu_profile``) can both use it
without importing each other."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

from lora_sweep.benchmarks.shapes import PROJ
from lora_sweep.packer.data.rows import Example
from lora_sweep.packer.model.packed import PackedModel
from lora_sweep.packer.plan import AdapterSpec
from lora_sweep.packer.step.train import FixedBatch, SlotJob, train

__all__ = ["gemm_tflops", "step_flops", "random_jobs", "timed_train", "time_calls"]


def random_jobs(slots: int, micro: int, seq: int, vocab: int, steps: int,
                rank: int | tuple[int, ...] = 16) -> list[SlotJob]:
    """``slots`` adapters (rank ``rank``, or ``rank[i % len(rank)]``, on ``PROJ``) each on ``micro`` fixed random
    token rows of ``seq`` tokens (a ``FixedBatch``: the same [micro, seq] batch every step) for ``steps`` steps."""
    gen = torch.Generator().manual_seed(0)
    ranks = (rank,) if isinstance(rank, int) else rank
    jobs = []
    for i in range(slots):
        ids = torch.randint(0, vocab, (micro, seq), generator=gen).tolist()
        r = ranks[i % len(ranks)]
        spec = AdapterSpec(rank=r, alpha=2 * r, targets=PROJ, micro_batch=micro, max_steps=steps, seed=i, lr=1e-4)
        jobs.append(SlotJob(spec, FixedBatch([Example(tuple(row), tuple(row)) for row in ids]), key=i))
    return jobs


def timed_train(pm: PackedModel, jobs: list[SlotJob], slots: int, warmup: int, **options: object) -> float:
    """Median seconds of the steps after ``warmup`` (each report follows a host sync on the losses: on the static
    step, whose reports otherwise arrive every 8 steps together, the ring is read after every step; at the 7-8B
    shapes' 0.5-1 s steps that sync costs nothing measurable)."""
    stamps: list[float] = []
    options.setdefault("readback_every", 1)
    train(pm, slots, lambda s: jobs.pop(0) if jobs else None, pad_id=0,
          on_step=lambda reports: stamps.append(time.perf_counter()), **options)  # type: ignore[arg-type]
    return statistics.median(b - a for a, b in zip(stamps[warmup - 1:], stamps[warmup:], strict=False))


def time_calls(step: Callable[[], None], warmup: int, steps: int) -> float:
    """Mean seconds per call of ``step`` after ``warmup`` calls (synchronised wall clock; resets the CUDA peak)."""
    torch.cuda.reset_peak_memory_stats()
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / steps


def step_flops(config: object, params: int, rows: int, seq: int) -> float:
    """Model FLOPs of one training step on ``rows`` rows of ``seq`` tokens, the MFU numerator of every benchmark: 4
    per counted base weight (``params``) and token (the frozen base's forward, 2, and its backward to the
    activations, 2: no weight gradient) plus attention's QK^T and PV, 4 * seq^2 * hidden per layer and row forward,
    three times that with the backward. The adapters' own FLOPs are not counted."""
    layers, hidden = config.num_hidden_layers, config.hidden_size  # type: ignore[attr-defined]
    return 4 * params * rows * seq + 3 * 4 * layers * seq * seq * hidden * rows


def gemm_tflops() -> float:
    """Measured bf16 8192^3 GEMM rate: the MFU denominator."""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn_like(a)
    for _ in range(3):
        a @ b
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(20):
        a @ b
    end.record()
    torch.cuda.synchronize()
    return 2 * 8192**3 * 20 / (start.elapsed_time(end) / 1e3) / 1e12
