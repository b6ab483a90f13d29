"""What an adapter variant costs in a pack: N slots of a variant against N plain slots, and PEFT's same variant
against its plain LoRA, in one call on one device.

A variant's cost is its own slots' extra work: LoRA+ none (two more columns of the optimizer table), PiSSA / OLoRA a
forward over 2r rows (the frozen principal correction, ``packer.variants.decompose``), DoRA the per-column norm and
magnitude. Random-init models of the SmolLM2 and Llama-3-8B shapes (``benchmarks.shapes``), bf16, SDPA, rank 16 on
the seven projections, every slot on ``micro`` fixed random rows; the pack's step is the median after warm-up
(``timing.timed_train``), PEFT's the mean of eager steps (``timing.time_calls``). One JSON line per shape:
``pack_plain_ms``, ``pack_variant_ms``, their ratio (the issue's bound: a DoRA slot <= 1.3x a plain one), and
``peft_plain_ms``, ``peft_variant_ms``, theirs. ``--dropout p`` gives every slot (and PEFT's adapter) LoRA dropout p on
both sides of each ratio: DoRA with dropout adds a base GEMM over the dropped part of its slots' input each way (PEFT's
DoRA takes ``W dropout(x)``, a second base GEMM over all of it).
Run: ``python -m lora_sweep.benchmarks.variants_bench --variant pissa`` (``--shape smollm2 --layers 2 --device cpu``
for a check without a GPU).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json

import torch

from lora_sweep.benchmarks.shapes import PROJ, SHAPES, SMOLLM2
from lora_sweep.benchmarks.timing import random_jobs, time_calls, timed_train
from lora_sweep.packer.model.packed import PackedModel

__all__ = ["VARIANTS", "main"]

VARIANTS = {"lora_plus": {"lr_ratio": 16.0}, "pissa": {"init": "pissa"}, "olora": {"init": "olora"},
            "dora": {"dora": True}}
"""Variant name -> the AdapterSpec fields it sets."""
_PEFT = {"lora_plus": {}, "pissa": {"init_lora_weights": "pissa"}, "olora": {"init_lora_weights": "olora"},
         "dora": {"use_dora": True}}
"""The LoraConfig arguments of the same variant (LoRA+ changes PEFT's optimizer only: its step is plain LoRA's)."""


def _build(shape: str, layers: int | None, device: str) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    kw = dict(SMOLLM2 if shape == "smollm2" else SHAPES[shape], **({"num_hidden_layers": layers} if layers else {}))
    cfg = AutoConfig.for_model(kw.pop("model_type"), **kw)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device(device):
        return AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16 if device == "cuda" else torch.float32)


def pack_ms(model: torch.nn.Module, variant: dict, *, slots: int, micro: int, seq: int, steps: int,
            warmup: int, kernels: str = "auto") -> float:
    """Median step (ms) of ``slots`` slots of rank 16, each with the AdapterSpec fields ``variant``, on ``kernels``."""
    jobs = random_jobs(slots, micro, seq, model.config.vocab_size, steps)
    for job in jobs:
        job.spec = dataclasses.replace(job.spec, **variant)
    return timed_train(PackedModel(model, impl=kernels), jobs, slots, warmup) * 1e3  # type: ignore[arg-type]


def peft_ms(model: torch.nn.Module, config: dict, *, micro: int, seq: int, steps: int, warmup: int) -> float:
    """Mean eager step (ms) of one PEFT adapter of rank 16 on the seven projections with LoraConfig ``config``."""
    from peft import LoraConfig, get_peft_model

    peft = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules=list(PROJ), **config))
    peft.train()  # PEFT's DoRA applies lora_dropout only while training (the shapes' own dropouts are 0)
    params = [p for p in peft.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4)
    ids = torch.randint(0, model.config.vocab_size, (micro, seq), device=model.device)

    def step() -> None:
        peft(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    ms = time_calls(step, warmup, steps, model.device) * 1e3
    peft.unload()  # the base back as it was (PiSSA rewrote its weights: a fresh model is built for the next)
    return ms


def row(args: argparse.Namespace, shape: str) -> dict:
    """One shape's line: the pack with plain and with variant slots, PEFT with and without the variant."""
    out: dict = dict(shape=shape, variant=args.variant, kernels=args.kernels, slots=args.slots, micro=args.micro,
                     seq=args.seq)
    run = dict(micro=args.micro, seq=args.seq, steps=args.steps, warmup=args.warmup)
    drop = {"dropout": args.dropout} if args.dropout else {}
    if drop:
        out["dropout"] = args.dropout
    for name, variant in (("plain", drop), ("variant", {**VARIANTS[args.variant], **drop})):
        model = _build(shape, args.layers, args.device)
        out[f"pack_{name}_ms"] = round(pack_ms(model, variant, slots=args.slots, kernels=args.kernels, **run), 2)
        del model
        gc.collect()
    peft_drop = {"lora_dropout": args.dropout} if args.dropout else {}
    for name, config in (("plain", peft_drop), ("variant", {**_PEFT[args.variant], **peft_drop})):
        out[f"peft_{name}_ms"] = round(peft_ms(_build(shape, args.layers, args.device), config, **run), 2)
        gc.collect()
    out["pack_ratio"] = round(out["pack_variant_ms"] / out["pack_plain_ms"], 3)
    out["peft_ratio"] = round(out["peft_variant_ms"] / out["peft_plain_ms"], 3)
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m lora_sweep.benchmarks.variants_bench",
                                description=__doc__.splitlines()[0])
    p.add_argument("--variant", choices=sorted(VARIANTS), required=True)
    p.add_argument("--shape", action="append", choices=["smollm2", *sorted(SHAPES)],
                   help="repeatable (default: smollm2 and llama3-8b)")
    p.add_argument("--layers", type=int, default=None, help="decoder layers (default: the shape's)")
    p.add_argument("--slots", type=int, default=16)
    p.add_argument("--micro", type=int, default=1)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--dropout", type=float, default=0.0, help="LoRA dropout of every slot and of PEFT's adapter")
    p.add_argument("--device", default="cuda")
    p.add_argument("--kernels", choices=["auto", "torch", "triton"], default="auto",
                   help="the pack's LoRA kernels (auto: Triton on CUDA)")
    args = p.parse_args(argv)
    for shape in args.shape or ["smollm2", "llama3-8b"]:
        print(json.dumps(row(args, shape)), flush=True)


if __name__ == "__main__":
    main()
