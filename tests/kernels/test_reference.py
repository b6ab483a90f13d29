"""The reference packed-LoRA ops: the loop is checked by gradcheck and by hand, the masked-dense path
against the loop (outputs and every gradient), on shapes that break masking."""

from __future__ import annotations

import pytest
import torch

from lora_sweep.kernels.ops import IMPLS, LayerRanks, PackLayout, packed_lora_eval
from lora_sweep.kernels.reference import lora_loop, lora_masked_dense

# (rows per slot, ranks): one slot, odd sizes, rank 1, an empty segment, a slot skipping the layer
CASES = [
    ((3,), (4,)),
    ((2, 1, 3), (1, 3, 8)),
    ((2, 0, 3, 1), (16, 4, 1, 2)),
    ((1, 2, 2), (5, 0, 3)),
]


def _inputs(n_rows, ranks, dtype=torch.float64, seq=7, d_in=11, d_out=13, dropout=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    b = sum(n_rows)
    x = torch.randn((b, seq, d_in), generator=g, dtype=dtype, requires_grad=True)
    base = torch.randn((b, seq, d_out), generator=g, dtype=dtype, requires_grad=True)
    a_cat = torch.randn((sum(ranks), d_in), generator=g, dtype=dtype, requires_grad=True)
    bt_cat = torch.randn((sum(ranks), d_out), generator=g, dtype=dtype, requires_grad=True)
    starts = tuple(sum(n_rows[:i]) for i in range(len(n_rows)))
    drop = dropout or (0.0,) * len(n_rows)
    own = tuple(seq - (i % 3) for i in range(len(n_rows)))
    layout = PackLayout(tuple(range(10, 10 + len(n_rows))), starts, tuple(n_rows), own, drop,
                        tuple(100 + i for i in range(len(n_rows))))
    ranks_ = LayerRanks(tuple(ranks), tuple(0.5 + i for i in range(len(ranks))), layer_id=3)
    return x, base, a_cat, bt_cat, layout, ranks_


@pytest.mark.parametrize(("n_rows", "ranks"), CASES)
def test_loop_matches_hand_formula(n_rows, ranks) -> None:
    x, base, a_cat, bt_cat, layout, lr = _inputs(n_rows, ranks)
    y = lora_loop(x, base, a_cat, bt_cat, layout, lr)
    off = 0
    for g, (r0, n) in enumerate(zip(layout.row_start, layout.n_rows, strict=True)):
        r = lr.rank[g]
        a, bt = a_cat[off:off + r], bt_cat[off:off + r]
        expected = base[r0:r0 + n] + lr.scale[g] * x[r0:r0 + n] @ a.T @ bt if r else base[r0:r0 + n]
        torch.testing.assert_close(y[r0:r0 + n], expected)
        off += r


@pytest.mark.parametrize(("n_rows", "ranks"), CASES[:3])
def test_loop_gradcheck(n_rows, ranks) -> None:
    x, base, a_cat, bt_cat, layout, lr = _inputs(n_rows, ranks, seq=3, d_in=4, d_out=5)
    assert torch.autograd.gradcheck(lambda *t: lora_loop(*t, layout, lr), (x, base, a_cat, bt_cat))


@pytest.mark.parametrize("dropout", [False, True])
@pytest.mark.parametrize(("n_rows", "ranks"), CASES)
def test_dense_equals_loop_outputs_and_grads(n_rows, ranks, dropout: bool) -> None:
    drop = tuple(0.25 * (i % 2) for i in range(len(n_rows))) if dropout else None
    tensors = _inputs(n_rows, ranks, dtype=torch.float32, dropout=drop)
    layout, lr = tensors[4], tensors[5]
    grads = []
    for fn in (lora_loop, lora_masked_dense):
        leaves = [t.detach().clone().requires_grad_() for t in tensors[:4]]
        y = fn(*leaves, layout, lr)
        dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(1))
        y.backward(dy)
        grads.append([y.detach()] + [t.grad for t in leaves])
    for ours, ref in zip(grads[1], grads[0], strict=True):
        # fp32: dense sums zeros of other slots' columns, so only rounding of the same terms differs
        torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)


def test_dropout_masks_depend_on_slot_seed_and_layer_only() -> None:
    x, base, a_cat, bt_cat, layout, lr = _inputs((2, 3), (2, 4), dtype=torch.float32, dropout=(0.5, 0.5))
    y1 = lora_loop(x, base, a_cat, bt_cat, layout, lr)
    # the second slot alone, same seed: identical rows
    alone = PackLayout(layout.slots[1:], (0,), layout.n_rows[1:], layout.own_len[1:], (0.5,), layout.seed[1:])
    y2 = lora_loop(x[2:], base[2:], a_cat[2:], bt_cat[2:], alone, LayerRanks(lr.rank[1:], lr.scale[1:], 3))
    torch.testing.assert_close(y1[2:], y2)
    other_layer = lora_loop(x, base, a_cat, bt_cat, layout, lr._replace(layer_id=4))
    assert not torch.allclose(other_layer, y1)


def test_unknown_impl_rejected() -> None:
    x, base, a_cat, bt_cat, layout, lr = _inputs((1,), (2,))
    assert set(IMPLS) == {"torch", "loop", "triton", "auto"}
    with pytest.raises(ValueError, match="impl"):
        packed_lora_eval(x, base, a_cat, bt_cat, layout, lr, impl="cuda-magic")  # type: ignore[arg-type]
