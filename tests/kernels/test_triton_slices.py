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


# -- the static step's group (kernels.packed_lora_static_group) ----------------------------------------------------

# (slot ranks (0: a free slot), rows per slot, L, D_in, per member D_out, members no slot adapts): q/k/v-like with a
# ragged D_in (not a multiple of 32: a partial keep-bits word) and a free slot; gate/up-like with odd widths and one
# member the step does not adapt (its columns are its base projection alone).
STATIC_CASES = [((5, 0, 8), 2, 5, 40, (24, 8, 8), ()), ((3, 1), 1, 7, 37, (13, 19), (1,))]
STATIC_IDS = ["qkv-free-slot", "gate-up-one-unadapted"]
RB = 8  # rank bucket: rows per slot in A / B^T


def _static_setup(ranks, rows, seq, d_in, d_outs, unadapted, dropout):
    """Static tables (one per member: its own layer id), per member A / B^T in the static layout (slot g at rows
    g * RB, rank padding zero), weights, biases, x and an upstream gradient; fp32 on DEVICE."""
    from lora_sweep.kernels import GroupSlice, static_meta
    from lora_sweep.kernels._launch import SEG_FLT_COL

    c = len(ranks)
    g = torch.Generator().manual_seed(1)
    base = static_meta(c, rows, seq, RB, DEVICE, dropout=dropout)
    for s, r in enumerate(ranks):
        base.seg_int[s, SEG_INT_COL.rank] = r
        base.seg_int[s, SEG_INT_COL.seed] = 1000 + 17 * s
        p = (0.3 if s % 2 == 0 else 0.0) if dropout else 0.0  # one slot without dropout in a call that has it
        base.seg_flt[s, SEG_FLT_COL.scale] = 0.5 + s
        base.seg_flt[s, SEG_FLT_COL.p] = p
        base.seg_flt[s, SEG_FLT_COL.inv_keep] = 1.0 / (1.0 - p)
    t = c * rows * seq
    x = torch.randn((t, d_in), generator=g)
    weights = [torch.randn((d, d_in), generator=g) / d_in**0.5 for d in d_outs]
    biases = [torch.randn((d,), generator=g) for d in d_outs]
    a, bt = [], []
    for d in d_outs:
        keep = torch.zeros((c * RB, 1))
        for s, r in enumerate(ranks):
            keep[s * RB:s * RB + r] = 1.0
        a.append(torch.randn((c * RB, d_in), generator=g) * keep)
        bt.append(torch.randn((c * RB, d), generator=g) * keep / 4)
    dy = torch.randn((t, sum(d_outs)), generator=g)
    members, col = [], 0
    for s, d in enumerate(d_outs):
        meta = None if s in unadapted else base._replace(layer_id=7 + s)
        members.append(GroupSlice(col, d, meta))
        col += d
    move = lambda ts: [u.to(DEVICE) for u in ts]  # noqa: E731
    return members, x.to(DEVICE), move(weights), move(biases), move(a), move(bt), dy.to(DEVICE)


def _static_group(members, x, weights, biases, a, bt, dy):
    """The group call: output, dx and each member's gradient buffers (zero before)."""
    from lora_sweep.kernels import packed_lora_static_group

    grads = [(torch.zeros_like(u), torch.zeros_like(v)) for u, v in zip(a, bt, strict=True)]
    members = tuple(m._replace(grads=grads[s]) if m.meta is not None else m for s, m in enumerate(members))
    ws = tuple(t for s, m in enumerate(members) if m.meta is not None for t in (a[s], bt[s]))
    xl = x.clone().requires_grad_()
    y = packed_lora_static_group(xl, torch.cat(weights), torch.cat(biases), members,
                                 tuple(w.requires_grad_() for w in ws))
    y.backward(dy)
    return y.detach(), xl.grad, grads


@pytest.mark.parametrize("dropout", [False, True], ids=["no-dropout", "dropout"])
@pytest.mark.parametrize(("ranks", "rows", "seq", "d_in", "d_outs", "unadapted"), STATIC_CASES, ids=STATIC_IDS)
def test_static_group_matches_float64(ranks, rows, seq, d_in, d_outs, unadapted, dropout) -> None:
    """Output, dx and every member's weight gradients equal float64 math with each member's own dropout multiplier
    (``dropout_mask`` of its tables: its layer id), the one its solo call draws."""
    from lora_sweep.kernels.triton_dropout import dropout_mask

    members, x, weights, biases, a, bt, dy = _static_setup(ranks, rows, seq, d_in, d_outs, unadapted, dropout)
    y, dx, grads = _static_group(members, x, weights, biases, a, bt, dy)
    t = x.shape[0]
    xd = x.double().requires_grad_()
    leaves = [tuple(w.detach().double().requires_grad_() for w in pair) for pair in zip(a, bt, strict=True)]
    outs = []
    for s, m in enumerate(members):
        out = xd @ weights[s].double().T + biases[s].double()
        if m.meta is not None:
            mult = dropout_mask(m.meta, t, d_in, DEVICE).double()  # (T, D_in) M / (1 - p), ones without dropout
            per = t // len(ranks)  # tokens per slot
            scale = m.meta.seg_flt[:, 0].double().repeat_interleave(per)[:, None]
            own = torch.arange(t, device=DEVICE)[:, None] // per == torch.arange(len(ranks) * RB, device=DEVICE) // RB
            h = scale * ((xd * mult) @ leaves[s][0].T) * own  # a token meets its own slot's rows only
            out = out + h @ leaves[s][1]  # rank padding rows are zero
        outs.append(out)
    want = torch.cat(outs, dim=1)
    want.backward(dy.double())
    torch.testing.assert_close(y.double(), want, **TOL)
    torch.testing.assert_close(dx.double(), xd.grad, **TOL)
    for s, m in enumerate(members):
        if m.meta is not None:
            torch.testing.assert_close(grads[s][0].double(), leaves[s][0].grad, **TOL)
            torch.testing.assert_close(grads[s][1].double(), leaves[s][1].grad, **TOL)
        else:
            assert not grads[s][0].any() and not grads[s][1].any()


@pytest.mark.parametrize("dropout", [False, True], ids=["no-dropout", "dropout"])
def test_static_group_equals_members_alone(dropout: bool) -> None:
    """Each member run alone (``packed_lora_static``, the static step's solo call): the same weight-gradient bits
    (the same kernels on the same operands and masks), the same outputs and a dx within fp32 rounding (the base GEMM
    and the sum over members in another order)."""
    from lora_sweep.kernels import packed_lora_static

    members, x, weights, biases, a, bt, dy = _static_setup(*STATIC_CASES[0][:5], (), dropout)
    y, dx, grads = _static_group(members, x, weights, biases, a, bt, dy)
    xl = x.clone().requires_grad_()
    ys, cols = [], 0
    for s, m in enumerate(members):
        ga, gbt = torch.zeros_like(a[s]), torch.zeros_like(bt[s])
        ys.append(packed_lora_static(xl, None, weights[s], biases[s], a[s].requires_grad_(),
                                     bt[s].requires_grad_(), m.meta, (ga, gbt)))
        ys[-1].backward(dy[:, cols:cols + m.width])
        cols += m.width
        assert torch.equal(grads[s][0], ga) and torch.equal(grads[s][1], gbt)
    torch.testing.assert_close(y, torch.cat([u.detach() for u in ys], dim=1), rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(dx, xl.grad, rtol=1e-6, atol=1e-5)
