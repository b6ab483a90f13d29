"""Benchmark: the fixed-shape packed step replayed as a CUDA graph, against PEFT eager and graph-captured.

``python -m lora_sweep.benchmarks.gpu_graph`` (H200; a command, not a test). Random-init models of real shapes, bf16,
SDPA:

- SmolLM2-135M shape (30 layers, hidden 576, intermediate 1536, 9 / 3 heads, vocab 49,152, tied), 16 slots x 8
  rows x 48 tokens, ranks 8/16/32 cycled on the seven projections, dropout 0.05 on every other slot (as
  ``benchmarks.gpu_host`` draws a sweep's slots): the loop's step time against its GPU kernel time (target <= 3x),
  tokens/s, and the per-trial-step ratio against PEFT at batch 8 (r=16, fused AdamW, clipping), eager and
  replayed as a CUDA graph (target >= 10x the graph). The row "r16" packs 16 copies of PEFT's own adapter (r=16,
  no dropout): the like-for-like ratio; "mixed vs mix" sets the mixed pack against the graphed PEFT steps of
  its own sixteen adapters (ranks 8/16/32, dropout 0 / 0.05) run one by one, averaged.
- Qwen2.5-0.5B shape, 32 slots x 1 x 512 and 1 slot x 1 x 512, r=16, against PEFT at batch 1 (targets >= 20x
  and >= 0.9x).

Step time is the training loop's own, timed by ``timing.timed_steps``: wall clock per step with the loss ring read
back and the device synchronised after every step (the loop's default reads back every 8 steps), host staging
included, averaged over the steady state from step 16 (compile, warm-up and capture, counted apart, are behind).
"graph ms" is the captured step replayed back to back (CUDA events), late in the run and outside the timed steps:
the GPU's own time per step.
"kernels ms" sums the kernels of those replays (torch.profiler), whose breakdown is printed. The table comes
last.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import statistics
import time
from collections.abc import Callable

import torch

from lora_sweep.benchmarks import gpu_profile
from lora_sweep.benchmarks.shapes import PROJ, SHAPES, SMOLLM2
from lora_sweep.benchmarks.timing import (
    check_row,
    counted_params,
    gemm_tflops,
    random_jobs,
    step_flops,
    time_calls,
    timed_steps,
)
from lora_sweep.packer.model.packed import PackedModel
from lora_sweep.packer.step import loop
from lora_sweep.packer.step.capture import capture
from lora_sweep.packer.step.train import SlotJob, train

__all__ = ["SMOLLM2", "main"]



def build(shape: dict, device: str = "cuda") -> torch.nn.Module:
    """A random-init (seed 0) bf16 causal LM of ``shape`` (a config dict with ``model_type``), SDPA attention."""
    from transformers import AutoConfig, AutoModelForCausalLM

    kw = dict(shape)
    cfg = AutoConfig.for_model(kw.pop("model_type"), **kw)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device(device):
        return AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)


def _jobs(model: torch.nn.Module, slots: int, micro: int, seq: int, steps: int, ranks: tuple[int, ...],
          dropout_every: int) -> list[SlotJob]:
    jobs = random_jobs(slots, micro, seq, model.config.vocab_size, steps, ranks)
    for i, job in enumerate(jobs):
        if dropout_every and i % dropout_every:
            job.spec = dataclasses.replace(job.spec, dropout=0.05)
    return jobs


@dataclasses.dataclass
class _Timing(loop.Graphs):
    """The loop's graph runner (``train``'s ``graphs``), which also times back-to-back replays of its graph once,
    mid-run."""

    at_call: int = 10
    replays: int = 20
    calls: int = 0
    replay_ms: float | None = None
    kernel_ms: float | None = None
    breakdown: str = ""

    def run(self, key: tuple, step: Callable[[], None], shape: object, scratch_row: int) -> None:
        super().run(key, step, shape, scratch_row)  # type: ignore[arg-type]
        self.calls += 1
        graph = self.graphs.get(key)
        if graph is not None and self.calls == self.at_call:  # extra real steps on the same batch: a benchmark
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(self.replays):
                graph.replay()
            end.record()
            torch.cuda.synchronize()
            self.replay_ms = start.elapsed_time(end) / self.replays
            self.kernel_ms, self.breakdown = _replay_profile(graph, self.replay_ms)


def _replay_profile(graph: torch.cuda.CUDAGraph, replay_ms: float, n: int = 5) -> tuple[float | None, str]:
    """Kernel ms per replay of ``graph`` (torch.profiler sees the kernels a graph launches) and the breakdown;
    None where the profiler reports none."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA], acc_events=True) as prof:
        for _ in range(n):
            graph.replay()
        torch.cuda.synchronize()
    kernel_us = sum(e.self_device_time_total for e in gpu_profile.kernel_events(prof.key_averages()))
    if not kernel_us:
        return None, ""
    return kernel_us / n / 1e3, gpu_profile.breakdown(prof, n, replay_ms, "graph replay", top=20)


STEADY = 16
"""Steps ``packed`` leaves out of its step time: compile, warm-up and capture are behind by then."""


def packed(model: torch.nn.Module, slots: int, micro: int, seq: int, ranks: tuple[int, ...], dropout_every: int,
           *, steps: int = 48, cuda_graphs: str = "auto", tflops: float | None = None) -> dict:
    """One fixed-shape pack of ``slots`` jobs of ``steps`` steps; steady-state loop step time and more, checked
    (``check_row``; against the GEMM rate ``tflops`` where given)."""
    # the back-to-back replays and their profile run late, in the step of the graph's call at_call: that step and
    # the ones after it are left out of the step time (a profiler session must not overlap the loop's own steps)
    runner = _Timing(enabled=cuda_graphs != "off", at_call=steps - 4)
    replayed_in: list[int] = []  # the step whose graph call ran the extra replays

    def note(reports: list) -> None:  # noqa: ANN001
        if runner.replay_ms is not None and not replayed_in:
            replayed_in.append(reports[0].step)

    per_token = step_flops(model.config, counted_params(model), 1, 1)  # before the pack wraps the projections
    jobs = _jobs(model, slots, micro, seq, steps, ranks, dropout_every)
    timed = timed_steps(PackedModel(model, impl="triton"), jobs, slots, on_step=note, graphs=runner)
    steady = timed.seconds[STEADY:replayed_in[0] if replayed_in else None]
    step_ms = statistics.mean(steady) * 1e3
    n = loop.DEFAULT_READBACK
    windows = [round(statistics.mean(steady[i:i + n]) * 1e3, 2) for i in range(0, len(steady), n)]
    result = timed.result
    row = dict(slots=slots, micro=micro, seq=seq, step_ms=step_ms, graph_ms=runner.replay_ms,
               graph_kernel_ms=runner.kernel_ms, breakdown=runner.breakdown,
               tok_s=slots * micro * seq / step_ms * 1e3, warmup_s=result.warmup_s, capture_s=result.capture_s,
               graphs=result.graphs, windows_ms=windows)
    return check_row(row, f"packed {slots}x{micro}x{seq}", flops_per_token=per_token, tflops=tflops)


def kernel_profile(model: torch.nn.Module, slots: int, micro: int, seq: int, ranks: tuple[int, ...],
                   dropout_every: int, steps: int = 6) -> tuple[float, str]:
    """Kernel ms per step of the same pack's step run eagerly (the kernels a graph replays), and the breakdown."""
    from torch.profiler import ProfilerActivity, profile

    pm = PackedModel(model, impl="triton")
    warm = _jobs(model, slots, micro, seq, 2, ranks, dropout_every)
    train(pm, slots, lambda s: warm.pop(0) if warm else None, pad_id=0, cuda_graphs="off")
    jobs = _jobs(model, slots, micro, seq, steps, ranks, dropout_every)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], acc_events=True) as prof:
        train(pm, slots, lambda s: jobs.pop(0) if jobs else None, pad_id=0, cuda_graphs="off", profiler=prof)
        torch.cuda.synchronize()
    wall_ms = (time.perf_counter() - t0) / steps * 1e3
    kernels = gpu_profile.kernel_events(prof.key_averages())
    kernel_ms = sum(e.self_device_time_total for e in kernels) / steps / 1e3
    return kernel_ms, gpu_profile.breakdown(prof, steps, wall_ms, f"eager step {slots}x{micro}x{seq}")


def peft(shape: dict, batch: int, seq: int, *, steps: int = 10, rank: int = 16, dropout: float = 0.0,
         eager: bool = True) -> dict:
    """One PEFT adapter (r=``rank`` on the seven projections, fused capturable AdamW, clipping to 1.0): mean step
    eager (NaN without ``eager``), and the same step captured as a CUDA graph and replayed."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(build(shape), LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=list(PROJ),
                                                    lora_dropout=dropout))
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4, fused=True, capturable=True)
    ids = torch.randint(0, model.config.vocab_size, (batch, seq), device="cuda")

    def step() -> None:
        model(input_ids=ids, labels=ids).loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
        opt.step()

    def eager() -> None:
        step()
        opt.zero_grad(set_to_none=True)

    eager_ms = time_calls(eager, 3, steps) * 1e3 if eager else float("nan")
    graph = capture(step, warmups=3, warmup=eager).graph  # gradients allocated in the graph: rewritten each replay
    graph_ms = time_calls(graph.replay, 3, steps) * 1e3
    return dict(batch=batch, seq=seq, eager_ms=eager_ms, graph_ms=graph_ms)


def peft_mix(shape: dict, batch: int, seq: int, slots: int, ranks: tuple[int, ...], dropout_every: int) -> dict:
    """The graphed PEFT step of each slot's own adapter in a ``packed(..., ranks, dropout_every)`` pack (ranks
    cycled, dropout 0.05 where ``_jobs`` puts it), averaged over the slots: the same trials run one by one."""
    configs = [(ranks[i % len(ranks)], 0.05 if dropout_every and i % dropout_every else 0.0) for i in range(slots)]
    ms = {c: peft(shape, batch, seq, rank=c[0], dropout=c[1], eager=False)["graph_ms"] for c in sorted(set(configs))}
    _free()
    return dict(batch=batch, seq=seq, eager_ms=float("nan"), graph_ms=sum(ms[c] for c in configs) / slots,
                per_config={f"r{r} p{p}": round(v, 2) for (r, p), v in ms.items()})


TILE_VARIANTS = ((8, 128), (2, 128), (2, 64), (1, 64), (1, 128))
"""(words of 32 columns per keep-bits program, weight-gradient feature tile) pairs ``--tile-variants`` times."""


def tile_variants(variants: tuple[tuple[int, int], ...] = TILE_VARIANTS) -> list[str]:
    """The SmolLM2 pack's step under each (keep-bits words per program, weight-gradient tile) pair: how wide the
    grids of the two kernels whose grids the small pack leaves narrowest should be. Lines of a small table."""
    import lora_sweep.kernels.triton_dropout as drop
    import lora_sweep.kernels.triton_segments as seg

    smol = build(SMOLLM2)
    lines = [f"{'keep words':>10}{'wgrad BN':>9}{'step ms':>9}{'graph ms':>9}{'kern ms':>9}  heaviest LoRA kernels"]
    defaults = drop.KEEP_WORDS_PER_PROGRAM, seg.WGRAD_BLOCK_N
    try:
        for words, bn in variants:
            drop.KEEP_WORDS_PER_PROGRAM, seg.WGRAD_BLOCK_N = words, bn
            p = packed(smol, 16, 8, 48, (8, 16, 32), 2, steps=32)
            lora = [ln.strip() for ln in p["breakdown"].splitlines() if "[lora]" in ln]
            lines.append(f"{words:>10}{bn:>9}{p['step_ms']:9.2f}{p['graph_ms'] or float('nan'):9.2f}"
                         f"{p['graph_kernel_ms'] or float('nan'):9.2f}  {'; '.join(lora)}")
            print(lines[-1], flush=True)
    finally:
        drop.KEEP_WORDS_PER_PROGRAM, seg.WGRAD_BLOCK_N = defaults
    del smol
    _free()
    return lines


def _free() -> None:
    gc.collect()
    torch.cuda.empty_cache()


def _row(name: str, p: dict, kernel_ms: float | None, ref: dict, target: float) -> dict:
    """Ratios per trial-step: PEFT ms / (pack ms / slots), which at one row per slot and PEFT batch 1 is also the
    aggregate tokens/s ratio."""
    vs_eager = ref["eager_ms"] / (p["step_ms"] / p["slots"])
    vs_graph = ref["graph_ms"] / (p["step_ms"] / p["slots"])
    return dict(name=name, **p, kernel_ms=kernel_ms, peft_eager_ms=ref["eager_ms"], peft_graph_ms=ref["graph_ms"],
                vs_peft_eager=vs_eager, vs_peft_graph=vs_graph, target=target)


def table(rows: list[dict]) -> str:
    head = (f"{'workload':<22}{'step ms':>9}{'graph ms':>9}{'kern ms':>9}{'step/k':>7}{'tok/s':>10}{'warm s':>7}"
            f"{'capt s':>7}{'PEFT e':>8}{'PEFT g':>8}{'x eager':>8}{'x graph':>8}")
    lines = [head]
    for r in rows:
        k = r["kernel_ms"]
        lines.append(f"{r['name']:<22}{r['step_ms']:9.2f}{r['graph_ms'] or float('nan'):9.2f}"
                     f"{k if k else float('nan'):9.2f}{r['step_ms'] / k if k else float('nan'):7.2f}{r['tok_s']:10.0f}"
                     f"{r['warmup_s']:7.1f}{r['capture_s']:7.2f}{r['peft_eager_ms']:8.1f}{r['peft_graph_ms']:8.1f}"
                     f"{r['vs_peft_eager']:8.2f}{r['vs_peft_graph']:8.2f}")
    return "\n".join(lines)


def _smollm2(rows: list[dict], notes: list[str], tflops: float) -> None:
    smol = build(SMOLLM2)
    # like for like: every slot PEFT's own adapter (r=16 on the seven projections, no dropout)
    same = packed(smol, 16, 8, 48, (16,), 0, tflops=tflops)
    print("smollm2 packed r16", {k: v for k, v in same.items() if k != "breakdown"}, flush=True)
    p = packed(smol, 16, 8, 48, (8, 16, 32), 2, tflops=tflops)
    print("smollm2 packed", {k: v for k, v in p.items() if k != "breakdown"}, flush=True)
    kernel_ms, breakdown = p["graph_kernel_ms"], p["breakdown"]
    if kernel_ms is None:  # the profiler saw no graph kernels: the same step run eagerly
        kernel_ms, breakdown = kernel_profile(smol, 16, 8, 48, (8, 16, 32), 2)
    del smol
    _free()
    ref = peft(SMOLLM2, 8, 48)
    _free()
    print("smollm2 peft b8", ref, flush=True)
    rows.append(_row("smollm2 16x8x48", p, kernel_ms, ref, target=10.0))
    if p["step_ms"] > 3 * kernel_ms or rows[-1]["vs_peft_graph"] < 10:
        notes.append(f"smollm2: step {p['step_ms']:.1f} ms = {p['step_ms'] / kernel_ms:.2f}x kernels (target 3x), "
                     f"{rows[-1]['vs_peft_graph']:.2f}x graphed PEFT per trial-step (target 10x)")
    notes.append(f"where the smollm2 step's GPU time goes:\n{breakdown}")
    mix = peft_mix(SMOLLM2, 8, 48, 16, (8, 16, 32), 2)
    print("smollm2 peft b8, the pack's own mix of adapters", mix, flush=True)
    rows.append(_row("smollm2 mixed vs mix", p, kernel_ms, mix, target=10.0))
    rows.append(_row("smollm2 16x8x48 r16", same, same["graph_kernel_ms"], ref, target=10.0))
    notes.append(f"where the smollm2 r16 step's GPU time goes:\n{same['breakdown']}")


def _qwen(rows: list[dict], notes: list[str], tflops: float) -> None:
    shape = dict(SHAPES["qwen2.5-0.5b"])
    qwen = build(shape)
    p32 = packed(qwen, 32, 1, 512, (16,), 0, steps=32, tflops=tflops)
    print("qwen packed 32", {k: v for k, v in p32.items() if k != "breakdown"}, flush=True)
    p1 = packed(qwen, 1, 1, 512, (16,), 0, steps=40, tflops=tflops)
    print("qwen packed 1", {k: v for k, v in p1.items() if k != "breakdown"}, flush=True)
    del qwen
    _free()
    ref = peft(shape, 1, 512)
    _free()
    print("qwen peft b1", ref, flush=True)
    for name, p, target in (("qwen0.5b 32x1x512", p32, 20.0), ("qwen0.5b 1x1x512", p1, 0.9)):
        rows.append(_row(name, p, p["graph_kernel_ms"], ref, target=target))
        if rows[-1]["vs_peft_eager"] < target:
            notes.append(f"{name}: {rows[-1]['vs_peft_eager']:.2f}x PEFT b1 (target {target}x)\n{p['breakdown']}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m lora_sweep.benchmarks.gpu_graph", description=__doc__)
    parser.add_argument("--skip-qwen", action="store_true", help="only the SmolLM2-135M shape")
    parser.add_argument("--only-qwen", action="store_true", help="only the Qwen2.5-0.5B shape")
    parser.add_argument("--tile-variants", action="store_true",
                        help="then time the SmolLM2 pack under each of TILE_VARIANTS (keep-bits and wgrad tiles)")
    args = parser.parse_args(argv)
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}", flush=True)
    rows: list[dict] = []
    notes: list[str] = []
    tflops = gemm_tflops()
    if not args.only_qwen:
        _smollm2(rows, notes, tflops)
    if not args.skip_qwen:
        _qwen(rows, notes, tflops)
    for n in notes:
        print(n)
    print("x eager / x graph: per trial-step, PEFT ms / (pack step ms / slots); smollm2 vs PEFT b8, qwen vs PEFT b1")
    print(table(rows), flush=True)
    if args.tile_variants:
        print("\n".join(tile_variants()), flush=True)


if __name__ == "__main__":
    main()
