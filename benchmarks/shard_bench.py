"""One pack over several GPUs of one host, its bf16 base sharded with FSDP2 and built on the meta device
(``packer.model.shard_load``): a base larger than one GPU.

A command, not a timed test (GPUs): ``python -m lora_sweep.benchmarks.shard_bench --shape llama3-70b --gpus 2 --slots 8
--seq 1024 --activation-checkpointing``. Each of ``--gpus`` ranks (NCCL, one process per GPU) builds the shape's
config on the meta device, shards it (``shard_base``) and draws a random init of its own shard only
(``materialise`` without a checkpoint: throughput does not depend on weight values, and a 70B checkpoint would not
fit the device's disk): no process ever holds the whole base. Then the pack trains ``--slots`` adapters (LoRA
r=``--rank`` on the seven projections, ``--micro`` rows of ``--seq`` random tokens, AdamW) on the eager step.

Reported (one JSON line, rank 0): per rank the base bytes it holds, the peak memory while loading and while
training; the load time; the median step after ``--warmup`` steps, tokens/s over all slots and MFU (``4 * N *
tokens`` for the frozen base plus the attention term, as ``qlora_bench`` counts it, against the measured bf16 GEMM
rate times the GPUs: every rank computes the whole pack, so a sharded pack's MFU is at most 1 / GPUs).
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.distributed as dist

from lora_sweep.benchmarks.shapes import SHAPES
from lora_sweep.benchmarks.timing import gemm_tflops, random_jobs, timed_train
from lora_sweep.packer.model.packed import PackedModel
from lora_sweep.packer.model.shard import local_param_bytes, shard_base
from lora_sweep.packer.model.shard_load import materialise, meta_model
from lora_sweep.packer.step.launch import spawn


def _flops(config: object, params: int, rows: int, seq: int) -> float:
    """Model FLOPs of one pack step over ``rows`` rows: the frozen base's ``params`` (embeddings excluded)."""
    layers, hidden = config.num_hidden_layers, config.hidden_size  # type: ignore[attr-defined]
    return 4 * params * rows * seq + 12 * layers * seq * seq * hidden * rows


def _rank(rank: int, world: int, a: argparse.Namespace) -> None:
    from transformers import AutoConfig

    torch.cuda.set_device(rank)
    tflops = gemm_tflops()  # on this rank's GPU, before the base: its buffers freed again
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    device = torch.device("cuda", rank)
    kw = dict(SHAPES[a.shape], **({"num_hidden_layers": a.layers} if a.layers else {}))
    config = AutoConfig.for_model(kw.pop("model_type"), **kw)
    start = time.perf_counter()
    model = meta_model(config, "bfloat16", "sdpa")
    pm = PackedModel(model, impl="auto", device=device)
    shard_base(pm)
    materialise(model, None, dtype=torch.bfloat16, device=device)
    torch.cuda.synchronize()
    load_s, load_peak = time.perf_counter() - start, torch.cuda.max_memory_allocated()
    params = sum(p.numel() for name, p in model.named_parameters() if "embed_tokens" not in name)
    torch.cuda.reset_peak_memory_stats()
    jobs = random_jobs(a.slots, a.micro, a.seq, config.vocab_size, a.warmup + a.steps, a.rank)
    row: dict = {}
    try:
        step_s = timed_train(pm, jobs, a.slots, a.warmup, cuda_graphs="off", chunked_ce=True,
                             activation_checkpointing=a.activation_checkpointing)
        tokens = a.slots * a.micro * a.seq
        row = {"step_s": round(step_s, 3), "tokens_per_s": round(tokens / step_s),
               "mfu": round(_flops(config, params, a.slots * a.micro, a.seq) / step_s / 1e12 / (tflops * world), 3)}
    except torch.OutOfMemoryError as err:  # a measurement that fails is a result too
        row = {"error": f"OutOfMemoryError: {str(err).splitlines()[0][:200]}"}
    mine = {"base_gib": round(local_param_bytes(model) / 2**30, 2), "load_peak_gib": round(load_peak / 2**30, 2),
            "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2), "load_s": round(load_s, 1)}
    ranks: list = [None] * world
    dist.all_gather_object(ranks, mine)
    if rank == 0:
        print(json.dumps({"shape": a.shape, "layers": config.num_hidden_layers, "gpus": world, "slots": a.slots,
                          "micro": a.micro, "seq": a.seq, "rank": a.rank,
                          "activation_checkpointing": a.activation_checkpointing, "gemm_tflops": round(tflops),
                          **row, "ranks": ranks}), flush=True)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m lora_sweep.benchmarks.shard_bench", description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="llama3-70b")
    p.add_argument("--layers", type=int, default=None, help="decoder layers (default: the shape's)")
    p.add_argument("--gpus", type=int, default=2)
    p.add_argument("--slots", type=int, default=8)
    p.add_argument("--micro", type=int, default=1)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--activation-checkpointing", action="store_true")
    a = p.parse_args(argv)
    spawn(_rank, a.gpus, a, backend="nccl", threads=None)  # no CUDA in this process: GPU 0 is rank 0's


if __name__ == "__main__":
    main()
