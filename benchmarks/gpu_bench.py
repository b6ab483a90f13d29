"""GPU benchmark: packed training vs one-trial-at-a-time PEFT on real architecture shapes.

Random-init models of real shapes (throughput does not depend on weight values), bf16, SDPA
attention, LoRA r=16 on the seven projections. Workloads (the issue's names):

- W5 correctness gate, before any timing: packed Triton vs the PyTorch path, same
  batches, bf16: per-slot losses after a few steps must agree.
- W1 aggregate training tokens/s over all slots, N slots x micro-batch 1, against PEFT at batch 1.
- W4 the packed LoRA's cost over the frozen base at the same tokens: a decoder layer, one projection
  (``benchmarks.gpu_layer``).

MFU counts 4 * N * tokens for the frozen base (forward + backward to activations) plus the attention term ``3 * 4 *
layers * seq^2 * hidden * batch``, against the measured bf16 GEMM rate, as PaLM's MFU counts them (Chowdhery et al.
2022, app. B) less the frozen weights' gradients (``model_flops``). HFU, beside it on every pack, counts the FLOPs
the hardware ran: a checkpointed pack (``+ckpt``) runs every decoder layer's forward twice (``recompute_flops``), so
its MFU cannot reach a plain pack's at the same speed of work; without checkpointing HFU = MFU.
Run: ``python -m lora_sweep.benchmarks.gpu_bench``.
"""

from __future__ import annotations

import argparse
import gc
import json
from collections.abc import Callable

import torch

from lora_sweep.benchmarks.gpu_layer import run_all
from lora_sweep.benchmarks.shapes import PROJ, build_shape
from lora_sweep.benchmarks.timing import (
    check_row,
    counted_params,
    gemm_tflops,
    random_jobs,
    sig,
    step_flops,
    time_calls,
    timed_train,
)
from lora_sweep.packer.model.packed import PackedModel
from lora_sweep.packer.plan import MemoryModel
from lora_sweep.packer.step.train import train

__all__ = ["gemm_tflops", "packed_run", "base_run", "peft_run", "model_flops", "recompute_flops",
           "correctness_gate", "calibration_check", "table"]


def model_flops(model: torch.nn.Module, rows: int, seq: int) -> float:
    """Model FLOPs of one step on ``rows`` rows of ``seq`` tokens: 4 per counted weight and token (the frozen base's
    forward, 2, and its backward to the activations, 2: no weight gradient) plus attention's QK^T and PV, 4 * seq^2 *
    hidden per layer and row forward, three times that with the backward (``timing.step_flops``). The adapters' own
    FLOPs (r / hidden of a projection's) are not counted."""
    return step_flops(model.config, counted_params(model), rows, seq)


def recompute_flops(model: torch.nn.Module, seq: int, row_ranks: list[int]) -> float:
    """FLOPs activation checkpointing adds to a step: one more forward of every decoder layer, base and LoRA (the
    embedding, final norm, head and loss are not recomputed). Per row of ``seq`` tokens whose slot has rank r::

        2 * P_layers * seq               the decoder layers' frozen weights, 2 FLOPs per weight and token
      + 4 * layers * seq^2 * hidden      attention's forward (QK^T and PV): the forward third of model_flops' term
      + 2 * P_adapter(r) * seq           the row's adapter, rank r on every projection: r * (D_in + D_out) each

    Args:
        model: the packed model's base (its projections wrapped or not).
        seq: tokens per row.
        row_ranks: the rank of each row's slot (a slot of micro-batch m has m rows).
    """
    from lora_sweep.packer.model.inject import all_linear_params

    cfg = model.config
    layer_params = sum(p.numel() for n, p in model.named_parameters() if ".layers." in n and "lora_" not in n)
    rows = len(row_ranks)
    adapters = all_linear_params(model, 1) * sum(row_ranks)  # r * (D_in + D_out) per projection: linear in r
    return 2 * layer_params * rows * seq + 4 * cfg.num_hidden_layers * seq * seq * cfg.hidden_size * rows \
        + 2 * adapters * seq


def packed_run(model: torch.nn.Module, slots: int, micro: int, seq: int, *, impl: str = "triton", warmup: int = 3,
               steps: int = 6, peak_tflops: float = 790.0, rank: int | tuple[int, ...] = 16,
               chunked_ce: bool = True, workload: str = "W1", fused: bool = True,
               activation_checkpointing: bool = False) -> dict:
    """Aggregate tokens/s of ``slots`` adapters trained packed (median step of ``steps`` timed) on the step a default
    sweep runs (on CUDA the fixed-shape step replayed as CUDA graphs); ``fused``: the base's norms and MLP middles on
    the fused kernels (``packer.model.fuse``; Triton path only), else eager. Mode ``+ckpt``: activation
    checkpointing."""
    pm = PackedModel(model, impl=impl, fused_base_ops=fused)  # type: ignore[arg-type]
    jobs = random_jobs(slots, micro, seq, model.config.vocab_size, warmup + steps, rank)
    torch.cuda.reset_peak_memory_stats()
    step_s = timed_train(pm, jobs, slots, warmup, chunked_ce=chunked_ce,
                         activation_checkpointing=activation_checkpointing)
    pm.set_activation_checkpointing(False)  # the next run on this model starts without it
    tokens = slots * micro * seq
    flops = model_flops(model, slots * micro, seq)
    ranks = (rank,) if isinstance(rank, int) else rank
    row_ranks = [ranks[i % len(ranks)] for i in range(slots) for _ in range(micro)]  # random_jobs' slot ranks
    hardware = flops + (recompute_flops(model, seq, row_ranks) if activation_checkpointing else 0.0)
    mfu, hfu = (f / step_s / 1e12 / peak_tflops for f in (flops, hardware))
    mode = f"packed-{impl}" + ("" if pm.fused else "-eager") + ("+ckpt" if activation_checkpointing else "")
    return dict(workload=workload, mode=mode, slots=slots, micro=micro,
                seq=seq,
                rank=rank if isinstance(rank, int) else "/".join(map(str, rank)), step_ms=round(step_s * 1e3, 1),
                tok_s=round(tokens / step_s), mfu=sig(mfu, 3), hfu=sig(hfu, 3),
                peak_gib=round(torch.cuda.max_memory_allocated() / 2**30, 1))


def base_run(model: torch.nn.Module, rows: int, seq: int, *, warmup: int = 3, steps: int = 6,
             peak_tflops: float = 790.0) -> dict:
    """U: the frozen base alone (forward, full-vocabulary loss, backward to the activations), same tokens:
    the ceiling a pack approaches. Mode ``base-only-fused`` once a pack has swapped in the fused norms and MLPs."""
    from lora_sweep.packer.model.fuse import FusedRMSNorm

    mode = "base-only-fused" if any(isinstance(m, FusedRMSNorm) and m.impl == "triton" for m in model.modules()) \
        else "base-only"
    model.requires_grad_(False)  # frozen, as a pack holds it: no weight gradients (before any pack has run too)
    ids = torch.randint(0, model.config.vocab_size, (rows, seq), device="cuda")

    def step() -> None:
        emb = model.get_input_embeddings()(ids).detach().requires_grad_()  # frozen weights: grads stop here
        model(inputs_embeds=emb, labels=ids, use_cache=False).loss.backward()

    step_s = time_calls(step, warmup, steps)
    return dict(workload="U", mode=mode, slots=rows, micro=1, seq=seq, step_ms=round(step_s * 1e3, 1),
                tok_s=round(rows * seq / step_s),
                mfu=sig(model_flops(model, rows, seq) / step_s / 1e12 / peak_tflops, 3),
                peak_gib=round(torch.cuda.max_memory_allocated() / 2**30, 1))


def peft_run(name: str, batch: int, seq: int, *, warmup: int = 3, steps: int = 6, peak_tflops: float = 790.0) -> dict:
    """One adapter with transformers + PEFT, as users run it today (performance.md's protocol)."""
    from peft import LoraConfig, get_peft_model

    model = build_shape(name)
    flops = model_flops(model, batch, seq)
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules=list(PROJ), lora_dropout=0.0))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4, fused=True)
    ids = torch.randint(0, model.config.vocab_size, (batch, seq), device="cuda")

    def step() -> None:
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step_s = time_calls(step, warmup, steps)
    return dict(workload="W1", mode="peft", slots=1, micro=batch, seq=seq, step_ms=round(step_s * 1e3, 1),
                tok_s=round(batch * seq / step_s), mfu=sig(flops / step_s / 1e12 / peak_tflops, 3),
                peak_gib=round(torch.cuda.max_memory_allocated() / 2**30, 1))


def correctness_gate(model: torch.nn.Module, slots: int = 4, seq: int = 256, steps: int = 3) -> dict:
    """W5: per-slot losses and final adapter weights of packed Triton vs the PyTorch path, bf16."""
    losses: dict[str, list[float]] = {}
    weights: dict[str, torch.Tensor] = {}
    for impl in ("torch", "triton"):
        pm = PackedModel(model, impl=impl)  # type: ignore[arg-type]
        jobs = random_jobs(slots, 2, seq, model.config.vocab_size, steps, rank=(8, 16, 32, 1))
        got: list[float] = []

        def keep(ends: list, impl: str = impl) -> None:  # the slots' weights after their last step
            weights[impl] = torch.cat([torch.cat([a.flatten(), b.flatten()]) for e in ends
                                       for a, b in pm.slot_weights(e.slot).values()]).float()  # noqa: B023

        train(pm, slots, lambda s: jobs.pop(0) if jobs else None, pad_id=0,  # noqa: B023
              on_step=lambda reps: got.extend(r.loss for r in reps), on_end=keep)  # noqa: B023
        losses[impl] = got
    rel = max(abs(a - b) / abs(a) for a, b in zip(losses["torch"], losses["triton"], strict=True))
    w_rel = ((weights["torch"] - weights["triton"]).norm() / weights["torch"].norm()).item()
    return dict(workload="W5", slots=slots, steps=steps, max_rel_loss_diff=rel, rel_weight_diff=w_rel,
                ok=rel < 2e-2 and w_rel < 2e-2)


def _planner_model(model: torch.nn.Module, seq: int) -> tuple[MemoryModel, int]:
    """The planner's memory model, calibrated on this GPU by small probes with the options the measured
    packs run with, and the parameters of one r=16 adapter on every projection."""
    from lora_sweep.packer.model.inject import all_linear_params
    from lora_sweep.packer.probe import calibrate

    pm = PackedModel(model, impl="triton")
    return calibrate(pm, seq, rows=(2, 8), chunked_ce=True), all_linear_params(pm.model, 16)


def _versus(mm: MemoryModel, params: int, slots: int, seq: int, measured_gib: float) -> dict:
    """The model's prediction for an r=16 pack of ``slots`` x 1 x ``seq`` beside its measured peak."""
    predicted = mm.predict(slots * seq, slots * params, slots * 16, 16) / 2**30
    return dict(slots=slots, seq=seq, predicted_gib=round(predicted, 1), measured_gib=measured_gib,
                error=round(predicted / measured_gib - 1, 3))


def calibration_check(model: torch.nn.Module, slots: int, seq: int, measured_gib: float) -> dict:
    """The planner's memory model, calibrated on this GPU by small probes, against a measured pack's peak."""
    return dict(workload="calibration", **_versus(*_planner_model(model, seq), slots, seq, measured_gib))


def memory_curve(model: torch.nn.Module, seq: int, slots: tuple[int, ...] = (2, 8, 16, 24)) -> list[dict]:
    """The fitted memory model's slopes beside the measured peaks of r=16 packs of ``slots`` x 1 x ``seq``."""
    mm, params = _planner_model(model, seq)
    rows = [dict(workload="memory-fit", per_token_mb=round(mm.bytes_per_token / 1e6, 3),
                 per_token_rank_b=round(mm.bytes_per_token_rank), per_param_b=round(mm.bytes_per_param, 1),
                 ce_chunk_gb=round(mm.ce_chunk_bytes / 1e9, 2), base_gb=round(mm.base_bytes / 1e9, 2))]
    for n in slots:
        peak = packed_run(model, n, 1, seq, warmup=2, steps=2)["peak_gib"]
        rows.append(dict(workload="memory", tokens=n * seq, **_versus(mm, params, n, seq, peak)))
        _free()
    return rows


def _free() -> None:
    gc.collect()
    torch.cuda.empty_cache()


def _small(peak: float, emit: Callable[[dict], None], out_dir: str | None) -> None:
    """Qwen2.5-0.5B shape: W5, W1 (slots 1..32) and PEFT, U, W4, the profile, W2, the memory model, then the
    PyTorch path (most important first: a run cut short still has the headline)."""
    model = build_shape("qwen2.5-0.5b")
    gate = correctness_gate(model)
    emit(gate)
    if not gate["ok"]:
        raise SystemExit("W5 correctness gate failed: no timing")
    runs = {}
    for slots in (1, 2, 4, 8, 16, 32):
        runs[slots] = dict(shape="qwen2.5-0.5b", **packed_run(model, slots, 1, 512, peak_tflops=peak))
        emit(runs[slots])
        _free()
    emit(dict(shape="qwen2.5-0.5b", **peft_run("qwen2.5-0.5b", 1, 512, peak_tflops=peak)))
    _free()
    emit(dict(shape="qwen2.5-0.5b", **base_run(model, 32, 512, peak_tflops=peak)))
    _free()
    run_all(emit)
    _free()
    from lora_sweep.benchmarks.gpu_profile import profile_step

    emit(profile_step(model, 32, 512, out_dir))
    _free()
    mixed = (8, 16, 32, 64, 128)
    emit(dict(shape="qwen2.5-0.5b", **packed_run(model, 32, 1, 512, rank=mixed, peak_tflops=peak, workload="W2")))
    _free()
    mean_rank = round(sum(mixed[i % 5] for i in range(32)) / 32)
    emit(dict(shape="qwen2.5-0.5b", **packed_run(model, 32, 1, 512, rank=mean_rank, peak_tflops=peak,
                                                 workload="W2")))
    _free()
    emit(calibration_check(model, 16, 512, runs[16]["peak_gib"]))
    _free()
    emit(dict(shape="qwen2.5-0.5b", **packed_run(model, 32, 1, 512, impl="torch", peak_tflops=peak)))


LARGE = (("qwen2.5-7b", 512, (16,)), ("llama3-8b", 1024, (8, 12, 16)))
"""Shape, sequence length, pack sizes of ``--part large``."""


def _large(peak: float, emit: Callable[[dict], None], shapes: tuple[str, ...] = ()) -> None:
    """Qwen2.5-7B (16 slots x 1 x 512) and Llama-3-8B (seq 1024) packs, their base-only ceilings, PEFT.

    Per shape: the eager base alone, the next-to-largest pack (the only one, for one size) on the eager base, the
    packs on the fused base (a pack that runs out of memory is a row saying so), the next-to-largest again with
    activation checkpointing, the fused base alone, then PEFT in a fresh model."""
    for name, seq, packs in LARGE:
        if shapes and name not in shapes:
            continue
        model = build_shape(name)
        base_rows = min(packs[-1], 8)
        emit(dict(shape=name, **base_run(model, base_rows, seq, peak_tflops=peak)))
        _free()
        headline = packs[-2] if len(packs) > 1 else packs[-1]
        runs = [(headline, False, False)] + [(n, True, False) for n in packs] + [(headline, True, True)]
        for slots, fused, ckpt in runs:
            try:
                emit(dict(shape=name, **packed_run(model, slots, 1, seq, peak_tflops=peak, warmup=3, steps=5,
                                                   fused=fused, activation_checkpointing=ckpt)))
            except torch.cuda.OutOfMemoryError:
                emit(dict(shape=name, workload="W1", mode="packed-triton" + ("" if fused else "-eager")
                          + ("+ckpt" if ckpt else ""), slots=slots, seq=seq, error="out of memory"))
            _free()
        emit(dict(shape=name, **base_run(model, base_rows, seq, peak_tflops=peak)))
        del model
        _free()
        emit(dict(shape=name, **peft_run(name, 1, seq, peak_tflops=peak)))
        _free()


def table(rows: list[dict]) -> str:
    """The results as a short fixed-width table (one line per measurement; the JSON lines hold everything)."""
    peft = {r["shape"]: r["tok_s"] for r in rows if r.get("mode") == "peft"}  # one adapter, batch 1, same run
    lines = [f"{'workload':<12}{'shape':<14}{'mode':<20}{'slots':>6}{'step ms':>9}{'tok/s':>9}{'MFU':>7}{'HFU':>7}"
             f"{'GiB':>7}{'x PEFT':>8}  other"]
    for r in rows:
        if "workload" not in r:
            continue
        vs = f"{r['tok_s'] / peft[r['shape']]:.1f}" if r.get("workload") in ("W1", "W2") and "tok_s" in r \
            and r.get("shape") in peft else ""  # (a row that ran out of memory has no tok_s)
        other = {k: v for k, v in r.items() if k in ("scope", "ratio", "max_rel_loss_diff",
                                                     "error", "makespan_s",
                                                     "ratio_vs_packed", "ratio_vs_packed_warm", "rank",
                                                     "predicted_gib", "measured_gib",
                                                     "load_s", "first_step_s", "later_steps_s", "save_s")}
        mfu, hfu = (f"{r[k]:.1%}" if k in r else "" for k in ("mfu", "hfu"))
        lines.append(f"{r['workload']:<12}{r.get('shape', ''):<14}{r.get('mode', ''):<20}{r.get('slots', ''):>6}"
                     f"{r.get('step_ms', ''):>9}{r.get('tok_s', ''):>9}{mfu:>7}{hfu:>7}"
                     f"{r.get('peak_gib', ''):>7}{vs:>8}  {json.dumps(other) if other else ''}")
    return "\n".join(lines)


def main(argv: list[str] | None = None, emit: Callable[[dict], None] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(prog="python -m lora_sweep.benchmarks.gpu_bench", description=__doc__)
    parser.add_argument("--part", choices=("small", "large", "makespan", "memory", "layer", "all"), default="all",
                        help="small: the 0.5B shape (W1, W2, W4, W5, U, profile, memory model); large: the 7B and 8B "
                             "shapes; makespan: W3 (benchmarks.gpu_makespan, sequential PEFT sampled 8 of 24 by cell); "
                             "memory: the memory model's fit beside measured 0.5B pack peaks (not in all); "
                             "layer: W4 alone (in small)")
    parser.add_argument("--out", default=None, help="folder for the profile tables")
    parser.add_argument("--shapes", default="", help="--part large: only these shapes (comma-separated names of "
                        f"{', '.join(n for n, _, _ in LARGE)})")
    args = parser.parse_args(argv)
    shapes = tuple(filter(None, args.shapes.split(",")))
    unknown = set(shapes) - {n for n, _, _ in LARGE}
    if unknown:
        parser.error(f"--shapes: unknown {', '.join(sorted(unknown))}")
    results: list[dict] = []
    printer = emit or (lambda r: print(json.dumps(r), flush=True))

    def keep(r: dict) -> None:
        check_row(r, f"{r.get('workload')} {r.get('shape', '')} {r.get('mode', '')} {r.get('slots', '')}")
        results.append(r)
        printer(r)

    import peft
    import transformers
    import triton

    peak = gemm_tflops()
    keep(dict(gpu=torch.cuda.get_device_name(), gemm_tflops=round(peak), torch=torch.__version__,
              cuda=torch.version.cuda, triton=triton.__version__, transformers=transformers.__version__,
              peft=peft.__version__))
    if args.part in ("small", "all"):
        _small(peak, keep, args.out)
    if args.part in ("large", "all"):
        _large(peak, keep, shapes)
    if args.part == "layer":
        run_all(keep)
    if args.part == "memory":
        for row in memory_curve(build_shape("qwen2.5-0.5b"), 512):
            keep(row)
    if args.part in ("makespan", "all"):
        from lora_sweep.benchmarks.gpu_makespan import makespan

        makespan("qwen2.5-0.5b", sequential_sample=8, emit=keep)
    print(table(results), flush=True)
    return results


if __name__ == "__main__":
    main()
