"""DoRA's column rescale on the Triton kernels (``kernels.triton_dora``) against the same formula in torch with
autograd: the output, the input's gradient and the magnitudes' gradient it adds into its buffer; a plain slot's rows
pass through bit for bit. Runs compiled on a GPU, in the interpreter elsewhere (``tests/kernels/conftest.py``)."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import need_triton

need_triton()

from lora_sweep.kernels import ops  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _reference(y: torch.Tensor, m: torch.Tensor, norm: torch.Tensor, on: torch.Tensor, bias: torch.Tensor | None,
               dout: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """out, dy and dm by autograd, in fp64: ``out = y + (r - 1)(y - b)``, r = m / n on a DoRA slot, 1 elsewhere."""
    c = m.shape[0]
    y64 = y.double().requires_grad_()
    m64 = m.double().requires_grad_()
    dora = on[:, None] > 0
    r = torch.where(dora, m64 / norm.double(), torch.ones_like(m64))  # (C, D)
    b = torch.zeros(y.shape[1], dtype=torch.float64, device=y.device) if bias is None else bias.double()
    rows = y.shape[0] // c
    out = y64 + ((r - 1).repeat_interleave(rows, dim=0)) * (y64 - b)
    out.backward(dout.double())
    return out.detach(), y64.grad, m64.grad  # type: ignore[return-value]


@pytest.mark.parametrize(("capacity", "rows", "d", "bias", "dtype"), [
    (3, 37, 150, True, torch.float32),  # neither a multiple of the tile; one program per slot and column block
    (2, 300, 64, False, torch.float32),  # several programs per slot (the row split), partial sums added in order
    pytest.param(4, 512, 576, True, torch.bfloat16, marks=pytest.mark.gpu),  # SmolLM2's width, the model dtype
])
def test_the_rescale_equals_autograd_on_the_formula(capacity: int, rows: int, d: int, bias: bool,
                                                    dtype: torch.dtype) -> None:
    if DEVICE == "cpu" and dtype != torch.float32:
        pytest.skip("the interpreter runs fp32")
    gen = torch.Generator().manual_seed(0)
    y = torch.randn(capacity * rows, d, generator=gen).to(DEVICE, dtype)
    dout = torch.randn(capacity * rows, d, generator=gen).to(DEVICE, dtype)
    m = (1 + torch.rand(capacity, d, generator=gen)).to(DEVICE)
    norm = (1 + torch.rand(capacity, d, generator=gen)).to(DEVICE)
    on = torch.tensor([1.0] + [0.0, 1.0, 1.0][:capacity - 1], device=DEVICE)  # slot 1 plain
    b = torch.randn(d, generator=gen).to(DEVICE, dtype) if bias else None
    dora = on[:, None] > 0
    ratio = torch.where(dora, m / norm, torch.ones_like(m))
    gain = torch.where(dora, 1 / norm, torch.zeros_like(m))
    grad0 = torch.randn(capacity, d, generator=gen).to(DEVICE)
    grad = grad0.clone()

    y_in = y.clone().requires_grad_()
    out = ops.dora_scale(y_in, ratio, gain, b, grad)
    out.backward(dout)
    want_out, want_dy, want_dm = _reference(y, m, norm, on, b, dout)

    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(out.double(), want_out, **tol)
    torch.testing.assert_close(y_in.grad.double(), want_dy, **tol)
    # the sum over a slot's rows: fp32 accumulation of `rows` products
    torch.testing.assert_close((grad - grad0).double(), want_dm, rtol=1e-4, atol=1e-4 * rows ** 0.5)
    plain = slice(rows, 2 * rows)
    assert torch.equal(out[plain], y[plain]), "a plain slot's rows must pass through unchanged"
    assert torch.equal(y_in.grad[plain], dout[plain]), "a plain slot's gradient must pass through unchanged"
    assert torch.equal(grad[1], grad0[1]), "a plain slot's magnitudes get no gradient"


@pytest.mark.parametrize("bias", [True, False])
def test_the_rescale_with_dropout_subtracts_e_on_its_slots_only(bias: bool) -> None:
    """``out = y + (r - 1)(y - b - e)`` with e on two of four slots (blocks in the opposite order), against autograd:
    out, dy, de and dm; a DoRA slot without a block of e is the plain rescale."""
    capacity, rows, d = 4, 45, 130
    gen = torch.Generator().manual_seed(2)
    y, dout = (torch.randn(capacity * rows, d, generator=gen) for _ in range(2))
    e = torch.randn(2 * rows, d, generator=gen)
    pos = torch.tensor([-1, 1, -1, 0], dtype=torch.int32)  # slot 3 owns block 0, slot 1 block 1; slot 2 plain
    m, norm = (1 + torch.rand(capacity, d, generator=gen) for _ in range(2))
    on = torch.tensor([1.0, 1.0, 0.0, 1.0])
    b = torch.randn(d, generator=gen) if bias else None
    dora = on[:, None] > 0
    ratio, gain = torch.where(dora, m / norm, torch.ones_like(m)), torch.where(dora, 1 / norm, torch.zeros_like(m))
    grad = torch.zeros(capacity, d, device=DEVICE)
    y_in, e_in = y.clone().to(DEVICE).requires_grad_(), e.clone().to(DEVICE).requires_grad_()
    out = ops.dora_scale(y_in, ratio.to(DEVICE), gain.to(DEVICE), None if b is None else b.to(DEVICE), grad,
                         (e_in, pos.to(DEVICE)))
    out.backward(dout.to(DEVICE))

    y64, e64, m64 = (t.double().requires_grad_() for t in (y, e, m))
    r = torch.where(dora, m64 / norm.double(), torch.ones_like(m64)).repeat_interleave(rows, dim=0)
    full = torch.zeros(capacity * rows, d, dtype=torch.float64)
    full = full.index_add(0, torch.arange(rows) + 3 * rows, e64[:rows]).index_add(0, torch.arange(rows) + rows,
                                                                                    e64[rows:])
    want = y64 + (r - 1) * (y64 - (0 if b is None else b.double()) - full)
    want.backward(dout.double())
    tol = dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.cpu().double(), want.detach(), **tol)
    torch.testing.assert_close(y_in.grad.cpu().double(), y64.grad, **tol)
    torch.testing.assert_close(e_in.grad.cpu().double(), e64.grad, **tol)
    torch.testing.assert_close(grad.cpu().double(), m64.grad, rtol=1e-4, atol=1e-4 * rows ** 0.5)
    assert e64.grad.abs().min() > 0 and m64.grad[0].abs().max() > 0  # both blocks and slot 0 (no block) take part


def test_dropped_part_is_x_times_one_minus_the_kernels_multiplier() -> None:
    """``ops.dropped_part``: the selected slots' tokens of ``x (1 - M / (1 - p))`` with the bits the packed LoRA
    applies (``dropout_bits``; the multiplier as ``dropout_mask`` materialises it), in ``sel``'s order; its gradient
    the same factor, scattered back, zero on every other slot's tokens."""
    from lora_sweep.kernels.ops import SEG_FLT_COL, SEG_INT_COL, segment_meta
    from lora_sweep.kernels.triton_dropout import dropout_mask

    capacity, rows, seq, d = 3, 2, 20, 70
    meta = segment_meta(capacity, rows, seq, 16, torch.device(DEVICE), dropout=True)
    meta.seg_int[:, SEG_INT_COL.rank] = 4
    meta.seg_int[:, SEG_INT_COL.seed] = torch.tensor([5, 6, 7])
    p = torch.tensor([0.3, 0.0, 0.5])
    meta.seg_flt[:, SEG_FLT_COL.p], meta.seg_flt[:, SEG_FLT_COL.inv_keep] = p, 1 / (1 - p)
    meta = meta._replace(layer_id=3, has_dropout=True)
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(capacity * rows * seq, d, generator=gen).to(DEVICE).requires_grad_()
    sel = torch.tensor([2, 0], device=DEVICE)
    part = ops.dropped_part(x, ops.dropout_bits(meta, x), meta, sel, capacity)
    up = torch.randn(part.shape, generator=gen).to(DEVICE)
    (part * up).sum().backward()
    keep = 1 - dropout_mask(meta, x.shape[0], d, x.device)  # (T, D)
    tok = rows * seq
    for i, g in enumerate(sel.tolist()):
        own = slice(g * tok, (g + 1) * tok)
        torch.testing.assert_close(part[i * tok:(i + 1) * tok], x.detach()[own] * keep[own], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(x.grad[own], up[i * tok:(i + 1) * tok] * keep[own], rtol=1e-6, atol=1e-6)
        assert abs((keep[own] == 1).float().mean().item() - float(p[g])) < 0.05  # x - drop(x) = x where dropped
    assert torch.equal(x.grad[tok:2 * tok], torch.zeros(tok, d, device=DEVICE))


def test_tokens_that_do_not_split_into_the_slots_are_refused() -> None:
    ratio = torch.ones(3, 8, device=DEVICE)
    with pytest.raises(ValueError, match=r"dora_scale: y \(10, 8\) must be \(C \* rows, D\)"):
        ops.dora_scale(torch.zeros(10, 8, device=DEVICE), ratio, ratio, None, torch.zeros(3, 8, device=DEVICE))


@pytest.mark.parametrize(("capacity", "rb", "d_in", "d_out"), [(3, 16, 40, 70), (2, 32, 64, 130)])
def test_the_factors_equal_the_reference_norm_per_slot(capacity: int, rb: int, d_in: int, d_out: int) -> None:
    """``dora_factors`` against ``kernels.reference.dora_norm`` slot by slot: rank padding rows zero, a plain slot's
    ratio 1 and gain 0 exactly."""
    from lora_sweep.kernels.reference import dora_norm

    gen = torch.Generator().manual_seed(1)
    w = torch.randn(d_out, d_in, generator=gen)
    a = torch.randn(capacity, rb, d_in, generator=gen) / d_in ** 0.5
    bt = torch.randn(capacity, rb, d_out, generator=gen) / 4
    ranks = [rb, rb // 2, 3][:capacity]
    for g, r in enumerate(ranks):
        a[g, r:], bt[g, r:] = 0.0, 0.0
    scale = torch.tensor([0.5, 2.0, 1.0][:capacity])
    m = 1 + torch.rand(capacity, d_out, generator=gen)
    on = torch.tensor([1.0, 0.0, 1.0][:capacity])
    dev = [t.to(DEVICE) for t in (w, a, bt, m, on, scale)]
    wd, ad, btd, md, ond, sd = dev
    ratio, gain = ops.dora_factors(ad.reshape(-1, d_in) @ wd.T, btd.reshape(-1, d_out), ad @ ad.transpose(1, 2),
                                   wd.square().sum(dim=1), md, ond, sd)
    for g in range(capacity):
        if on[g] > 0:
            n = dora_norm(w.double(), a[g].double(), bt[g].double(), float(scale[g]))
            torch.testing.assert_close(gain[g].cpu().double(), 1 / n, rtol=1e-5, atol=0)
            torch.testing.assert_close(ratio[g].cpu().double(), m[g].double() / n, rtol=1e-5, atol=0)
        else:
            assert torch.equal(ratio[g].cpu(), torch.ones(d_out)) and torch.equal(gain[g].cpu(), torch.zeros(d_out))
