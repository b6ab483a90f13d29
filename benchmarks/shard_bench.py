"""One pack over several GPUs of one host, its bf16 base sharded with FSDP2 and built on the meta device
(``packer.model.shard_load``): a base larger than one GPU; beside it, with ``--baseline peft``, one adapter at a
time the way torchtune's distributed LoRA recipe trains it (PEFT + FSDP2, ``shard_peft``).

A command, not a timed test (GPUs): ``python -m lora_sweep.benchmarks.shard_bench --shape llama3-70b --gpus 2 --slots 8
--seq 1024 --activation-checkpointing --baseline peft``. Each of ``--gpus`` ranks (NCCL, one process per GPU) builds
the shape's config on the meta device, shards it (``shard_base``) and draws a random init of its own shard only
(``materialise`` without a checkpoint: throughput does not depend on weight values, and a 70B checkpoint would not
fit the device's disk): no process ever holds the whole base. Then the pack trains ``--slots`` adapters (LoRA
r=``--rank`` on the seven projections, ``--micro`` rows of ``--seq`` random tokens, AdamW) on the eager step.
With ``--baseline peft`` the same processes then free the pack and build the same shape again as a PEFT LoRA model
(rank ``--rank`` on the same projections, fp32 adapter like a slot's) sharded as torchtune shards it, the adapter's
A/B in their layer's FSDP unit, and train that one adapter with AdamW for the same steps, data parallel as torchtune
runs it: each rank ``--micro`` rows of its own, so a step trains ``--micro`` x ranks rows (the pack's ranks all
compute the same ``--slots`` x ``--micro`` rows).

Reported (one JSON line per run, rank 0): per rank the base bytes it holds, what it held before the run (the
baseline's: what the pack left), the peak memory while loading and while training; the load time; the counted base
parameters (N below); the adapter's parameters (a slot's; the PEFT model's trainable ones, whole); the median
step after ``--warmup`` steps, tokens/s over all the rows a step trains and MFU (``4 * N * tokens`` for the frozen
base plus the attention term, as ``qlora_bench`` counts it, against the measured bf16 GEMM rate times the GPUs: every
rank computes the whole pack, so a sharded pack's MFU is at most 1 / GPUs; the baseline's ranks compute different
rows). The baseline's line adds the pack's tokens/s over its own, and a short table of both ends the output.

``--device cpu`` runs the ranks as CPU processes over gloo, for the smoke test (tiny models, ``--config`` a model
directory): the peak memory is then the process's peak resident set (it cannot be reset between the runs), the
GEMM rate the CPU's in the base's dtype.
"""

from __future__ import annotations

import argparse
import gc
import json
import resource
import time
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from lora_sweep.benchmarks.shapes import PROJ, SHAPES
from lora_sweep.benchmarks.shard_peft import peft_model, timed_peft_steps, trainable_params
from lora_sweep.benchmarks.timing import check_row, gemm_tflops, random_jobs, sig, step_flops, timed_train
from lora_sweep.evaluators.cost import adapter_params
from lora_sweep.packer.model.inject import linear_shape, resolve_targets
from lora_sweep.packer.model.load import DTYPES
from lora_sweep.packer.model.packed import PackedModel
from lora_sweep.packer.model.shard import local_param_bytes, shard_base
from lora_sweep.packer.model.shard_load import materialise, meta_model
from lora_sweep.packer.step.launch import spawn

GIB = 2**30
T = TypeVar("T")


def _base_params(model: torch.nn.Module) -> int:
    """The frozen base's parameters, whole, without the embeddings and any adapter (``step_flops``' N)."""
    return sum(p.numel() for name, p in model.named_parameters()
               if "embed_tokens" not in name and not p.requires_grad and "lora_" not in name)


def _reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def _peak_bytes(device: torch.device) -> int:
    """The CUDA allocator's peak since ``_reset_peak``; on the CPU the process's peak resident set (Linux: KiB)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated()
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _allocated_bytes(device: torch.device) -> int:
    """What this rank holds now: the CUDA allocator's live bytes; on the CPU the process's resident set."""
    if device.type == "cuda":
        return torch.cuda.memory_allocated()
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def _speed(run: str, config: object, params: int, rows: int, seq: int, step_s: float, tflops: float,
           world: int) -> dict:
    """A row's timing fields: ``rows`` rows of ``seq`` tokens trained per step of ``step_s`` over ``world`` ranks of
    ``tflops`` each, checked (``check_row``). Significant digits, not decimal places: a tiny model's MFU on a GPU
    (1e-5 of its GEMM rate) would round to 0."""
    fields = {"step_s": sig(step_s), "tokens_per_s": round(rows * seq / step_s),
              "mfu": sig(step_flops(config, params, rows, seq) / step_s / 1e12 / (tflops * world))}
    return check_row(fields, f"{run} x{rows} x {seq}", flops_per_token=step_flops(config, params, 1, 1),
                     tflops=tflops * world)


def _oom(err: torch.OutOfMemoryError) -> dict:
    """A measurement that fails is a result too."""
    return {"error": f"OutOfMemoryError: {str(err).splitlines()[0][:200]}"}


def _slot_params(model: torch.nn.Module, rank: int) -> int:
    """Parameters of one of the pack's slots: rank ``rank`` on every ``PROJ`` projection, as ``add_slot`` lays
    them out (``r * (D_in + D_out)`` each)."""
    return adapter_params([linear_shape(model.get_submodule(p)) for p in resolve_targets(model, PROJ)], rank)


def _built(device: torch.device, build: Callable[[], T]) -> tuple[T, dict]:
    """``build()`` timed, its peak memory measured from a reset; returns what it built and this rank's load fields:
    what the rank held before (after a pack, what it left behind), the load's peak and seconds."""
    _reset_peak(device)
    held = _allocated_bytes(device)
    start = time.perf_counter()
    built = build()
    load = {"held_gib": round(held / GIB, 3), "load_peak_gib": round(_peak_bytes(device) / GIB, 3),
            "load_s": round(time.perf_counter() - start, 1)}
    _reset_peak(device)
    return built, load


def _finish(row: dict, load: dict, model: torch.nn.Module, device: torch.device, world: int) -> dict:
    """``row`` with every rank's memory (its base shard, its load fields, its peak while training) under ``ranks``:
    a collective, every rank calls it."""
    mine = {"base_gib": round(local_param_bytes(model) / GIB, 3), **load,
            "peak_gib": round(_peak_bytes(device) / GIB, 3)}
    ranks: list[Any] = [None] * world
    dist.all_gather_object(ranks, mine)
    return {**row, "ranks": ranks}


def _pack_row(config: object, a: argparse.Namespace, device: torch.device, world: int, tflops: float) -> dict:
    """Load the sharded pack, train ``--slots`` adapters and measure it (module docstring)."""

    def build() -> PackedModel:
        pm = PackedModel(meta_model(config, a.dtype, "sdpa"), impl="auto", device=device)
        shard_base(pm)
        materialise(pm.model, None, dtype=DTYPES[a.dtype], device=device)
        return pm

    pm, load = _built(device, build)
    params = _base_params(pm.model)  # before the slots: their projections wrapped, the count is the same
    row: dict = {"run": "pack", "adapters": a.slots, "rows_per_step": a.slots * a.micro, "base_params": params,
                 "adapter_params": _slot_params(pm.model, a.rank)}
    jobs = random_jobs(a.slots, a.micro, a.seq, config.vocab_size, a.warmup + a.steps, a.rank)  # type: ignore
    try:
        step_s = timed_train(pm, jobs, a.slots, a.warmup, cuda_graphs="off", chunked_ce=True,
                             activation_checkpointing=a.activation_checkpointing)
        row |= _speed("pack", config, params, a.slots * a.micro, a.seq, step_s, tflops, world)
    except torch.OutOfMemoryError as err:
        row |= _oom(err)
    return _finish(row, load, pm.model, device, world)


def _peft_row(config: object, a: argparse.Namespace, device: torch.device, world: int, tflops: float) -> dict:
    """Build the PEFT + FSDP2 baseline, train its one adapter on this rank's ``--micro`` rows and measure it."""
    model, load = _built(device, lambda: peft_model(config, rank=a.rank, dtype=a.dtype, device=device,
                                                    activation_checkpointing=a.activation_checkpointing))
    params = _base_params(model)
    row: dict = {"run": "peft", "adapters": 1, "rows_per_step": a.micro * world, "base_params": params,
                 "adapter_params": trainable_params(model)}
    gen = torch.Generator().manual_seed(1000 + dist.get_rank())  # each rank its own rows: data parallel
    ids = torch.randint(0, config.vocab_size, (a.micro, a.seq), generator=gen).to(device)  # type: ignore
    try:
        step_s = timed_peft_steps(model, ids, a.warmup, a.steps)
        row |= _speed("peft", config, params, a.micro * world, a.seq, step_s, tflops, world)
    except torch.OutOfMemoryError as err:
        row |= _oom(err)
    return _finish(row, load, model, device, world)


def table(rows: list[dict]) -> str:
    """The runs side by side (per-rank peak memory, tokens/s, MFU) and the first's tokens/s over the last's."""
    lines = [f"{'run':<16}{'peak GiB/rank':>22}{'tokens/s':>10}{'MFU':>8}"]
    for row in rows:
        who = f"{row['run']} x{row['adapters']}"
        peaks = " / ".join(f"{r['peak_gib']:.1f}" for r in row["ranks"])
        if "error" in row:
            lines.append(f"{who:<16}{peaks:>22}  {row['error'][:60]}")
        else:
            lines.append(f"{who:<16}{peaks:>22}{row['tokens_per_s']:>10}{row['mfu']:>8.3g}")
    first, last = rows[0], rows[-1]
    if len(rows) > 1 and "error" not in first and "error" not in last:
        lines.append(f"{first['run']} / {last['run']} tokens/s: {first['tokens_per_s'] / last['tokens_per_s']:.2f}x")
    return "\n".join(lines)


def _config(a: argparse.Namespace) -> object:
    """The transformers config of ``--config`` (a model directory or its ``config.json``) or of ``--shape``."""
    from transformers import AutoConfig

    layers = {"num_hidden_layers": a.layers} if a.layers else {}
    if a.config:
        return AutoConfig.from_pretrained(a.config, **layers)
    kw = dict(SHAPES[a.shape], **layers)
    return AutoConfig.for_model(kw.pop("model_type"), **kw)


def _rank(rank: int, world: int, a: argparse.Namespace) -> None:
    if a.device == "cuda":
        torch.cuda.set_device(rank)
    device = torch.device(a.device, rank) if a.device == "cuda" else torch.device("cpu")
    tflops = gemm_tflops(device, DTYPES[a.dtype])  # before the base: its buffers freed again
    config = _config(a)
    rows = [_pack_row(config, a, device, world, tflops)]
    if a.baseline == "peft":
        gc.collect()  # the pack and its FSDP state hold each other: freed only by a collection
        rows.append(_peft_row(config, a, device, world, tflops))
        if "error" not in rows[0] and "error" not in rows[1]:
            rows[1]["pack_over_peft"] = round(rows[0]["tokens_per_s"] / rows[1]["tokens_per_s"], 3)
    if rank == 0:
        head = {"shape": a.config or a.shape, "layers": config.num_hidden_layers, "gpus": world,  # type: ignore
                "device": a.device, "dtype": a.dtype, "micro": a.micro, "seq": a.seq, "rank": a.rank,
                "activation_checkpointing": a.activation_checkpointing, "gemm_tflops": sig(tflops)}
        for row in rows:
            print(json.dumps({**head, **row}), flush=True)
        if len(rows) > 1:
            print(table(rows), flush=True)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m lora_sweep.benchmarks.shard_bench", description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="llama3-70b")
    p.add_argument("--config", default=None, help="a model directory (its config.json) instead of --shape")
    p.add_argument("--layers", type=int, default=None, help="decoder layers (default: the shape's)")
    p.add_argument("--gpus", type=int, default=2, help="ranks: GPUs, or CPU processes with --device cpu")
    p.add_argument("--slots", type=int, default=8)
    p.add_argument("--micro", type=int, default=1)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--activation-checkpointing", action="store_true", help="in the pack and in the baseline")
    p.add_argument("--baseline", choices=("none", "peft"), default="none",
                   help="peft: then one adapter on PEFT + FSDP2 as torchtune trains it (shard_peft)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: gloo ranks (the smoke test)")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16", help="the base's")
    a = p.parse_args(argv)
    if a.warmup < 1:
        p.error("--warmup must be >= 1")
    # no CUDA in this process: GPU 0 is rank 0's; CPU ranks take one thread each (the cores are shared)
    spawn(_rank, a.gpus, a, backend="nccl" if a.device == "cuda" else "gloo",
          threads=None if a.device == "cuda" else 1)


if __name__ == "__main__":
    main()
