"""QLoRA on one GPU: N adapters packed over one frozen NF4 base (``model.quantize: nf4``, ``packer.model.quant``).

A command, not a timed test (GPU): ``python benchmarks/qlora_bench.py --shape llama3-70b --quantize nf4 --slots 8``.
The base is a random-init model of a real shape (throughput does not depend on weight values), built layer by
layer on the GPU from a meta-device skeleton: each decoder layer is materialised in bf16, initialised (normal,
std 0.02; norms 1) and its projections quantised to NF4 before the next one exists, so the bf16 model never has
to fit (a 70B one would not). ``--quantize none`` keeps the layers in bf16 (the comparison on 8B).

Each adapter: LoRA r=``--rank`` on the seven projections, micro-batch ``--micro`` rows of ``--seq`` random
tokens, AdamW. Reported (one JSON line): memory after the build (the base), peak memory of the training steps,
the median step time after ``--warmup`` steps, tokens/s over all slots, MFU, and the bytes of the adapters'
gradient buffers (what an optimizer step in the backward could free at most). MFU counts ``4 * N * tokens``
for the frozen base (forward + backward to the activations; a recompute under activation checkpointing is not
counted) plus the attention term ``12 * layers * seq^2 * hidden * rows``, against the measured bf16 GEMM rate
(as ``gpu_bench`` does).
"""

from __future__ import annotations

import argparse
import json
import time
import warnings

import torch
from torch import nn

from lora_sweep.benchmarks.shapes import PROJ, SHAPES
from lora_sweep.benchmarks.timing import ImplausibleRow, check_row, gemm_tflops, sig, step_flops, timed_steps
from lora_sweep.packer.data.rows import Example
from lora_sweep.packer.model.packed import PackedModel
from lora_sweep.packer.model.quant import quantize_base
from lora_sweep.packer.plan import AdapterSpec
from lora_sweep.packer.step.train import FixedBatch, SlotJob


def _init(module: nn.Module) -> None:
    """Random values in place: linear and embedding weights normal(0, 0.02), norm weights 1."""
    with torch.no_grad():
        for name, p in module.named_parameters(recurse=True):
            if p.dim() >= 2:
                p.normal_(0.0, 0.02)
            elif "norm" in name:
                p.fill_(1.0)
            else:
                p.zero_()


def build(shape: str, quantize: str | None, layers: int | None = None) -> nn.Module:
    """The random-init model of ``shape`` on the GPU, its decoder layers quantised one at a time (``quantize``)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    kw = dict(SHAPES[shape], **({"num_hidden_layers": layers} if layers else {}))
    cfg = AutoConfig.for_model(kw.pop("model_type"), **kw)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    body = model.model
    for part in (body.embed_tokens, body.norm, model.lm_head):
        part.to_empty(device="cuda")
        _init(part)
    for layer in body.layers:
        layer.to_empty(device="cuda")
        _init(layer)
        quantize_base(layer, quantize)
    with torch.device("cuda"):
        body.rotary_emb = type(body.rotary_emb)(config=cfg)  # its inv_freq is computed at init, not a weight
    assert not any(t.is_meta for t in [*model.parameters(), *model.buffers()])
    return model.requires_grad_(False).eval()




def _flops(model: nn.Module, rows: int, seq: int) -> float:
    n = sum(p.numel() for name, p in model.named_parameters() if "embed_tokens" not in name and "lora_" not in name)
    return step_flops(model.config, n, rows, seq)


def run(model: nn.Module, *, slots: int, micro: int, seq: int, rank: int, steps: int, warmup: int,
        activation_checkpointing: bool, graph: bool, peak_tflops: float) -> dict:
    """Train ``slots`` adapters for ``warmup + steps`` steps; the measured figures."""
    base_gib = torch.cuda.memory_allocated() / 2**30
    pm = PackedModel(model, impl="auto")
    gen = torch.Generator().manual_seed(0)
    jobs = []
    for i in range(slots):
        ids = torch.randint(0, model.config.vocab_size, (micro, seq), generator=gen).tolist()
        spec = AdapterSpec(rank=rank, alpha=2 * rank, targets=PROJ, micro_batch=micro, max_steps=warmup + steps,
                           seed=i, lr=1e-4)
        jobs.append(SlotJob(spec, FixedBatch([Example(tuple(r), tuple(r)) for r in ids]), key=i))
    grad_bytes = [0]

    def on_step(reports: list) -> None:  # noqa: ANN001
        grad_bytes[0] = pm.store.grad.numel() * pm.store.grad.element_size()

    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        timed = timed_steps(pm, jobs, slots, on_step=on_step, cuda_graphs="on" if graph else "off", chunked_ce=True,
                            activation_checkpointing=activation_checkpointing)
    step_s = timed.median(warmup)
    losses = [reports[0].loss for reports in timed.reports]
    tokens = slots * micro * seq
    row = {
        "base_gib": round(base_gib, 2), "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2),
        "step_s": sig(step_s), "tokens_per_s": round(tokens / step_s),
        "mfu": sig(_flops(model, slots * micro, seq) / step_s / 1e12 / peak_tflops, 3),
        "adapter_grad_gib": round(grad_bytes[0] / 2**30, 3), "first_loss": round(losses[0], 4),
        "finite_loss": all(x == x for x in losses),
        "warnings": sorted({str(w.message).splitlines()[0][:160] for w in caught})[:4],
    }
    return check_row(row, f"qlora {slots} slots x {micro} x {seq}", flops_per_token=_flops(model, 1, 1),
                     tflops=peak_tflops)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python benchmarks/qlora_bench.py", description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b")
    p.add_argument("--quantize", choices=["nf4", "none"], default="nf4")
    p.add_argument("--layers", type=int, default=None, help="decoder layers (default: the shape's)")
    p.add_argument("--slots", type=int, default=8)
    p.add_argument("--micro", type=int, default=1)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--activation-checkpointing", action="store_true")
    p.add_argument("--graph", action="store_true", help="replay the training step as a CUDA graph (else eager)")
    a = p.parse_args(argv)
    peak = gemm_tflops()
    start = time.perf_counter()
    model = build(a.shape, None if a.quantize == "none" else a.quantize, a.layers)
    torch.cuda.synchronize()
    build_s = time.perf_counter() - start
    row = {"shape": a.shape, "quantize": a.quantize, "layers": model.config.num_hidden_layers, "slots": a.slots,
           "micro": a.micro, "seq": a.seq, "rank": a.rank, "activation_checkpointing": a.activation_checkpointing,
           "graph": a.graph, "build_s": round(build_s, 1), "gemm_tflops": round(peak)}
    try:
        row |= run(model, slots=a.slots, micro=a.micro, seq=a.seq, rank=a.rank, steps=a.steps, warmup=a.warmup,
                   activation_checkpointing=a.activation_checkpointing, graph=a.graph, peak_tflops=peak)
    except ImplausibleRow:
        raise  # an impossible figure is not a result: no row
    except Exception as err:  # a measurement that fails is a result too (e.g. a capture the NF4 path breaks)
        row |= {"error": f"{type(err).__name__}: {str(err).splitlines()[0][:200] if str(err) else ''}",
                "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2)}
    print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
