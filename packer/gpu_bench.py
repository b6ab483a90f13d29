"""GPU benchmark: packed training vs one-trial-at-a-time PEFT on real architecture shapes.

Random-init models of real shapes (throughput does not depend on weight values), bf16, SDPA
attention, LoRA r=16 on the seven projections. Workloads (the issue's names):

- W5 correctness gate, before any timing: packed Triton vs the masked-dense reference, same
  batches, bf16: per-slot losses after a few steps must agree.
- W1 aggregate training tokens/s over all slots, N slots x micro-batch 1, against PEFT at batch 1.
- W4 one packed-LoRA projection forward+backward against the base projection alone.

MFU counts 4 * N * tokens for the frozen base (forward + backward to activations) plus the
attention term ``3 * 4 * layers * seq^2 * hidden * batch``, against the measured bf16 GEMM rate,
as ../shared/notes/performance.md does. Run: ``python -m packer.gpu_bench``.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from collections.abc import Callable

import torch

from packer.data import Example
from packer.model import PackedModel
from packer.plan import AdapterSpec
from packer.train import SlotJob, StepReport, train

__all__ = ["SHAPES", "gemm_tflops", "packed_run", "peft_run", "layer_bench", "correctness_gate"]

PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
SHAPES: dict[str, dict] = {
    "qwen2.5-0.5b": dict(model_type="qwen2", hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "qwen2.5-7b": dict(model_type="qwen2", hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                       num_attention_heads=28, num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False),
    "llama3-8b": dict(model_type="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False),
}


def _model(name: str) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    kw = dict(SHAPES[name])
    cfg = AutoConfig.for_model(kw.pop("model_type"), **kw)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device("cuda"):
        return AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)


def _counted_params(model: torch.nn.Module) -> int:
    """Parameters the 4N rule counts: all but the input embedding, the output head included."""
    cfg = model.config
    n = sum(p.numel() for n, p in model.named_parameters() if "embed_tokens" not in n and "lora_" not in n)
    return n + (cfg.vocab_size * cfg.hidden_size if cfg.tie_word_embeddings else 0)


def _flops(model: torch.nn.Module, rows: int, seq: int) -> float:
    cfg = model.config
    return 4 * _counted_params(model) * rows * seq + 3 * 4 * cfg.num_hidden_layers * seq * seq * cfg.hidden_size * rows


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


class _Fixed:
    def __init__(self, rows: list[Example]) -> None:
        self.rows = rows

    def next_batch(self) -> list[Example]:
        return self.rows


def _jobs(slots: int, micro: int, seq: int, vocab: int, steps: int, rank: int = 16) -> list[SlotJob]:
    gen = torch.Generator().manual_seed(0)
    jobs = []
    for i in range(slots):
        ids = torch.randint(0, vocab, (micro, seq), generator=gen).tolist()
        spec = AdapterSpec(rank=rank, alpha=2 * rank, targets=PROJ, micro_batch=micro, max_steps=steps, seed=i,
                           lr=1e-4)
        jobs.append(SlotJob(spec, _Fixed([Example(tuple(r), tuple(r)) for r in ids]), key=i))
    return jobs


def packed_run(model: torch.nn.Module, slots: int, micro: int, seq: int, *, impl: str = "triton", warmup: int = 2,
               steps: int = 5, peak_tflops: float = 790.0) -> dict:
    """Aggregate tokens/s of ``slots`` adapters trained packed (median step of ``steps`` timed)."""
    pm = PackedModel(model, impl=impl)  # type: ignore[arg-type]
    jobs = _jobs(slots, micro, seq, model.config.vocab_size, warmup + steps)
    stamps: list[float] = []

    def on_step(reports: list[StepReport]) -> None:
        stamps.append(time.perf_counter())  # reports come after a host sync on the losses: the step is done

    torch.cuda.reset_peak_memory_stats()
    train(pm, slots, lambda s: jobs.pop(0) if jobs else None, pad_id=0, on_step=on_step)
    step_s = statistics.median(b - a for a, b in zip(stamps[warmup - 1:], stamps[warmup:], strict=False))
    tokens = slots * micro * seq
    mfu = _flops(model, slots * micro, seq) / step_s / 1e12 / peak_tflops
    return dict(workload="W1", mode=f"packed-{impl}", slots=slots, micro=micro, seq=seq, step_ms=round(step_s * 1e3, 1),
                tok_s=round(tokens / step_s), mfu=round(mfu, 3),
                peak_gib=round(torch.cuda.max_memory_allocated() / 2**30, 1))


def peft_run(name: str, batch: int, seq: int, *, warmup: int = 3, steps: int = 6, peak_tflops: float = 790.0) -> dict:
    """One adapter with transformers + PEFT, as users run it today (performance.md's protocol)."""
    from peft import LoraConfig, get_peft_model

    model = _model(name)
    flops = _flops(model, batch, seq)
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules=list(PROJ), lora_dropout=0.0))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4, fused=True)
    ids = torch.randint(0, model.config.vocab_size, (batch, seq), device="cuda")

    def step() -> None:
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    torch.cuda.reset_peak_memory_stats()
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    step_s = (time.perf_counter() - t0) / steps
    return dict(workload="W1", mode="peft", slots=1, micro=batch, seq=seq, step_ms=round(step_s * 1e3, 1),
                tok_s=round(batch * seq / step_s), mfu=round(flops / step_s / 1e12 / peak_tflops, 3),
                peak_gib=round(torch.cuda.max_memory_allocated() / 2**30, 1))


def correctness_gate(model: torch.nn.Module, slots: int = 4, seq: int = 256, steps: int = 3) -> dict:
    """W5: per-slot losses of packed Triton vs the masked-dense reference over the same steps, bf16."""
    losses: dict[str, list[float]] = {}
    for impl in ("torch", "triton"):
        pm = PackedModel(model, impl=impl)  # type: ignore[arg-type]
        jobs = _jobs(slots, 2, seq, model.config.vocab_size, steps, rank=8)
        got: list[float] = []
        train(pm, slots, lambda s: jobs.pop(0) if jobs else None, pad_id=0,  # noqa: B023
              on_step=lambda reps: got.extend(r.loss for r in reps))  # noqa: B023
        losses[impl] = got
    rel = max(abs(a - b) / abs(a) for a, b in zip(losses["torch"], losses["triton"], strict=True))
    return dict(workload="W5", slots=slots, steps=steps, max_rel_loss_diff=rel, ok=rel < 2e-2)


def layer_bench(d_in: int = 4096, d_out: int = 4096, tokens: int = 16384, slots: int = 8, rank: int = 16) -> dict:
    """W4: one projection forward+backward, packed LoRA (Triton) vs base only, same tokens."""
    import triton.testing

    from kernels import LayerRanks, PackLayout, packed_lora

    w = torch.randn(d_out, d_in, device="cuda", dtype=torch.bfloat16) / d_in**0.5
    x = torch.randn(slots, tokens // slots, d_in, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    a = (torch.randn(slots * rank, d_in, device="cuda") / d_in**0.5).requires_grad_()
    bt = (torch.randn(slots * rank, d_out, device="cuda") * 0.01).requires_grad_()
    layout = PackLayout(tuple(range(slots)), tuple(range(slots)), (1,) * slots, (tokens // slots,) * slots,
                        (0.0,) * slots, (0,) * slots)
    ranks = LayerRanks((rank,) * slots, (2.0,) * slots, 0)
    dy = torch.randn(slots, tokens // slots, d_out, device="cuda", dtype=torch.bfloat16)

    def base() -> None:
        torch.autograd.backward(x @ w.T, dy)

    def packed() -> None:
        torch.autograd.backward(packed_lora(x, x @ w.T, a, bt, layout, ranks, impl="triton"), dy)

    t_base = triton.testing.do_bench(base, warmup=50, rep=300, return_mode="median")
    t_packed = triton.testing.do_bench(packed, warmup=50, rep=300, return_mode="median")
    return dict(workload="W4", shape=f"{d_in}->{d_out}", tokens=tokens, slots=slots, rank=rank,
                base_ms=round(t_base, 3), packed_ms=round(t_packed, 3), ratio=round(t_packed / t_base, 3))


def _free() -> None:
    gc.collect()
    torch.cuda.empty_cache()


def main(argv: list[str] | None = None, emit: Callable[[dict], None] | None = None) -> list[dict]:
    argparse.ArgumentParser(prog="python -m packer.gpu_bench", description=__doc__).parse_args(argv)
    emit = emit or (lambda r: print(json.dumps(r), flush=True))
    import peft
    import transformers
    import triton

    peak = gemm_tflops()
    results = [dict(gpu=torch.cuda.get_device_name(), gemm_tflops=round(peak), torch=torch.__version__,
                    triton=triton.__version__, transformers=transformers.__version__, peft=peft.__version__)]
    emit(results[-1])
    model = _model("qwen2.5-0.5b")
    results.append(correctness_gate(model))
    emit(results[-1])
    if not results[-1]["ok"]:
        raise SystemExit("W5 correctness gate failed: no timing")
    for slots in (1, 8, 32):
        for impl in ("triton", "torch") if slots == 32 else ("triton",):
            results.append(dict(shape="qwen2.5-0.5b", **packed_run(model, slots, 1, 512, impl=impl, peak_tflops=peak)))
            emit(results[-1])
            _free()
    del model
    _free()
    results.append(dict(shape="qwen2.5-0.5b", **peft_run("qwen2.5-0.5b", 1, 512, peak_tflops=peak)))
    emit(results[-1])
    _free()
    for d_in, d_out in ((4096, 4096), (4096, 14336), (14336, 4096)):
        results.append(layer_bench(d_in, d_out))
        emit(results[-1])
    return results


if __name__ == "__main__":
    main()
