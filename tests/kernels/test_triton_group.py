"""The static step's shared-input group (``kernels.ops.packed_lora_static_group``): against float64 math with each
member's own dropout multiplier, and against its members run alone.

CPU: the Triton interpreter (conftest.py), fp32. GPU: the same tests compiled.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.conftest import need_triton

need_triton()  # before anything imports the Triton kernel modules

from lora_sweep.kernels._launch import SEG_INT_COL  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = torch.device("cuda" if torch.cuda.is_available() and not INTERPRET else "cpu")
TOL = {"rtol": 1e-5, "atol": 1e-4}  # fp32 kernels vs float64: sums of <= 130 terms of size ~10

# (slot ranks (0: a free slot), rows per slot, L, D_in, per member D_out, members no slot adapts): q/k/v-like with a
# ragged D_in (not a multiple of 32: a partial keep-bits word) and a free slot; gate/up-like with odd widths and one
# member the step does not adapt (its columns are its base projection alone).
STATIC_CASES = [((5, 0, 8), 2, 5, 40, (24, 8, 8), ()), ((3, 1), 1, 7, 37, (13, 19), (1,))]
STATIC_IDS = ["qkv-free-slot", "gate-up-one-unadapted"]
RB = 8  # rank bucket: rows per slot in A / B^T


def _static_setup(ranks, rows, seq, d_in, d_outs, unadapted, dropout):
    """Static tables (one per member: its own layer id), per member A / B^T in the static layout (slot g at rows
    g * RB, rank padding zero), weights, biases, x and an upstream gradient; fp32 on DEVICE."""
    from lora_sweep.kernels._launch import SEG_FLT_COL
    from lora_sweep.kernels.ops import GroupSlice, static_meta

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
    from lora_sweep.kernels.ops import packed_lora_static_group

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
    from lora_sweep.kernels.ops import packed_lora_static

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
