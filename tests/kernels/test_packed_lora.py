"""Triton packed-LoRA kernels against ``kernels.reference`` (float64 loop, masks reproduced from the seed).

CPU: the kernels run in the Triton interpreter (conftest.py), fp32 only (bf16 ``tl.dot`` is wrong there).
GPU: the same tests run compiled on CUDA, plus the ``gpu`` class (bf16, bigger shapes, a speed smoke test):
``python -m pytest tests/kernels -q`` on the H200.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import need_triton

need_triton()  # before anything imports the Triton kernel modules

from lora_sweep.kernels._launch import CHUNK_COL, SegFlt, SegInt, Tile, build_meta, segment_meta  # noqa: E402
from lora_sweep.kernels.ops import LayerRanks, PackLayout, packed_lora_eval, packed_lora_eval_linear  # noqa: E402
from lora_sweep.kernels.reference import lora_loop, lora_masked_dense  # noqa: E402
from lora_sweep.kernels.triton_dropout import dropout_mask, keep_bits  # noqa: E402
from lora_sweep.kernels.triton_lora import PackedLoRAFunction  # noqa: E402
from lora_sweep.kernels.triton_segments import seg_expand_add, seg_shrink, seg_wgrad  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = torch.device("cuda" if torch.cuda.is_available() and not INTERPRET else "cpu")
ROOT = Path(__file__).resolve().parents[2]

# (rows per slot, ranks, L, D_in, D_out): one slot with rank 1 and prime sizes; mixed ranks; an empty segment
# holding a rank; a rank-0 slot (tokens left uncovered) with D not a power of 2; ranks (1, 3, 8, 16) over
# T = 230 tokens (not a multiple of any block); a rank > 64 (two rank tiles) next to a small one.
CASES = [
    ((3,), (1,), 7, 13, 11),
    ((2, 1, 3), (1, 3, 8), 9, 37, 29),
    ((2, 0, 3, 1), (16, 4, 1, 3), 13, 67, 45),
    ((1, 2, 2), (5, 0, 3), 11, 100, 130),
    ((3, 2, 4, 1), (1, 3, 8, 16), 23, 40, 24),
    ((2, 3), (70, 5), 5, 48, 36),
]
IDS = ["one-slot-r1", "mixed", "empty-seg", "rank0-slot", "r1-3-8-16", "r70"]
# default blocks, and small ones so that short segments still span several tiles, K steps and wgrad chunks
BLOCKS = {"default": {}, "small": {"block_m": 16, "chunk_tokens": 40}}
LAUNCH = {  # per-launcher block overrides: shrink, expand, wgrad
    "default": ({}, {}, {}),
    "small": ({"block_k": 32}, {"block_n": 32}, {"block_t": 16, "block_n": 32}),
}


def _layout(n_rows, ranks, seq, dropout: bool, layer_id: int = 3) -> tuple[PackLayout, LayerRanks]:
    n = len(n_rows)
    starts = tuple(sum(n_rows[:i]) for i in range(n))
    drop = tuple(0.3 * ((i + 1) % 2) for i in range(n)) if dropout else (0.0,) * n
    layout = PackLayout(tuple(range(10, 10 + n)), starts, tuple(n_rows), (seq,) * n, drop,
                        tuple(100 + 7 * i for i in range(n)))
    return layout, LayerRanks(tuple(ranks), tuple(0.5 + i for i in range(n)), layer_id)


def _tensors(n_rows, ranks, seq, d_in, d_out, seed=0):
    g = torch.Generator().manual_seed(seed)
    b = sum(n_rows)
    made = [torch.randn(s, generator=g) for s in ((b, seq, d_in), (b, seq, d_out), (sum(ranks), d_in),
                                                 (sum(ranks), d_out))]
    return [t.to(DEVICE) for t in made]


def _segments(layout, ranks, seq):
    """(token range, rank-row range) of each slot that owns tokens and rank rows."""
    out, off = [], 0
    for r0, n, r in zip(layout.row_start, layout.n_rows, ranks.rank, strict=True):
        if n and r:
            out.append((slice(r0 * seq, (r0 + n) * seq), slice(off, off + r), r))
        off += r
    return out


def loop_with_mask(x, base, a_cat, bt_cat, layout, ranks, mask):
    """Test-only oracle: the reference loop with the Triton dropout multiplier ``mask`` (B, L, D_in).

    x reaches only the LoRA path of ``lora_loop``, so feeding ``x * mask`` with dropout off is exactly
    "dropout with this mask" (and autograd multiplies dx by the mask).
    """
    return lora_loop(x * mask, base, a_cat, bt_cat, layout._replace(dropout=(0.0,) * len(layout.slots)), ranks)


def _mask(layout, ranks, x, **blocks):
    b, seq, d_in = x.shape
    meta = build_meta(layout, ranks, b * seq, seq, x.device, **blocks)
    return dropout_mask(meta, b * seq, d_in, x.device).view(b, seq, d_in)


# fp32 kernels vs a float64 oracle: only fp32 rounding of sums of <= 130 terms of size ~10 separates them
TOL = {"rtol": 1e-5, "atol": 1e-4}


@pytest.mark.parametrize("blocks", list(BLOCKS))
@pytest.mark.parametrize("dropout", [False, True])
@pytest.mark.parametrize(("n_rows", "ranks", "seq", "d_in", "d_out"), CASES, ids=IDS)
def test_kernels_match_reference(n_rows, ranks, seq, d_in, d_out, dropout, blocks) -> None:
    """shrink, expand-add (out of place, in place, dx epilogue) and wgrad, each against float64 torch."""
    x, base, a_cat, bt_cat = _tensors(n_rows, ranks, seq, d_in, d_out)
    layout, lr = _layout(n_rows, ranks, seq, dropout)
    n_tok = x.shape[0] * seq
    meta = build_meta(layout, lr, n_tok, seq, DEVICE, **BLOCKS[blocks])
    shrink_kw, expand_kw, wgrad_kw = LAUNCH[blocks]
    x2, base2 = x.view(n_tok, d_in), base.view(n_tok, d_out)
    mask = dropout_mask(meta, n_tok, d_in, DEVICE).double()  # (T, D_in)
    segs = _segments(layout, lr, seq)
    scale = [s for s, n, r in zip(lr.scale, layout.n_rows, lr.rank, strict=True) if n and r]

    h = seg_shrink(x2, a_cat, meta, dropout=True, **shrink_kw)
    for (ts, rs, r), s in zip(segs, scale, strict=True):
        torch.testing.assert_close(h[ts, :r].double(), s * (x2[ts].double() * mask[ts]) @ a_cat[rs].double().T, **TOL)

    # unspecified entries of h (columns >= r_g, uncovered tokens) are NaN: the kernels must never read them
    h_nan = torch.full_like(h, float("nan"))
    for ts, _, r in segs:
        h_nan[ts, :r] = h[ts, :r]
    y = seg_expand_add(h_nan, bt_cat, meta, base2.clone(), src=None, dropout=False, **expand_kw)
    y_inplace = base2.clone()
    seg_expand_add(h_nan, bt_cat, meta, y_inplace, src=y_inplace, dropout=False, **expand_kw)
    dx = seg_expand_add(h_nan, a_cat, meta, torch.zeros_like(x2), src=None, dropout=True, **expand_kw)
    expected_y, expected_dx = base2.double().clone(), torch.zeros_like(x2, dtype=torch.float64)
    for ts, rs, r in segs:
        torch.testing.assert_close(y[ts].double(), h[ts, :r].double() @ bt_cat[rs].double(), **TOL)
        expected_y[ts] += h[ts, :r].double() @ bt_cat[rs].double()
        expected_dx[ts] = (h[ts, :r].double() @ a_cat[rs].double()) * mask[ts]
    torch.testing.assert_close(y_inplace.double(), expected_y, **TOL)
    torch.testing.assert_close(dx.double(), expected_dx, **TOL)

    for q, drop in ((x2, True), (base2, False)):
        grad = seg_wgrad(h_nan, q, meta, dropout=drop, **wgrad_kw)
        expected = torch.zeros((sum(ranks), q.shape[1]), dtype=torch.float64, device=DEVICE)
        for ts, rs, r in segs:
            qq = q[ts].double() * (mask[ts] if drop else 1.0)
            expected[rs] = h[ts, :r].double().T @ qq
        torch.testing.assert_close(grad.double(), expected, **TOL)


@pytest.mark.parametrize("blocks", list(BLOCKS))
@pytest.mark.parametrize("dropout", [False, True])
@pytest.mark.parametrize(("n_rows", "ranks", "seq", "d_in", "d_out"), CASES, ids=IDS)
def test_function_matches_loop(n_rows, ranks, seq, d_in, d_out, dropout, blocks) -> None:
    """The autograd Function: output and the gradients of x, base_out, a_cat, bt_cat."""
    tensors = _tensors(n_rows, ranks, seq, d_in, d_out)
    layout, lr = _layout(n_rows, ranks, seq, dropout)
    b = tensors[0].shape[0]
    meta = build_meta(layout, lr, b * seq, seq, DEVICE, **BLOCKS[blocks])
    mask = dropout_mask(meta, b * seq, d_in, DEVICE).view(b, seq, d_in)
    dy = torch.randn((b, seq, d_out), generator=torch.Generator().manual_seed(1)).to(DEVICE)

    ours = [t.clone().requires_grad_() for t in tensors]
    flat = [ours[0].view(b * seq, d_in), ours[1].view(b * seq, d_out), ours[2], ours[3]]
    y = PackedLoRAFunction.apply(flat[0], flat[1], None, None, flat[2], flat[3], meta).view(b, seq, d_out)
    y.backward(dy)
    ref = [t.double().requires_grad_() for t in tensors]
    y_ref = loop_with_mask(*ref, layout, lr, mask.double())
    y_ref.backward(dy.double())
    for got, want in zip([y] + [t.grad for t in ours], [y_ref] + [t.grad for t in ref], strict=True):
        torch.testing.assert_close(got.detach().double(), want.detach(), **TOL)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dropout", [False, True])
@pytest.mark.parametrize(("n_rows", "ranks", "seq", "d_in", "d_out"), [CASES[1], CASES[3]], ids=["mixed", "rank0-slot"])
def test_linear_function_matches_loop(n_rows, ranks, seq, d_in, d_out, dropout, bias) -> None:
    """The fused base GEMM + LoRA path (``packed_lora_eval_linear``): output and gradients of x, a_cat, bt_cat and,
    when they require grad, of the base weight and bias; uncovered tokens (rank-0 slot) get the base alone."""
    x, _, a_cat, bt_cat = _tensors(n_rows, ranks, seq, d_in, d_out)
    g = torch.Generator().manual_seed(2)
    w = torch.randn((d_out, d_in), generator=g).to(DEVICE) / d_in**0.5
    bvec = torch.randn((d_out,), generator=g).to(DEVICE) if bias else None
    layout, lr = _layout(n_rows, ranks, seq, dropout)
    mask = _mask(layout, lr, x)
    dy = torch.randn((x.shape[0], seq, d_out), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    trained = [t for t in (w, bvec) if t is not None]
    ours = [t.clone().requires_grad_() for t in [x, a_cat, bt_cat, *trained]]
    y = packed_lora_eval_linear(ours[0], ours[3], ours[4] if bias else None, ours[1], ours[2], layout, lr,
                                impl="triton")
    y.backward(dy)
    ref = [t.double().requires_grad_() for t in [x, a_cat, bt_cat, *trained]]
    base = torch.nn.functional.linear(ref[0], ref[3], ref[4] if bias else None)
    y_ref = loop_with_mask(ref[0], base, ref[1], ref[2], layout, lr, mask.double())
    y_ref.backward(dy.double())
    for got, want in zip([y] + [t.grad for t in ours], [y_ref] + [t.grad for t in ref], strict=True):
        torch.testing.assert_close(got.detach().double(), want.detach(), **TOL)


def test_public_entry_points() -> None:
    """``impl="triton"`` through the public API; ``auto`` picks triton on CUDA and the torch path on the CPU."""
    n_rows, ranks, seq, d_in, d_out = CASES[3]
    x, base, a_cat, bt_cat = _tensors(n_rows, ranks, seq, d_in, d_out)
    layout, lr = _layout(n_rows, ranks, seq, dropout=True)
    y = packed_lora_eval(x, base, a_cat, bt_cat, layout, lr, impl="triton")
    want = loop_with_mask(x.double(), base.double(), a_cat.double(), bt_cat.double(), layout, lr,
                          _mask(layout, lr, x).double())
    torch.testing.assert_close(y.double(), want, **TOL)
    auto = packed_lora_eval(x, base, a_cat, bt_cat, layout, lr, impl="auto")
    expected = y if DEVICE.type == "cuda" else lora_masked_dense(x, base, a_cat, bt_cat, layout, lr)
    assert torch.equal(auto, expected)


def test_triton_on_cpu_without_interpreter_is_rejected(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys.modules["lora_sweep.kernels._jit"], "INTERPRET", False)
    x, base, a_cat, bt_cat = (t.cpu() for t in _tensors((1,), (2,), 3, 4, 5))
    layout, lr = _layout((1,), (2,), 3, dropout=False)
    with pytest.raises(RuntimeError, match="CUDA"):
        packed_lora_eval(x, base, a_cat, bt_cat, layout, lr, impl="triton")


def test_kernels_imports_without_triton() -> None:
    code = ("import sys; sys.modules['triton'] = None\n"
            "from lora_sweep.kernels import ops\n"
            "try:\n    ops.packed_lora_eval(None, None, None, None, None, None, impl='triton')\n"
            "except ImportError as e:\n    print('hint' if 'pip install' in str(e) else e)\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "hint"


def test_dropout_mask_pack_equals_alone() -> None:
    """A slot's mask depends on its seed, its layer and its own rows/positions: not on the other slots,
    its place in the pack, or the packed length L (its own positions < own_len are what it would see alone)."""
    d_in, seq = 24, 12
    layout = PackLayout((10, 11, 12), (0, 2, 5), (2, 3, 1), (12, 9, 5), (0.5, 0.25, 0.5), (101, 202, 303))
    lr = LayerRanks((4, 3, 2), (1.0, 1.0, 1.0), layer_id=5)
    x = torch.empty((6, seq, d_in), device=DEVICE)
    packed = _mask(layout, lr, x)
    alone = PackLayout((11,), (0,), (3,), (9,), (0.25,), (202,))
    alone_mask = _mask(alone, LayerRanks((3,), (1.0,), 5), torch.empty((3, 9, d_in), device=DEVICE))
    assert torch.equal(packed[2:5, :9], alone_mask)
    # a different placement in the pack (first instead of second) and small tiles: same mask
    moved = PackLayout((11, 10), (0, 3), (3, 2), (9, 12), (0.25, 0.5), (202, 101))
    moved_mask = _mask(moved, LayerRanks((3, 4), (1.0, 1.0), 5), x[:5], block_m=16)
    assert torch.equal(moved_mask[0:3, :9], alone_mask)
    # keep rates and scale: values are 0 or 1/(1-p), about (1-p) of them kept
    kept = packed[0:2] > 0
    assert set(packed[0:2].unique().tolist()) == {0.0, 2.0}
    assert abs(kept.float().mean().item() - 0.5) < 0.05
    other_layer = _mask(layout, lr._replace(layer_id=6), x)
    assert not torch.equal(other_layer[0:2], packed[0:2])
    assert not torch.equal(packed[0:1, :, :], packed[5:6, :, :])  # different slots draw different masks


def test_slot_gradients_pack_equal_alone() -> None:
    """The engine's invariant at kernel level: a slot's output rows and A/B gradients are the same packed or
    alone (same tiles, same reduction chunks, same mask); checked bit for bit."""
    seq, d_in, d_out = 10, 40, 24
    layout = PackLayout((10, 11), (0, 2), (2, 3), (10, 10), (0.5, 0.25), (101, 202))
    lr = LayerRanks((32, 8), (1.0, 2.0), layer_id=2)
    x, base, a_cat, bt_cat = _tensors((2, 3), (32, 8), seq, d_in, d_out)
    dy = torch.randn(base.shape, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    blocks = {"block_m": 16, "chunk_tokens": 32}

    def run(sl, lay, ranks, rank_rows):
        leaves = [t.clone().requires_grad_() for t in (x[sl], base[sl], a_cat[rank_rows], bt_cat[rank_rows])]
        b = leaves[0].shape[0]
        meta = build_meta(lay, ranks, b * seq, seq, DEVICE, **blocks)
        flat = [leaves[0].view(-1, d_in), leaves[1].view(-1, d_out), leaves[2], leaves[3]]
        y = PackedLoRAFunction.apply(flat[0], flat[1], None, None, flat[2], flat[3], meta)
        y.backward(dy[sl].reshape(-1, d_out))
        return y.view(b, seq, d_out), [t.grad for t in leaves]

    y_pack, g_pack = run(slice(None), layout, lr, slice(None))
    alone = PackLayout((11,), (0,), (3,), (10,), (0.25,), (202,))
    y_alone, g_alone = run(slice(2, 5), alone, LayerRanks((8,), (2.0,), 2), slice(32, 40))
    assert torch.equal(y_pack[2:5], y_alone)
    assert torch.equal(g_pack[0][2:5], g_alone[0])
    assert torch.equal(g_pack[2][32:40], g_alone[2])
    assert torch.equal(g_pack[3][32:40], g_alone[3])


def test_expand_operand_follows_the_dot_dtype() -> None:
    """The expand's weights are cast once only where its ``tl.dot`` reads 16-bit operands: compiled and with
    16-bit activations; fp32 activations and the interpreter (fp32 dots) get the fp32 masters untouched."""
    from lora_sweep.kernels.triton_lora import _expand_operand

    w = torch.randn(8, 16, device=DEVICE)
    assert _expand_operand(w, torch.float32) is w
    cast = _expand_operand(w, torch.bfloat16)
    if INTERPRET:
        assert cast is w
    else:
        assert cast.dtype == torch.bfloat16 and torch.equal(cast, w.to(torch.bfloat16))


@pytest.mark.parametrize("dropout", [False, True])
def test_launch_configs_reach_the_kernels(dropout: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """The tiles and pipeline depth ``benchmarks.gpu_kernels`` measured best reach the shrink and weight-gradient
    launches (BK=128 / BT=64 with 3 stages, dropout or not: the kernels read the mask's bits, no Philox), and
    explicit ones override them."""
    from tests.conftest import record_launches

    n_rows, ranks, seq, d_in = (2, 1), (3, 8), 9, 37
    x, _, a_cat, _ = _tensors(n_rows, ranks, seq, d_in, 5)
    layout, lr = _layout(n_rows, ranks, seq, dropout=True)
    meta = build_meta(layout, lr, 3 * seq, seq, DEVICE)
    x = x.view(-1, d_in)
    keep = keep_bits(meta, x)  # drawn before the recording: only the two kernels' launches are looked at
    calls = record_launches(monkeypatch)
    h = seg_shrink(x, a_cat, meta, dropout=dropout, keep=keep)
    seg_wgrad(h, x, meta, dropout=dropout, keep=keep)
    seg_shrink(x, a_cat, meta, dropout=dropout, keep=keep, block_k=32, stages=2)
    seg_wgrad(h, x, meta, dropout=dropout, keep=keep, block_t=16, stages=2)
    got = [{k: v for k, v in variant[2] if k in ("BK", "BT", "num_stages")} for _, variant in calls]
    tile, stages = "64", "3"
    assert got == [{"BK": str(2 * int(tile)), "num_stages": stages}, {"BT": tile, "num_stages": stages},
                   {"BK": "32", "num_stages": "2"}, {"BT": "16", "num_stages": "2"}]


def test_segment_tables_read_by_column_name() -> None:
    """The tables hold one ``SegInt`` / ``SegFlt`` / ``Tile`` per row, in the field order the kernels' constants
    come from (``kernels._tables``): read back by name, each column says what the layout says."""
    layout, lr = _layout((2, 0, 3), (4, 2, 8), 5, dropout=True)
    meta = build_meta(layout, lr, 25, 5, DEVICE, block_m=8, chunk_tokens=8)
    rows = [SegInt(*r) for r in meta.seg_int.tolist()]  # slot 1 has no rows: no segment
    assert rows == [SegInt(tok_start=0, tok_end=10, row_start=0, rank=4, rank_off=0, seed=100),
                    SegInt(tok_start=10, tok_end=25, row_start=2, rank=8, rank_off=6, seed=114)]
    flt = [SegFlt(*r) for r in meta.seg_flt.tolist()]
    assert [f.scale for f in flt] == [0.5, 2.5] and [f.p for f in flt] == pytest.approx([0.3, 0.3])
    assert [f.inv_keep for f in flt] == pytest.approx([1 / 0.7, 1 / 0.7])
    assert [Tile(*t) for t in meta.tiles.tolist()] == [(0, 0), (0, 8), (1, 10), (1, 18)]
    assert meta.chunks[:, CHUNK_COL.part].tolist() == [0, 1, 0, 1]
    free = segment_meta(3, 2, 5, 16, DEVICE, dropout=False)
    assert [SegInt(*r).rank_off for r in free.seg_int.tolist()] == [0, 16, 32]
    assert all(SegInt(*r).rank == 0 and SegFlt(*f).inv_keep == 1.0
               for r, f in zip(free.seg_int.tolist(), free.seg_flt.tolist(), strict=True))


def test_keep_bits_are_the_drawn_mask() -> None:
    """The mask drawn once as bits (what the kernels read) is the multiplier Philox gives, column by column,
    including a ragged last word (D_in = 37) and a slot with p = 0 (all kept)."""
    from lora_sweep.kernels._jit import triton

    layout, lr = _layout((2, 1, 3), (1, 3, 8), 9, dropout=True)
    meta = build_meta(layout, lr, 6 * 9, 9, DEVICE, block_m=16)
    x = torch.zeros((6 * 9, 37), device=DEVICE)
    bits = keep_bits(meta, x)
    assert bits.shape == (54, triton.cdiv(37, 32)) and bits.dtype == torch.int32
    col = torch.arange(37, device=DEVICE)
    kept = (bits[:, col // 32] >> (col % 32)) & 1  # (T, D_in)
    inv = torch.tensor([1 / 0.7 if p else 1.0 for p in layout.dropout], device=DEVICE).repeat_interleave(
        torch.tensor(layout.n_rows, device=DEVICE) * 9)
    torch.testing.assert_close(kept * inv[:, None], dropout_mask(meta, 54, 37, DEVICE), rtol=0, atol=0)
    assert bool((bits[18:27] == -1).all())  # slot 1 (p = 0, rows 2-2, tokens 18-26): every bit set


@pytest.mark.parametrize("dropout", [False, True])
def test_weight_gradients_added_into_given_buffers(dropout: bool) -> None:
    """``grads``: the kernels add d a_cat and d bt_cat into the given buffers (as AccumulateGrad would add them
    to existing gradients) and autograd gets none for them; the rest of the backward is unchanged."""
    n_rows, ranks, seq, d_in, d_out = (2, 0, 3, 1), (16, 4, 1, 3), 13, 67, 45
    tensors = _tensors(n_rows, ranks, seq, d_in, d_out)
    layout, lr = _layout(n_rows, ranks, seq, dropout)
    b = tensors[0].shape[0]
    meta = build_meta(layout, lr, b * seq, seq, DEVICE)
    dy = torch.randn((b * seq, d_out), generator=torch.Generator().manual_seed(2)).to(DEVICE)
    before = (torch.randn_like(tensors[2]), torch.randn_like(tensors[3]))  # gradients already there
    runs = []
    for direct in (False, True):
        x, base, a, bt = (t.clone().view(b * seq, -1).requires_grad_() if i < 2 else t.clone().requires_grad_()
                          for i, t in enumerate(tensors))
        grads = tuple(g.clone() for g in before) if direct else None
        PackedLoRAFunction.apply(x, base, None, None, a, bt, meta, grads).backward(dy)
        if direct:
            assert a.grad is None and bt.grad is None
            runs.append((x.grad, base.grad, *grads))
        else:
            runs.append((x.grad, base.grad, before[0] + a.grad, before[1] + bt.grad))
    for got, want in zip(runs[1], runs[0], strict=True):
        assert torch.equal(got, want)


def test_meta_tables_shared_by_layers() -> None:
    """Every layer of a step reuses one set of device tables (no host work or copy per layer); only the layer id,
    a kernel argument, differs."""
    layout, lr = _layout((2, 0, 3), (4, 2, 8), 5, dropout=True)
    first = build_meta(layout, lr, 25, 5, DEVICE)
    other = build_meta(layout, lr._replace(layer_id=9), 25, 5, DEVICE)
    assert other.seg_int is first.seg_int and other.tiles is first.tiles and (first.layer_id, other.layer_id) == (3, 9)
    with pytest.raises(ValueError, match="dropout"):
        build_meta(layout._replace(dropout=(1.0, 0.0, 0.0)), lr, 25, 5, DEVICE)


def test_deterministic() -> None:
    """Two runs give bit-identical outputs and gradients (no atomics anywhere)."""
    n_rows, ranks, seq, d_in, d_out = CASES[4]
    tensors = _tensors(n_rows, ranks, seq, d_in, d_out)
    layout, lr = _layout(n_rows, ranks, seq, dropout=True)
    runs = []
    for _ in range(2):
        leaves = [t.clone().requires_grad_() for t in tensors]
        y = packed_lora_eval(*leaves, layout, lr, impl="triton")
        y.backward(torch.ones_like(y))
        runs.append([y.detach()] + [t.grad for t in leaves])
    for first, second in zip(*runs, strict=True):
        assert torch.equal(first, second)


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE.type != "cuda", reason="needs CUDA (compiled Triton)")
class TestGPU:
    """bf16 activations on the H200: loose tolerances, realistic shapes, and a speed smoke test."""

    @staticmethod
    def _problem(n_slots, rows, seq, d_in, d_out, ranks, dtype, dropout):
        g = torch.Generator().manual_seed(0)
        n_rows = (rows,) * n_slots
        layout, lr = _layout(n_rows, ranks, seq, dropout)
        layout = layout._replace(dropout=tuple(0.1 * (i % 2) for i in range(n_slots)) if dropout else layout.dropout)
        b = rows * n_slots
        x = torch.randn((b, seq, d_in), generator=g).to("cuda", dtype)
        base = torch.randn((b, seq, d_out), generator=g).to("cuda", dtype)
        a_cat = (torch.randn((sum(ranks), d_in), generator=g) / d_in**0.5).cuda()
        bt_cat = (torch.randn((sum(ranks), d_out), generator=g) / 4).cuda()
        return [x, base, a_cat, bt_cat], layout, lr

    @pytest.mark.parametrize("dropout", [False, True])
    def test_bf16_matches_fp32_loop(self, dropout: bool) -> None:
        ranks = (8, 16, 32, 64, 16, 8, 1, 3)
        tensors, layout, lr = self._problem(8, 2, 257, 1024, 1536, ranks, torch.bfloat16, dropout)
        ours = [t.clone().requires_grad_() for t in tensors]
        y = packed_lora_eval(*ours, layout, lr, impl="triton")
        dy = torch.randn_like(y)
        y.backward(dy)
        ref = [t.float().requires_grad_() for t in tensors]
        y_ref = loop_with_mask(*ref, layout, lr, _mask(layout, lr, tensors[0]))
        y_ref.backward(dy.float())
        for got, want in zip([y] + [t.grad for t in ours], [y_ref] + [t.grad for t in ref], strict=True):
            err = ((got.float() - want.float()).norm() / want.float().norm()).item()
            assert err < 2e-2, err  # bf16 inputs and outputs: ~3 significant digits; tf32 dots on the fp32 H

    @pytest.mark.parametrize("dropout", [False, True])
    def test_expand_operand_cast_keeps_bits(self, dropout: bool) -> None:
        """The Function casts the fp32 expand weights to bf16 once; the kernel casting them per tile gives the
        same bits, with and without the dropout epilogue."""
        from lora_sweep.kernels.triton_lora import _expand_operand

        (x, base, a_cat, bt_cat), layout, lr = self._problem(4, 2, 96, 256, 320, (16, 8, 1, 40), torch.bfloat16,
                                                             dropout)
        meta = build_meta(layout, lr, 8 * 96, 96, x.device)
        h = seg_shrink(x.view(-1, 256), a_cat, meta, dropout=True)
        cast = _expand_operand(bt_cat, x.dtype)
        assert cast.dtype == torch.bfloat16
        for drop in (False, True):
            want = seg_expand_add(h, bt_cat, meta, torch.empty_like(base.view(-1, 320)), src=None, dropout=drop)
            got = seg_expand_add(h, cast, meta, torch.empty_like(want), src=None, dropout=drop)
            assert torch.equal(got, want)

    def test_speed_smoke(self) -> None:
        """LoRA op alone, fwd+bwd, T=16384, 4096->4096, 8 slots r=16 bf16: Triton vs the masked-dense torch path."""
        tensors, layout, lr = self._problem(8, 4, 512, 4096, 4096, (16,) * 8, torch.bfloat16, dropout=False)
        leaves = [t.clone().requires_grad_() for t in tensors]
        dy = torch.randn_like(tensors[1])

        def step(impl: str) -> None:
            packed_lora_eval(*leaves, layout, lr, impl=impl).backward(dy)

        times = {}
        for impl in ("triton", "torch"):
            for _ in range(3):
                step(impl)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(20):
                step(impl)
            end.record()
            torch.cuda.synchronize()
            times[impl] = start.elapsed_time(end) / 20
        print(f"packed LoRA fwd+bwd ms: {times}")
        assert times["triton"] < 1.5 * times["torch"], times


def test_philox_is_tl_philox(tmp_path: Path) -> None:
    """The kernels' spelled-out Philox gives the bits of ``tl.philox`` / ``tl.randint4x`` (run where those are
    callable: a fresh process with TRITON_INTERPRET=1 set before triton is imported, or compiled on CUDA)."""
    script = tmp_path / "philox.py"  # @triton.jit needs its source in a file
    script.write_text(f"""
import os
if not {DEVICE.type == "cuda"}:
    os.environ["TRITON_INTERPRET"] = "1"
import torch, triton, triton.language as tl
from lora_sweep.kernels.triton_dropout import philox

@triton.jit
def both(out_ptr, offs_ptr, seed, stream):
    i = tl.arange(0, 64)
    offs = tl.load(offs_ptr + i)
    a0, a1, a2, a3 = tl.philox(seed, offs.to(tl.uint32), (offs >> 32).to(tl.uint32), stream + 0 * i, 0 * i)
    if stream == 0:
        a0, a1, a2, a3 = tl.randint4x(seed, offs)
    b0, b1, b2, b3 = philox(seed, offs, stream)
    bad = (a0 != b0).to(tl.int32) + (a1 != b1).to(tl.int32) + (a2 != b2).to(tl.int32) + (a3 != b3).to(tl.int32)
    tl.store(out_ptr + i, bad + (a0 == a1).to(tl.int32))

dev = "{DEVICE.type}"
offs = torch.cat([torch.arange(32), torch.randint(0, 2**62, (32,))]).to(dev)
for seed in (0, 12345, 2**40 + 7, 2**63 - 1):
    for stream in (0, 1, 7):
        out = torch.ones(64, dtype=torch.int32, device=dev)
        both[(1,)](out, offs, seed, stream)
        assert not out.any(), (seed, stream, out)
print("ok")
""")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT)
    out = subprocess.run([sys.executable, str(script)], cwd=ROOT, capture_output=True, text=True, env=env)
    assert out.stdout.strip() == "ok", out.stderr[-2000:]
