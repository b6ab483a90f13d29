"""Launch-config sweep of the packed-LoRA kernels on a GPU: where the defaults of ``kernels.triton_lora``
(``_launch_config``, ``CHUNK_TOKENS``, the expand's weight cast) come from, rerunnable on another GPU.

    python -m lora_sweep.benchmarks.gpu_kernels [--tokens 16384] [--slots 8] [--rank 16]

Prints one JSON line per (kernel, shape, dropout, config) with the median microseconds of
``triton.testing.do_bench`` through the public launchers (allocations included), and per shape the
ceilings the kernels work against (one read of x, one write of y, the base GEMM), then a table of the
default against the best config per row.
"""

from __future__ import annotations

import argparse
import json
from functools import partial

import torch

from lora_sweep.kernels._launch import build_meta
from lora_sweep.kernels.ops import LayerRanks, PackLayout

SHAPES = ((4096, 4096), (4096, 14336), (14336, 4096))
SHRINK = ((128, 3), (64, 4), (128, 4), (64, 3), (256, 3))  # (block_k, stages)
WGRAD = ((64, 3), (32, 4), (64, 4), (32, 3))  # (block_t, stages)
CHUNKS = (1024, 2048)


def _us(fn) -> float:
    import triton.testing

    return round(triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median") * 1000, 1)


def sweep(d_in: int, d_out: int, tokens: int, slots: int, rank: int, dropout: float) -> list[dict]:
    """Every config of the three kernels at one shape; dropout p for every slot (0 = the no-dropout path)."""
    from lora_sweep.kernels.triton_segments import _launch_config, seg_expand_add, seg_shrink, seg_wgrad

    dev = torch.device("cuda")
    layout = PackLayout(tuple(range(slots)), tuple(range(slots)), (1,) * slots, (tokens // slots,) * slots,
                        (dropout,) * slots, (7,) * slots)
    ranks = LayerRanks((rank,) * slots, (2.0,) * slots, 3)
    x = torch.randn(tokens, d_in, device=dev, dtype=torch.bfloat16)
    a = torch.randn(slots * rank, d_in, device=dev)
    bt = torch.randn(slots * rank, d_out, device=dev)
    y = torch.empty(tokens, d_out, device=dev, dtype=torch.bfloat16)
    tile, stages = _launch_config(dropout > 0)
    row = dict(shape=f"{d_in}->{d_out}", tokens=tokens, slots=slots, rank=rank, dropout=dropout)
    rows = [] if dropout else _ceilings(row, x, y)
    meta = build_meta(layout, ranks, tokens, tokens // slots, dev, chunk_tokens=CHUNKS[0])
    for bk, st in SHRINK:
        rows.append(dict(row, kernel="shrink x", config=f"block_k={bk} stages={st}",
                         default=(bk, st) == (2 * tile, stages),
                         us=_us(partial(seg_shrink, x, a, meta, dropout=True, block_k=bk, stages=st))))
    h = seg_shrink(x, a, meta, dropout=True)
    for label, w in (("fp32 weights", bt), ("bf16 weights", bt.to(torch.bfloat16))):
        rows.append(dict(row, kernel="expand y", config=label, default=label.startswith("bf16"),
                         us=_us(partial(seg_expand_add, h, w, meta, y, src=None, dropout=False))))
    for chunk in CHUNKS:
        meta = build_meta(layout, ranks, tokens, tokens // slots, dev, chunk_tokens=chunk)
        for bt_, st in WGRAD:
            rows.append(dict(row, kernel="wgrad A", config=f"chunk={chunk} block_t={bt_} stages={st}",
                             default=(chunk, bt_, st) == (CHUNKS[1], tile, stages),
                             us=_us(partial(seg_wgrad, h, x, meta, dropout=True, block_t=bt_, stages=st))))
    return rows


def _ceilings(row: dict, x: torch.Tensor, y: torch.Tensor) -> list[dict]:
    """What the kernels are up against at this shape: one pass of reading x or writing y through torch, and
    the base projection's cuBLAS GEMM plain and accumulating onto y (beta = 1, the Function's forward)."""
    w = torch.randn(y.shape[1], x.shape[1], device=x.device, dtype=x.dtype)
    runs = {"read x (torch x.sum(1))": partial(torch.sum, x, 1), "write y (torch y.fill_)": partial(y.fill_, 1.0),
            "cuBLAS x W^T": partial(torch.mm, x, w.t(), out=y), "cuBLAS y.addmm_(x, W^T)": partial(y.addmm_, x, w.t())}
    return [dict(row, kernel="ceiling", config=k, default=False, us=_us(fn)) for k, fn in runs.items()]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--rank", type=int, default=16)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        ap.error("needs a CUDA GPU")
    rows = []
    for d_in, d_out in SHAPES:
        for p in (0.0, 0.1):
            for r in sweep(d_in, d_out, args.tokens, args.slots, args.rank, p):
                print(json.dumps(r), flush=True)
                rows.append(r)
    print("| kernel | shape | dropout | default us | best us | best config |\n|---|---|---|---|---|---|")
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["kernel"], r["shape"], r["dropout"]), []).append(r)
    for (kernel, shape, p), rs in groups.items():
        if kernel == "ceiling":
            for r in rs:
                print(f"| {r['config']} | {shape} | - | {r['us']} | | |")
            continue
        best = min(rs, key=lambda r: r["us"])
        default = next(r for r in rs if r["default"])
        print(f"| {kernel} | {shape} | {p} | {default['us']} | {best['us']} | {best['config']} |")


if __name__ == "__main__":
    main()
