"""Where a packed step's GPU time goes, by kind of kernel, beside the frozen base alone at the same rows.

    python -m lora_sweep.benchmarks.gpu_profile --shape llama3-8b --slots 8 --seq 1024 [--eager]

Prints, for a packed step (``--eager``: the base's norms and MLPs left to transformers' eager modules) and
then for the base alone (forward, full loss, backward to the activations), the kernel time per step summed
by ``CATEGORIES`` and the heaviest kernels. It found the eager base's elementwise kernels at 30% of a
Llama-3-8B step's kernel time, which ``packer.model.fuse`` then took on (BENCHMARKS.md). ``profile_step`` is
``python -m lora_sweep.benchmarks.gpu_bench --part small``'s profile of the 0.5B pack (host and device top operators).
"""

from __future__ import annotations

import argparse
import collections
import re
import statistics

import torch

from lora_sweep.benchmarks.shapes import SHAPES, build_shape
from lora_sweep.benchmarks.timing import check_row, random_jobs, sig, time_calls, timed_steps

__all__ = ["CATEGORIES", "category", "breakdown", "kernel_events", "profile_step"]

CATEGORIES = (("attention", r"flash|fmha|sdpa|attention"), ("gemm", r"gemm|nvjet|cutlass|xmma|cublas"),
              ("lora", r"_seg_|_dropout_mask|_keep_bits"), ("fused base", r"_rms_norm_|_silu_mul_"),
              ("multi-tensor", r"adam|multi_tensor"), ("reduce", r"reduce"),
              ("elementwise", r"elementwise|vectorized|unrolled"), ("copy", r"copy|memcpy|memset|Cat"))
"""(name, pattern) pairs; a kernel takes the first whose pattern its name matches, ``other`` when none does."""


def category(kernel_name: str) -> str:
    """The first of ``CATEGORIES`` whose pattern ``kernel_name`` matches (case-insensitive), else ``other``."""
    return next((name for name, pattern in CATEGORIES if re.search(pattern, kernel_name, re.I)), "other")


def breakdown(prof: torch.profiler.profile, steps: int, wall_ms: float, title: str, top: int = 12) -> str:
    """A profile's kernels as ms per step by category, then the ``top`` heaviest kernels."""
    kernels = kernel_events(prof.key_averages())
    by = collections.Counter()
    for e in kernels:
        by[category(e.key)] += e.self_device_time_total / steps / 1e3
    total = sum(by.values())
    lines = [f"== {title}: {wall_ms:.1f} ms per step, kernels {total:.1f} ms"]
    lines += [f"   {name:<12}{ms:8.1f} ms {ms / total:6.1%}" for name, ms in by.most_common()]
    for e in sorted(kernels, key=lambda e: -e.self_device_time_total)[:top]:
        lines.append(f"   {e.self_device_time_total / steps / 1e3:8.2f} ms x{e.count // steps:<5} "
                     f"[{category(e.key)}] {e.key[:100]}")
    return "\n".join(lines)


def _profile_pack(pm: object, slots: int, seq: int) -> tuple[torch.profiler.profile, list[float]]:
    """Six steps of ``slots`` x 1 x ``seq`` random rows on ``pm`` (a ``PackedModel``), the last three profiled;
    returns the profile and each step's seconds (``timing.timed_steps``: the profiler's step marks outside them)."""
    from torch.profiler import ProfilerActivity, profile, schedule

    jobs = random_jobs(slots, 1, seq, pm.model.config.vocab_size, 6)  # type: ignore[attr-defined]
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], acc_events=True,
                 schedule=schedule(wait=0, warmup=3, active=3)) as prof:
        timed = timed_steps(pm, jobs, slots, on_step=lambda _reports: prof.step(),  # type: ignore[arg-type]
                            chunked_ce=True)
    return prof, timed.seconds


def profile_step(model: torch.nn.Module, slots: int, seq: int, out_dir: str | None) -> dict:
    """Where a packed step's time goes: wall time vs GPU-busy time, the top host and device ops.

    Writes the full operator table to ``out_dir/profile_<slots>.txt`` when ``out_dir`` is given.
    """
    from lora_sweep.packer.model.packed import PackedModel

    prof, seconds = _profile_pack(PackedModel(model, impl="triton"), slots, seq)
    events = prof.key_averages()
    kernels = kernel_events(events)
    device_us = sum(e.self_device_time_total for e in kernels) / 3
    table = events.table(sort_by="self_cpu_time_total", row_limit=40)
    if out_dir:
        from pathlib import Path

        Path(out_dir, f"profile_{slots}.txt").write_text(
            table + "\n\n" + events.table(sort_by="self_device_time_total", row_limit=40))
    top_cpu = sorted(events, key=lambda e: -e.self_cpu_time_total)[:6]
    top_dev = sorted(kernels, key=lambda e: -e.self_device_time_total)[:6]
    row = dict(workload="profile", slots=slots, seq=seq, step_ms=sig(statistics.median(seconds[3:]) * 1e3),
               gpu_busy_ms=round(device_us / 1e3, 1),
               top_cpu_ms={e.key[:40]: round(e.self_cpu_time_total / 3e3, 1) for e in top_cpu},
               top_gpu_ms={e.key[:40]: round(e.self_device_time_total / 3e3, 1) for e in top_dev})
    return check_row(row, f"profile {slots} x {seq}")


def kernel_events(events: list) -> list:
    """The GPU kernels of a profile's ``key_averages()``. CPU ops carry their kernels' time too, and the
    profiler's step ranges the step's span on the GPU timeline: neither is kernel time."""
    from torch.autograd import DeviceType

    return [e for e in events if e.device_type == DeviceType.CUDA and not e.key.startswith("ProfilerStep")]


def main(argv: list[str] | None = None) -> None:
    from torch.profiler import ProfilerActivity, profile

    from lora_sweep.packer.model.packed import PackedModel

    parser = argparse.ArgumentParser(prog="python -m lora_sweep.benchmarks.gpu_profile", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b")
    parser.add_argument("--slots", type=int, default=8, help="slots x 1 row each; also the base's rows")
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--eager", action="store_true", help="leave the base's norms and MLPs eager")
    args = parser.parse_args(argv)
    model = build_shape(args.shape)
    pm = PackedModel(model, impl="triton", fused_base_ops=not args.eager)
    prof, seconds = _profile_pack(pm, args.slots, args.seq)
    wall = statistics.mean(seconds[-3:]) * 1e3
    print(breakdown(prof, 3, wall, f"packed {args.slots} x {args.seq}" + (" (eager base)" if args.eager else "")))
    del pm
    torch.cuda.empty_cache()
    ids = torch.randint(0, model.config.vocab_size, (args.slots, args.seq), device="cuda")

    def step() -> None:
        emb = model.get_input_embeddings()(ids).detach().requires_grad_()  # the base is frozen (PackedModel)
        model(inputs_embeds=emb, labels=ids, use_cache=False).loss.backward()

    for _ in range(2):
        step()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        base_s = time_calls(step, 0, 3)
    print(breakdown(prof, 3, base_s * 1e3, f"base alone {args.slots} x {args.seq}"
                    + ("" if args.eager else " (fused norms and MLPs)")))


if __name__ == "__main__":
    main()
