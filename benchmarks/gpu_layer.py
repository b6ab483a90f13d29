"""W4 on a GPU: what the packed LoRA costs on top of the frozen base, at the same tokens.

Two granularities, each timed base-alone and packed alternately ``repeats`` times, the ratio the median of
the per-repeat ratios (the same base timing drifted by 10% between two back-to-back runs on the H200, 1.59 and
1.77 ms, which a single base-then-packed pair folds into the ratio):

- ``projection_bench``: one projection (``kernels.ops.packed_lora_eval_linear``) against its GEMMs alone;
- ``decoder_layer_bench``: one decoder layer of a real shape, wrapped by ``PackedModel`` (LoRA on all seven
  projections, fused norms and MLP middles) on the training step's tables (``SlotStore.stepping``: each projection
  one ``kernels.ops.packed_lora`` call, the slots' gradients added into the store), against the same layer with no
  slot active. This is the layer a pack runs 28 or 32 times per step.

Run: ``python -m lora_sweep.benchmarks.gpu_layer`` (also ``python -m lora_sweep.benchmarks.gpu_bench --part layer``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch

from lora_sweep.benchmarks.timing import check_row

__all__ = ["LAYER_SHAPES", "projection_bench", "decoder_layer_bench", "run_all"]

LAYER_SHAPES = ((4096, 4096), (4096, 14336), (14336, 4096), (4096, 1024))
"""Single projections: Llama-3-8B's attention (q, o), MLP (gate/up, down) and key/value (8 KV heads) shapes."""


def _ratio_row(base: Callable[[], None], packed: dict[str, Callable[[], None]], repeats: int) -> dict:
    """Median times and base-relative ratios (median and range over ``repeats`` alternations) of each packed
    variant, and each call's host queue time (``*_host_ms``; above the GPU time, the call is host-bound)."""
    import triton.testing

    bench = lambda fn: triton.testing.do_bench(fn, warmup=50, rep=200, return_mode="median")  # noqa: E731
    times: dict[str, list[float]] = {"base": [], **{k: [] for k in packed}}
    for _ in range(repeats):
        times["base"].append(bench(base))
        for name, fn in packed.items():
            times[name].append(bench(fn))
    row: dict = {"base_ms": round(statistics.median(times["base"]), 3)}
    for name in packed:
        ratios = [p / b for b, p in zip(times["base"], times[name], strict=True)]
        row[f"{name}_ms"] = round(statistics.median(times[name]), 3)
        row[f"{name}_ratio"] = round(statistics.median(ratios), 3)
        row[f"{name}_ratio_range"] = [round(min(ratios), 3), round(max(ratios), 3)]
    row["base_host_ms"] = _host_ms(base)
    for name, fn in packed.items():
        row[f"{name}_host_ms"] = _host_ms(fn)
    return row


def _host_ms(fn: Callable[[], None], calls: int = 50) -> float:
    """Milliseconds the host takes to queue one ``fn()``, over ``calls`` calls without a sync."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    queued = time.perf_counter() - start
    torch.cuda.synchronize()
    return round(queued / calls * 1000, 3)


def _pack(tokens: int, slots: int, rank: int):  # type: ignore[no-untyped-def]
    from lora_sweep.kernels.ops import LayerRanks, PackLayout

    layout = PackLayout(tuple(range(slots)), tuple(range(slots)), (1,) * slots, (tokens // slots,) * slots,
                        (0.0,) * slots, (0,) * slots)
    return layout, LayerRanks((rank,) * slots, (2.0,) * slots, 0)


def _lora_a(rows: int, d_in: int) -> torch.Tensor:
    """fp32 master A (rows, d_in)."""
    return (torch.randn(rows, d_in, device="cuda") / d_in**0.5).requires_grad_()


def _lora_bt(rows: int, d_out: int) -> torch.Tensor:
    """fp32 master B^T (rows, d_out): a small normal B, not PEFT's zeros (performance.md's protocol)."""
    return (torch.randn(rows, d_out, device="cuda") * 0.01).requires_grad_()


def projection_bench(d_in: int = 4096, d_out: int = 4096, tokens: int = 16384, slots: int = 8, rank: int = 16,
                     repeats: int = 5) -> dict:
    """One projection forward+backward: base GEMM + packed LoRA (fused Triton) vs the base GEMM alone."""
    from lora_sweep.kernels.ops import packed_lora_eval_linear

    w = torch.randn(d_out, d_in, device="cuda", dtype=torch.bfloat16) / d_in**0.5
    x = torch.randn(slots, tokens // slots, d_in, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    a, bt = _lora_a(slots * rank, d_in), _lora_bt(slots * rank, d_out)
    layout, ranks = _pack(tokens, slots, rank)
    dy = torch.randn(slots, tokens // slots, d_out, device="cuda", dtype=torch.bfloat16)

    def base() -> None:
        torch.autograd.backward(x @ w.T, dy)

    def packed() -> None:
        torch.autograd.backward(packed_lora_eval_linear(x, w, None, a, bt, layout, ranks, impl="triton"), dy)

    row = _ratio_row(base, {"packed": packed}, repeats)
    return dict(workload="W4", scope="projection", shape=f"{d_in}->{d_out}", tokens=tokens, slots=slots, rank=rank,
                ratio=row.pop("packed_ratio"), **row)


def decoder_layer_bench(shape: str = "llama3-8b", slots: int = 16, seq: int = 1024, rank: int = 16,
                        repeats: int = 5) -> dict:
    """One decoder layer of ``shape`` forward+backward (to its input and the slots' LoRA weights): ``slots``
    adapters of rank ``rank`` on all seven projections, one row of ``seq`` tokens each, on the training step's
    tables (``ratio``), against the same layer with no slot active."""
    import contextlib

    from lora_sweep.benchmarks.shapes import PROJ, SHAPES, build_shape
    from lora_sweep.kernels.ops import SEG_FLT_COL, SEG_INT_COL
    from lora_sweep.packer.model.packed import PackedModel
    from lora_sweep.packer.plan import AdapterSpec

    model = build_shape(shape, layers=1)
    pm = PackedModel(model, impl="triton")
    store = pm.ensure_store(slots, rank)
    for i in range(slots):
        pm.add_slot(i, AdapterSpec(rank=rank, alpha=2 * rank, targets=PROJ, seed=i))
    buffers = store.shape_buffers(1, seq)  # slot g owns row g, as ``train`` lays a step out
    buffers.meta.seg_int[:, SEG_INT_COL.rank] = rank
    buffers.meta.seg_flt[:, SEG_FLT_COL.scale] = pm.specs[0].scale
    buffers.rank.fill_(rank)
    store.active = frozenset(pm.slot_paths[0])
    layer = model.model.layers[0]
    hidden = SHAPES[shape]["hidden_size"]
    x = torch.randn(slots, seq, hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    positions = torch.arange(seq, device="cuda").expand(slots, seq)
    rope = model.model.rotary_emb(x, position_ids=positions)
    dy = torch.randn_like(x)

    def step(active: bool) -> Callable[[], None]:
        def run() -> None:
            with store.stepping(buffers, dropout=False) if active else contextlib.nullcontext():
                out = layer(x, position_ids=positions, position_embeddings=rope)
                torch.autograd.backward(out[0] if isinstance(out, tuple) else out, dy)
        return run

    row = _ratio_row(step(False), {"packed": step(True)}, repeats)
    return dict(workload="W4", scope="decoder layer", shape=shape, tokens=slots * seq, slots=slots, rank=rank,
                ratio=row.pop("packed_ratio"), **row)


def run_all(emit: Callable[[dict], None]) -> None:
    """Every W4 row: the decoder layers first (the headline), then single projections."""
    for shape in ("llama3-8b", "qwen2.5-7b"):
        emit(decoder_layer_bench(shape, seq=1024 if shape == "llama3-8b" else 512))
        torch.cuda.empty_cache()
    for d_in, d_out in LAYER_SHAPES:
        emit(projection_bench(d_in, d_out))


def main(argv: list[str] | None = None) -> None:
    argparse.ArgumentParser(prog="python -m lora_sweep.benchmarks.gpu_layer", description=__doc__).parse_args(argv)
    run_all(lambda r: print(json.dumps(check_row(r, f"W4 {r['scope']} {r['shape']}")), flush=True))


if __name__ == "__main__":
    main()
