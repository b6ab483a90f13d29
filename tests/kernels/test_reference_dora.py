"""DoRA's packed reference (``kernels.reference.dora_loop``) against PEFT's ``DoraLinearLayer``, slot by slot: output
and every gradient (x, A, B, magnitude), mixed ranks and scales, a rank-0 slot, dropout; and the factored row norm
(``dora_norm``) against the direct one. The oracle the packed DoRA paths are to be tested against."""

from __future__ import annotations

import copy

import pytest
import torch
from peft import LoraConfig, get_peft_model
from torch import nn

from lora_sweep.kernels.meta import LayerRanks, PackLayout
from lora_sweep.kernels.reference import dora_loop, dora_norm, dropout_keep_mask

D_IN, D_OUT, SEQ = 24, 20, 7


class _One(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(D_IN, D_OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x)


def _peft_slot(base: nn.Module, rank: int, alpha: float, a: torch.Tensor, b: torch.Tensor, m: torch.Tensor):  # noqa: ANN202
    model = get_peft_model(copy.deepcopy(base), LoraConfig(r=rank, lora_alpha=alpha, target_modules=["proj"],
                                                           use_dora=True))
    layer = model.base_model.model.proj
    with torch.no_grad():
        layer.lora_A["default"].weight.copy_(a)
        layer.lora_B["default"].weight.copy_(b)
        layer.lora_magnitude_vector["default"].weight.copy_(m)
    return layer


def _peft_out(layer, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:  # noqa: ANN001
    """PEFT's Linear forward with DoRA: the base on x, the DoRA term on the dropped input (base_result recomputed
    there, as PEFT does when dropout is active)."""
    if mask is None:
        return layer(x)
    dora = layer.lora_magnitude_vector["default"]
    return layer.base_layer(x) + dora(x * mask, lora_A=layer.lora_A["default"], lora_B=layer.lora_B["default"],
                                       scaling=layer.scaling["default"], base_layer=layer.base_layer)


@pytest.mark.parametrize("dropout", [False, True])
def test_dora_loop_equals_peft_per_slot_with_gradients(dropout: bool) -> None:
    torch.manual_seed(0)
    base = _One().double()
    ranks, alphas, rows = [3, 0, 8, 1], [6.0, 1.0, 4.0, 2.0], [2, 1, 3, 2]
    p = [0.1 if dropout else 0.0, 0.0, 0.25 if dropout else 0.0, 0.0]
    layout = PackLayout(tuple(range(4)), (0, 2, 3, 6), tuple(rows), (SEQ,) * 4, tuple(p), (11, 12, 13, 14))
    lr = LayerRanks(tuple(ranks), tuple(a / r if r else 0.0 for a, r in zip(alphas, ranks, strict=True)), 5)
    gen = torch.Generator().manual_seed(1)
    a_cat = torch.randn(sum(ranks), D_IN, generator=gen, dtype=torch.float64, requires_grad=True)
    bt_cat = torch.randn(sum(ranks), D_OUT, generator=gen, dtype=torch.float64, requires_grad=True)
    mag = (torch.rand(4, D_OUT, generator=gen, dtype=torch.float64) + 0.5).requires_grad_()
    x = torch.randn(sum(rows), SEQ, D_IN, generator=gen, dtype=torch.float64, requires_grad=True)
    ours = dora_loop(x, base.proj.weight, base.proj.bias, a_cat, bt_cat, list(mag), layout, lr)
    up = torch.randn(ours.shape, generator=gen, dtype=torch.float64)
    (ours * up).sum().backward()

    off = 0
    for g, (r, alpha, r0, n) in enumerate(zip(ranks, alphas, layout.row_start, rows, strict=True)):
        xg = x.detach()[r0:r0 + n].clone().requires_grad_()
        if r == 0:
            torch.testing.assert_close(ours[r0:r0 + n], base.proj(xg))
            continue
        layer = _peft_slot(base, r, alpha, a_cat.detach()[off:off + r], bt_cat.detach()[off:off + r].T, mag.detach()[g])
        mask = dropout_keep_mask(layout, g, 5, D_IN, SEQ, x.device).double() if p[g] > 0 else None
        theirs = _peft_out(layer, xg, mask)
        (theirs * up[r0:r0 + n]).sum().backward()
        torch.testing.assert_close(ours[r0:r0 + n], theirs, rtol=1e-12, atol=1e-12)  # fp64, the same sums
        torch.testing.assert_close(x.grad[r0:r0 + n], xg.grad, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(a_cat.grad[off:off + r], layer.lora_A["default"].weight.grad, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(bt_cat.grad[off:off + r].T, layer.lora_B["default"].weight.grad, rtol=1e-10,
                                   atol=1e-12)
        torch.testing.assert_close(mag.grad[g], layer.lora_magnitude_vector["default"].weight.grad, rtol=1e-10,
                                   atol=1e-12)
        off += r
    assert mag.grad[1].count_nonzero() == 0, "a rank-0 slot's magnitude takes no gradient"


def test_a_slot_without_a_magnitude_is_plain_lora() -> None:
    from lora_sweep.kernels.reference import lora_loop

    gen = torch.Generator().manual_seed(3)
    w, bias = torch.randn(D_OUT, D_IN, generator=gen), torch.randn(D_OUT, generator=gen)
    layout = PackLayout((0, 1), (0, 2), (2, 1), (SEQ, SEQ), (0.0, 0.0), (1, 2))
    lr = LayerRanks((3, 2), (0.5, 2.0), 0)
    a_cat, bt_cat = torch.randn(5, D_IN, generator=gen), torch.randn(5, D_OUT, generator=gen)
    x = torch.randn(3, SEQ, D_IN, generator=gen)
    plain = lora_loop(x, torch.nn.functional.linear(x, w, bias), a_cat, bt_cat, layout, lr)
    torch.testing.assert_close(dora_loop(x, w, bias, a_cat, bt_cat, [None, None], layout, lr), plain)


@pytest.mark.parametrize("rank", [1, 4, 16])
def test_factored_norm_equals_the_direct_norm(rank: int) -> None:
    gen = torch.Generator().manual_seed(rank)
    w = torch.randn(D_OUT, D_IN, generator=gen, dtype=torch.float64)
    a, bt = (torch.randn(rank, d, generator=gen, dtype=torch.float64) for d in (D_IN, D_OUT))
    torch.testing.assert_close(dora_norm(w, a, bt, 0.7), torch.linalg.norm(w + 0.7 * bt.T @ a, dim=1),
                               rtol=1e-12, atol=1e-12)
