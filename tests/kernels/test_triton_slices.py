"""Shared-input groups (``kernels.packed_lora_linear_slices``): the Triton call against the float64 loop per slice.

CPU: the Triton interpreter (conftest.py), fp32. GPU: the same tests compiled, plus a bf16 check that the group
equals its projections run one by one.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.conftest import need_triton

need_triton()  # before anything imports the Triton kernel modules

from lora_sweep.kernels import LayerRanks, PackLayout, group_rows, packed_lora_linear, packed_lora_linear_slices  # noqa: E402
from lora_sweep.kernels._launch import SEG_INT_COL, build_slice_metas  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = torch.device("cuda" if torch.cuda.is_available() and not INTERPRET else "cpu")
TOL = {"rtol": 1e-5, "atol": 1e-4}  # fp32 kernels vs float64: sums of <= 130 terms of size ~10

# (rows per slot, per slice the slots' ranks, L, D_in, per slice D_out): q/k/v-like with mixed ranks, a slot
# that skips k (rank 0 there) and an empty segment; gate/up-like with odd sizes and a slot that adapts neither;
# a group whose total rank per slot passes 64 (two rank tiles of the group's shrink).
CASES = [
    ((2, 1, 0, 3), ((8, 3, 4, 1), (8, 0, 4, 1), (8, 3, 4, 1)), 9, 40, (40, 13, 13)),
    ((1, 2, 2), ((5, 0, 3), (5, 0, 3)), 11, 37, (67, 67)),
    ((2, 3), ((30, 5), (30, 5), (16, 5)), 5, 48, (36, 20, 20)),
]
IDS = ["qkv-mixed", "gate-up-odd", "two-rank-tiles"]


def _setup(n_rows, ranks, seq, d_in, d_outs, *, seed: int = 0):
    """Layout, per-slice ranks (a slot's scale is the same in every slice), and fp32 tensors."""
    n = len(n_rows)
    layout = PackLayout(tuple(range(10, 10 + n)), tuple(sum(n_rows[:i]) for i in range(n)), tuple(n_rows),
                        (seq,) * n, (0.0,) * n, tuple(100 + 7 * i for i in range(n)))
    slices = tuple(LayerRanks(tuple(r), tuple(0.5 + g for g in range(n)), 3 + s) for s, r in enumerate(ranks))
    g = torch.Generator().manual_seed(seed)
    x = torch.randn((sum(n_rows), seq, d_in), generator=g)
    a_group = torch.randn((sum(map(sum, ranks)), d_in), generator=g)
    weights = [torch.randn((d, d_in), generator=g) / d_in**0.5 for d in d_outs]
    biases = [torch.randn((d,), generator=g) if s == 0 else None for s, d in enumerate(d_outs)]  # one with bias
    bt_cats = [torch.randn((sum(r), d), generator=g) for r, d in zip(ranks, d_outs, strict=True)]
    dys = [torch.randn((sum(n_rows), seq, d), generator=g) for d in d_outs]
    move = lambda ts: [None if t is None else t.to(DEVICE) for t in ts]  # noqa: E731
    return layout, slices, x.to(DEVICE), a_group.to(DEVICE), move(weights), move(biases), move(bt_cats), move(dys)


def _run(impl, dtype, layout, slices, x, a_group, weights, biases, bt_cats, dys, used):
    """Outputs and the gradients of x, a_group and each bt_cat, in ``dtype``; only slices in ``used`` get a
    gradient (the others' outputs are dropped, as an unused projection's would be)."""
    cast = lambda t: None if t is None else t.to(dtype)  # noqa: E731
    leaves = [t.detach().to(dtype).clone().requires_grad_() for t in (x, a_group, *bt_cats)]
    ys = packed_lora_linear_slices(leaves[0], tuple(map(cast, weights)), tuple(map(cast, biases)), leaves[1],
                                   tuple(leaves[2:]), layout, slices, impl=impl)
    torch.autograd.backward([ys[s] for s in used], [dys[s].to(dtype) for s in used])
    return [y.detach() for y in ys] + [t.grad if t.grad is not None else torch.zeros_like(t) for t in leaves]


@pytest.mark.parametrize("used", ["all", "first-and-last"])
@pytest.mark.parametrize(("n_rows", "ranks", "seq", "d_in", "d_outs"), CASES, ids=IDS)
def test_slices_match_loop(n_rows, ranks, seq, d_in, d_outs, used) -> None:
    """Outputs and gradients of x, a_group and every bt_cat equal the float64 loop, slice by slice."""
    args = _setup(n_rows, ranks, seq, d_in, d_outs)
    use = range(len(ranks)) if used == "all" else (0, len(ranks) - 1)
    got = _run("triton", torch.float32, *args, use)
    want = _run("loop", torch.float64, *args, use)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g.double(), w, **TOL)


def test_group_rows_and_tables() -> None:
    """``group_rows`` stacks slot by slot, slice by slice; each slice's table points at its own h columns."""
    layout, slices, *_ = _setup(*CASES[0])
    q, k, v = group_rows(slices)
    assert q == (*range(0, 8), 24, 25, 26, 30, 31, 32, 33, 42)
    assert k == (*range(8, 16), 34, 35, 36, 37, 43)  # slot 1 skips k
    assert v == (*range(16, 24), 27, 28, 29, 38, 39, 40, 41, 44)
    group, metas = build_slice_metas(layout, slices, 6 * 9, 9, DEVICE)
    assert group.r_pad == 32 and group.r_cols == 32 and all(m.r_pad == 32 and m.r_cols == 16 for m in metas)
    assert group.seg_int[:, SEG_INT_COL.rank].tolist() == [24, 6, 3]  # the empty segment (slot 2) gets no row
    # k: slot 1 inactive
    assert [m.seg_int[:, SEG_INT_COL.h_col].tolist() for m in metas] == [[0, 0, 0], [8, 1], [16, 3, 2]]


def test_slices_refuse_dropout_and_mixed_scales() -> None:
    """The Triton group draws no per-slice dropout masks, and applies one scale per slot: both are refused."""
    layout, slices, x, a_group, weights, biases, bt_cats, _ = _setup(*CASES[1])
    with pytest.raises(ValueError, match="dropout"):
        packed_lora_linear_slices(x, tuple(weights), tuple(biases), a_group, tuple(bt_cats),
                                  layout._replace(dropout=(0.1, 0.0, 0.0)), slices, impl="triton")
    odd = (slices[0], slices[1]._replace(scale=(0.5, 1.5, 9.0)))
    with pytest.raises(ValueError, match="scales"):
        packed_lora_linear_slices(x, tuple(weights), tuple(biases), a_group, tuple(bt_cats), layout, odd,
                                  impl="triton")


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE.type != "cuda", reason="needs CUDA")
def test_slices_equal_projections_one_by_one_bf16() -> None:
    """bf16 on the GPU: the group and its slices run one by one (``packed_lora_linear``) give the same outputs
    and slot gradients (the same kernels, columns offset; sums of dx in a different order)."""
    layout, slices, x, a_group, weights, biases, bt_cats, dys = _setup(
        (64, 32, 96), ((16, 16, 16), (16, 0, 16), (16, 16, 16)), 128, 1024, (1024, 256, 256))
    a_group, bt_cats = a_group / 32, [bt / 10 for bt in bt_cats]  # training-like sizes: terms of order 1
    got = _run("triton", torch.bfloat16, layout, slices, x, a_group, weights, biases, bt_cats, dys, range(3))
    leaves = [t.detach().to(torch.bfloat16).clone().requires_grad_() for t in (x, a_group)]
    a_parts = [leaves[1][torch.tensor(rows, device=DEVICE)] for rows in group_rows(slices)]
    bts = [bt.to(torch.bfloat16).requires_grad_() for bt in bt_cats]
    ys = [packed_lora_linear(leaves[0], w.to(torch.bfloat16), None if b is None else b.to(torch.bfloat16), a, bt,
                             layout, ranks, impl="triton")
          for w, b, a, bt, ranks in zip(weights, biases, a_parts, bts, slices, strict=True)]
    torch.autograd.backward(ys, [dy.to(torch.bfloat16) for dy in dys])
    want = [y.detach() for y in ys] + [leaves[0].grad, leaves[1].grad] + [bt.grad for bt in bts]
    for name, g, w in zip(["y_q", "y_k", "y_v", "dx", "da", "dbt_q", "dbt_k", "dbt_v"], got, want, strict=True):
        # bf16 rounds at different points (dx: one fp32 sum of the slices' LoRA terms, then the GEMMs, against
        # a bf16 dx per projection added by autograd): compare as a whole, a few bf16 roundings apart
        err = ((g.float() - w.float()).norm() / w.float().norm()).item()
        assert err < 1e-2, (name, err)
