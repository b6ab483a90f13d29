"""The pack's optimizer kernels (``kernels.triton_adamw``) against torch, slot by slot, in float64.

CPU: the Triton interpreter (conftest.py). GPU: the same test compiled.
"""

from __future__ import annotations

import math
import os

import torch

from tests.conftest import need_triton

need_triton()  # before anything imports the Triton kernel modules

from lora_sweep.kernels.ops import segmented_adamw_, segmented_sumsq  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = torch.device("cuda" if torch.cuda.is_available() and not INTERPRET else "cpu")


def _layout(widths: list[int], capacity: int, bucket: int) -> tuple[torch.Tensor, int]:
    """(S, 3) segments (offset, width, B^T) of a layer-major buffer, A and B^T alternating, and its size."""
    segs, off = [], 0
    for k, d in enumerate(widths):
        segs.append((off, d, k % 2))
        off += capacity * bucket * d
    return torch.tensor(segs, dtype=torch.int64), off


def test_sumsq_and_adamw_match_torch_per_slot() -> None:
    gen = torch.Generator().manual_seed(0)
    capacity, bucket, widths = 5, 16, [40, 13, 1100, 7]  # 1100: a slot's block spans several programs' strides
    ranks = torch.tensor([3, 0, 16, 9, 5])  # slot 1 free; slot 4 accumulates (a no-op step keeping its gradient)
    segs, total = _layout(widths, capacity, bucket)
    live = torch.zeros(total, dtype=torch.bool)  # the values a slot of that rank owns
    for (off, d, _) in segs.tolist():
        for g, r in enumerate(ranks.tolist()):
            live[off + g * bucket * d:off + (g * bucket + r) * d] = True
    p, m = (torch.randn(total, generator=gen) for _ in range(2))
    v = torch.rand(total, generator=gen)
    grad = torch.randn(total, generator=gen) * live
    # the last two columns: B's decay and step size (LoRA+: slots 0 and 3 give B 16x and 4x A's learning rate)
    opt = torch.tensor([[1 - 1e-3 * 0.1, 0.1, 0.999, 1e-3, math.sqrt(1 - 0.999 ** 3), 1e-8, -2e-3, 1.0, 0.0,
                         1 - 16e-3 * 0.1, -32e-3],
                        [1.0, 0.0, 1.0, 0.0, 1.0, 1.0, 0.0, math.inf, 0.0, 1.0, 0.0],
                        [1.0, 0.2, 0.95, 0.05, math.sqrt(1 - 0.95 ** 7), 1e-6, -5e-3, 0.5, 0.0, 1.0, -5e-3],
                        [1 - 1e-2, 0.6, 0.9, 0.1, 0.3, 1e-8, -1e-2, math.inf, 0.0, 1 - 4e-2, -4e-2],
                        [1.0, 0.0, 1.0, 0.0, 1.0, 1.0, 0.0, math.inf, 1.0, 1.0, 0.0]])
    coef = torch.tensor([0.5, 1.0, 0.25, 1.0, 1.0])
    slot = torch.zeros(total, dtype=torch.long)
    is_b = torch.zeros(total, dtype=torch.bool)  # the values of a B^T segment
    for (off, d, b) in segs.tolist():
        is_b[off:off + capacity * bucket * d] = bool(b)
        for g in range(capacity):
            slot[off + g * bucket * d:off + (g + 1) * bucket * d] = g

    dev = [t.to(DEVICE, copy=True) for t in (p, grad, m, v)]
    sq = segmented_sumsq(dev[1], segs.to(DEVICE), ranks.to(DEVICE), bucket)
    want_sq = torch.zeros(capacity, dtype=torch.float64).index_add(0, slot, grad.double() ** 2)
    torch.testing.assert_close(sq.cpu().double(), want_sq, rtol=1e-5, atol=0)

    segmented_adamw_(*dev, segs.to(DEVICE), ranks.to(DEVICE), coef.to(DEVICE), opt.to(DEVICE), bucket)
    o = opt.double()[slot]
    g = grad.double() * coef.double()[slot]
    m_ref = m.double() + o[:, 1] * (g - m.double())
    v_ref = v.double() * o[:, 2] + o[:, 3] * g * g
    decay, step = torch.where(is_b, o[:, 9], o[:, 0]), torch.where(is_b, o[:, 10], o[:, 6])
    p_ref = p.double() * decay + m_ref / (v_ref.sqrt() / o[:, 4] + o[:, 5]) * step
    out_p, out_g, out_m, out_v = (t.cpu() for t in dev)
    torch.testing.assert_close(out_p[live].double(), p_ref[live], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out_m[live].double(), m_ref[live], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out_v[live].double(), v_ref[live], rtol=1e-5, atol=1e-6)
    stepped = live & (slot != 4)
    assert out_g[stepped].count_nonzero() == 0, "gradients are zeroed"
    kept = live & (slot == 4)
    assert kept.any() and torch.equal(out_g[kept], grad[kept]), "an accumulating slot keeps its gradient"
    for before, after in ((p, out_p), (m, out_m), (v, out_v)):  # and its no-op step moves nothing
        assert torch.equal(before[kept], after[kept])
    for before, after in ((p, out_p), (m, out_m), (v, out_v)):  # past a slot's rank, and the free slot: untouched
        assert torch.equal(before[~live], after[~live])
