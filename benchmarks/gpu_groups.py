"""Benchmark: the static step with the shared-input groups (q/k/v, gate/up as one call each) against without them.

``python -m lora_sweep.benchmarks.gpu_groups`` (H200; a command, not a test). The pack ``gpu_bench --part large``
builds for Llama-3-8B (random-init bf16 model of its shape, SDPA, fused base, r=16 on the seven projections, 12 slots
x 1 row x 1024 tokens, chunked loss), trained on the step a default sweep runs (the static step, replayed as a CUDA
graph), four ways: groups on and off, without LoRA dropout and with dropout 0.1 on every slot. One JSON line each
(median ms per step of the steps after the warm-up, ``timing.timed_steps``: each step's losses read back and the
device synchronised; tokens/s), then a line of the ratios off / on.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
from collections.abc import Iterator
from dataclasses import replace

import torch

import lora_sweep.packer.model.packed as packer_model
from lora_sweep.benchmarks.shapes import build_shape
from lora_sweep.benchmarks.timing import check_row, counted_params, gemm_tflops, random_jobs, step_flops, timed_train
from lora_sweep.packer.model.packed import PackedModel

__all__ = ["grouped_vs_alone"]


@contextlib.contextmanager
def _groups(on: bool) -> Iterator[None]:
    """Packs made inside link their shared-input groups (``packer.model.slices.link_groups``), or none of them (each
    projection then runs alone, as ``tests/packer/model/test_slices.py`` compares)."""
    real = packer_model.link_groups

    def none(layers: dict) -> list:
        for layer in layers.values():
            layer.group = None
        return []

    packer_model.link_groups = real if on else none  # type: ignore[assignment]
    try:
        yield
    finally:
        packer_model.link_groups = real


def grouped_vs_alone(shape: str = "llama3-8b", slots: int = 12, seq: int = 1024, *, dropout: float = 0.0,
                     warmup: int = 3, steps: int = 8, tflops: float | None = None) -> list[dict]:
    """Median step time of the same pack with groups on, then off (one model, packs one after another), each row
    checked (``check_row``; against the GEMM rate ``tflops`` where given)."""
    model = build_shape(shape)
    per_token = step_flops(model.config, counted_params(model), 1, 1)  # before a pack wraps the projections
    rows = []
    for on in (True, False):
        with _groups(on):
            pm = PackedModel(model, impl="triton")
            jobs = [replace(j, spec=replace(j.spec, dropout=dropout))
                    for j in random_jobs(slots, 1, seq, model.config.vocab_size, warmup + steps)]
            step_s = timed_train(pm, jobs, slots, warmup, chunked_ce=True)
            grouped = sum(len(g.members) for g in pm.groups)
        row = dict(shape=shape, slots=slots, seq=seq, dropout=dropout, groups=on, grouped_projections=grouped,
                   step_ms=round(step_s * 1e3, 2), tok_s=round(slots * seq / step_s))
        rows.append(check_row(row, f"groups {'on' if on else 'off'}, dropout {dropout}", flops_per_token=per_token,
                              tflops=tflops))
        del pm
        gc.collect()
        torch.cuda.empty_cache()
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m lora_sweep.benchmarks.gpu_groups", description=__doc__)
    parser.add_argument("--shape", default="llama3-8b")
    parser.add_argument("--slots", type=int, default=12)
    parser.add_argument("--seq", type=int, default=1024)
    args = parser.parse_args(argv)
    tflops = gemm_tflops()
    for dropout in (0.0, 0.1):
        on, off = grouped_vs_alone(args.shape, args.slots, args.seq, dropout=dropout, tflops=tflops)
        for row in (on, off):
            print(json.dumps(row), flush=True)
        print(json.dumps(dict(dropout=dropout, off_over_on=round(off["step_ms"] / on["step_ms"], 3))), flush=True)


if __name__ == "__main__":
    main()
