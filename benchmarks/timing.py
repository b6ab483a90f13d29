"""Slot jobs on random token rows, the one step timer every benchmark uses and the check every benchmark row passes
before it is printed. A leaf beside ``shapes``: it imports no benchmark but ``shapes``, so ``gpu_bench`` and the
benchmarks it runs (``gpu_profile``) can both use it without importing each other.

A training step's time is its own only when the step has finished on the device and its losses are on the host:
``timed_steps`` reads the loss ring after every step (``readback_every=1``; the loop's default reads it every 8
steps, whose reports then arrive together) and synchronises the device before each stamp.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from lora_sweep.benchmarks.shapes import PROJ
from lora_sweep.packer.data.rows import Example
from lora_sweep.packer.model.packed import PackedModel
from lora_sweep.packer.plan import AdapterSpec
from lora_sweep.packer.step.jobs import StepReport, TrainResult
from lora_sweep.packer.step.train import FixedBatch, SlotJob, train

__all__ = ["ImplausibleRow", "StepTimes", "check_row", "counted_params", "gemm_tflops", "random_jobs", "sig",
           "step_flops", "time_calls", "timed_steps", "timed_train"]

TIMES = ("step_ms", "step_s", "makespan_s", "wall_s")
"""Row fields that are the time of a measured step or run: positive and finite."""
RATES = ("tok_s", "tokens_per_s", "mfu", "hfu")
"""Row fields that are a throughput: positive and finite."""
TOKEN_RATES = ("tok_s", "tokens_per_s")
"""Throughputs in tokens/s: times the model FLOPs of a token, at most the device's GEMM rate."""
FRACTIONS = ("mfu", "hfu")
"""Throughputs as a fraction of the measured GEMM rate: at most 1."""


class ImplausibleRow(ValueError):
    """A benchmark row holds a figure no measurement can give; the benchmark stops rather than print it."""


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


@dataclass
class StepTimes:
    """What ``timed_steps`` measured of one call of ``train``."""

    seconds: list[float]
    """Every global step's seconds, in order: from the previous step's stamp (the first: from the call of ``train``)
    to this step's, the device synchronised and its losses read; the caller's ``on_step`` is not counted."""
    reports: list[list[StepReport]]
    """Every global step's reports."""
    at: list[float]
    """Every global step's stamp, ``time.perf_counter()``."""
    result: TrainResult

    def median(self, warmup: int) -> float:
        """Median seconds of the steps after the first ``warmup``.

        Raises:
            ValueError: no step after ``warmup``.
        """
        if len(self.seconds) <= warmup:
            raise ValueError(f"{len(self.seconds)} steps timed: none after a warm-up of {warmup}")
        return statistics.median(self.seconds[warmup:])

    def input_tokens(self, warmup: int) -> float:
        """Mean non-padding tokens per step after the first ``warmup`` (every slot's rows)."""
        return statistics.mean(sum(r.input_tokens for r in reps) for reps in self.reports[warmup:])


def _synchronize(pm: PackedModel) -> Callable[[], None]:
    """A call that waits for the device holding ``pm``'s base (nothing to wait for on the CPU)."""
    device = next(pm.model.parameters()).device
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


def timed_steps(pm: PackedModel, jobs: list[SlotJob] | Callable[[int], SlotJob | None], slots: int, *,
                on_step: Callable[[list[StepReport]], None] | None = None, **options: object) -> StepTimes:
    """Train ``jobs`` (consumed; or a ``next_job`` callable) in ``slots`` slots with ``train``'s ``options`` and
    time every global step (``StepTimes.seconds``); ``on_step`` also receives each step's reports, outside the
    timed span.

    Raises:
        ValueError: ``options`` sets ``readback_every`` (a step's time is its own only when its losses are read
            back after it).
        RuntimeError: a global step gave no report (a step of accumulation only): its time would count in the next.
    """
    if "readback_every" in options:
        raise ValueError("timed_steps reads the loss ring after every step: readback_every cannot be set")
    sync = _synchronize(pm)
    times = StepTimes([], [], [], TrainResult())
    mark = [time.perf_counter()]

    def stamp(reports: list[StepReport]) -> None:
        sync()
        now = time.perf_counter()
        if reports[0].step != len(times.seconds):
            raise RuntimeError(f"step {reports[0].step} reported after {len(times.seconds)} steps: a step without "
                               "an optimizer step cannot be timed on its own")
        times.seconds.append(now - mark[0])
        times.reports.append(reports)
        times.at.append(now)
        if on_step is not None:
            on_step(reports)
        mark[0] = time.perf_counter()

    next_job = jobs if callable(jobs) else (lambda s: jobs.pop(0) if jobs else None)  # type: ignore[union-attr]
    times.result = train(pm, slots, next_job, pad_id=0, on_step=stamp, readback_every=1,  # type: ignore[arg-type]
                         **options)
    return times


def timed_train(pm: PackedModel, jobs: list[SlotJob], slots: int, warmup: int, **options: object) -> float:
    """Median seconds of the steps after ``warmup`` (``timed_steps``)."""
    return timed_steps(pm, jobs, slots, **options).median(warmup)


def time_calls(step: Callable[[], None], warmup: int, steps: int, device: torch.device | str = "cuda") -> float:
    """Mean seconds per call of ``step`` after ``warmup`` calls: wall clock between two synchronisations of
    ``device`` (on CUDA the peak memory is reset first)."""
    cuda = torch.device(device).type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    for _ in range(warmup):
        step()
    sync()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    sync()
    return (time.perf_counter() - t0) / steps


def counted_params(model: torch.nn.Module) -> int:
    """Parameters the 4N rule counts: all but the input embedding and the adapters, the output head included (a tied
    head, which ``named_parameters`` lists once as the embedding, too)."""
    cfg = model.config  # type: ignore[attr-defined]
    n = sum(p.numel() for n, p in model.named_parameters() if "embed_tokens" not in n and "lora_" not in n)
    return n + (cfg.vocab_size * cfg.hidden_size if cfg.tie_word_embeddings else 0)


def step_flops(config: object, params: int, rows: int, seq: int) -> float:
    """Model FLOPs of one training step on ``rows`` rows of ``seq`` tokens, the MFU numerator of every benchmark: 4
    per counted base weight (``params``) and token (the frozen base's forward, 2, and its backward to the
    activations, 2: no weight gradient) plus attention's QK^T and PV, 4 * seq^2 * hidden per layer and row forward,
    three times that with the backward. The adapters' own FLOPs are not counted."""
    layers, hidden = config.num_hidden_layers, config.hidden_size  # type: ignore[attr-defined]
    return 4 * params * rows * seq + 3 * 4 * layers * seq * seq * hidden * rows


def gemm_tflops(device: torch.device | str = "cuda", dtype: torch.dtype | None = None) -> float:
    """Measured square-GEMM rate of ``device``, TFLOP/s: the MFU denominator and ``check_row``'s ceiling. CUDA: bf16
    8192^3, 20 back to back between CUDA events (``dtype`` ignored); CPU: 512^3 in ``dtype`` (default fp32), the
    best of three rounds of five on the wall clock (a ceiling: the least disturbed round)."""
    if torch.device(device).type == "cuda":
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
    a = torch.randn(512, 512, dtype=dtype or torch.float32)
    b = torch.randn_like(a)
    a @ b
    best = math.inf
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(5):
            a @ b
        best = min(best, time.perf_counter() - t0)
    return 2 * 512**3 * 5 / best / 1e12


def sig(x: float, digits: int = 4) -> float:
    """``x`` to ``digits`` significant digits: a small figure (a tiny model's MFU) keeps its value where rounding to
    decimal places would print 0.0."""
    return float(f"{x:.{digits}g}")


def check_row(row: dict, name: str, *, flops_per_token: float | None = None, tflops: float | None = None) -> dict:
    """``row`` if every figure in it is one a measurement can give, else an error naming ``name`` and the field:
    a time (``TIMES``) or throughput (``RATES``) not positive or not finite, an MFU/HFU above 1, or (given the
    model FLOPs of one token, ``flops_per_token``, and the device's measured GEMM rate ``tflops``, all ranks
    together) tokens/s whose FLOP rate the GEMM rate cannot reach.

    Raises:
        ImplausibleRow: the first such field.
    """
    for field in TIMES + RATES:
        if field in row:
            value = row[field]
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) \
                    or value <= 0:
                raise ImplausibleRow(f"{name}: {field} = {value!r}, not a positive finite figure")
    for field in FRACTIONS:
        if field in row and row[field] > 1:
            raise ImplausibleRow(f"{name}: {field} = {row[field]}, above the measured GEMM rate")
    if flops_per_token is not None and tflops is not None:
        for field in TOKEN_RATES:
            if field in row and row[field] * flops_per_token / 1e12 > tflops:
                raise ImplausibleRow(
                    f"{name}: {field} = {row[field]} at {flops_per_token:.4g} model FLOPs a token is "
                    f"{row[field] * flops_per_token / 1e12:.4g} TFLOP/s, above the measured GEMM rate {tflops:.4g}")
    return row
