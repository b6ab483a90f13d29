"""Where a small model's packed step goes: host time against GPU kernel time (a command, not a test).

``python -m lora_sweep.benchmarks.gpu_host --model models/scale-qwen2 --data studies/data/arith-train.jsonl`` trains
``--slots`` adapters (ranks 8/16/32 cycled, micro-batch ``--micro``) on random full rows and on the
data file's rows (half the slots with dropout 0.05, as a sweep draws them), on the Triton kernels and on
the PyTorch path, and prints each median step; then profiles five steps of the data run and prints
the kernel time per step and the top host and device operators. ``--cprofile`` instead runs 20 data
steps on the Triton kernels under cProfile (after 15 unprofiled ones) and prints the Python functions
that take the host's time. A scale-out worker of ``studies/scale-out.yaml`` runs exactly such packs.
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import pstats
import statistics

import torch

from lora_sweep.benchmarks import gpu_profile
from lora_sweep.benchmarks.timing import check_row, random_jobs, timed_steps, timed_train
from lora_sweep.packer.data.rows import Example, SlotStream, load_examples
from lora_sweep.packer.model.load import load_base
from lora_sweep.packer.model.packed import PackedModel
from lora_sweep.packer.step.train import SlotJob, train

__all__ = ["main"]


def _jobs(kind: str, examples: list[Example], slots: int, micro: int, steps: int, vocab: int) -> list[SlotJob]:
    """``timing.random_jobs`` on random full rows of 64 tokens (ranks 8/16/32 cycled); for ``data`` each slot
    reads the data file instead, and every other slot has dropout 0.05."""
    jobs = random_jobs(slots, micro, 64, vocab, steps, rank=(8, 16, 32))
    if kind == "data":
        for i, job in enumerate(jobs):
            job.spec = dataclasses.replace(job.spec, dropout=0.05 if i % 2 else 0.0)
            job.stream = SlotStream(examples, micro, seed=0)
    return jobs


def main(argv: list[str] | None = None) -> None:
    from torch.profiler import ProfilerActivity, profile, schedule

    parser = argparse.ArgumentParser(prog="python -m lora_sweep.benchmarks.gpu_host", description=__doc__)
    parser.add_argument("--model", required=True, help="model folder (from_pretrained)")
    parser.add_argument("--data", required=True, help="prompt/completion JSONL")
    parser.add_argument("--slots", type=int, default=8)
    parser.add_argument("--micro", type=int, default=16)
    parser.add_argument("--max-length", type=int, default=64)
    parser.add_argument("--cprofile", action="store_true", help="Python functions of 20 profiled steps instead")
    args = parser.parse_args(argv)
    model, tokenizer = load_base(args.model, dtype="bfloat16", device="cuda")
    examples = load_examples(args.data, tokenizer, fmt="prompt_completion", max_length=args.max_length)
    print(f"{len(examples)} examples, mean length {statistics.mean(len(e.input_ids) for e in examples):.1f} tokens")
    vocab = model.config.vocab_size
    if args.cprofile:
        _cprofile(model, examples, args.slots, args.micro, vocab)
        return
    for kind, impl in (("random", "triton"), ("data", "triton"), ("data", "torch")):
        jobs = _jobs(kind, examples, args.slots, args.micro, 25, vocab)
        step = timed_train(PackedModel(model, impl=impl), jobs, args.slots, warmup=5)  # type: ignore[arg-type]
        check_row({"step_ms": step * 1e3}, f"{kind} rows, {impl}")
        print(f"{kind:>6} rows, {impl:>6}: median step {step * 1e3:.1f} ms", flush=True)
    jobs = _jobs("data", examples, args.slots, args.micro, 25, vocab)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], acc_events=True,
                 schedule=schedule(wait=10, warmup=3, active=5)) as prof:
        timed_steps(PackedModel(model, impl="triton"), jobs, args.slots,  # type: ignore[arg-type]
                    on_step=lambda _reports: prof.step())
    events = prof.key_averages()
    kernel_ms = sum(e.self_device_time_total for e in gpu_profile.kernel_events(events)) / 5e3
    host_ms = sum(e.self_cpu_time_total for e in events if e.key == "ProfilerStep*") / 5e3
    print(f"profiled data/triton steps: {kernel_ms:.1f} ms of kernels per step; {host_ms:.1f} ms of host time "
          "per step outside any operator (Python between ops)")
    print(events.table(sort_by="self_cpu_time_total", row_limit=15))
    print(events.table(sort_by="self_device_time_total", row_limit=10))


def _cprofile(model: torch.nn.Module, examples: list[Example], slots: int, micro: int, vocab: int) -> None:
    """20 steps of the data pack on the Triton kernels under cProfile, after 15 unprofiled ones (compiles,
    allocator); prints the functions by own time and by cumulative time."""
    pm = PackedModel(model, impl="triton")
    timed_train(pm, _jobs("data", examples, slots, micro, 15, vocab), slots, warmup=5)
    jobs = _jobs("data", examples, slots, micro, 20, vocab)
    prof = cProfile.Profile()
    prof.enable()
    train(pm, slots, lambda s: jobs.pop(0) if jobs else None, pad_id=0)
    torch.cuda.synchronize()
    prof.disable()
    stats = pstats.Stats(prof)
    stats.sort_stats("tottime").print_stats(28)
    stats.sort_stats("cumulative").print_stats(25)


if __name__ == "__main__":
    main()
