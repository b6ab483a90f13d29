"""The fused RoPE (``kernels.triton_rope``) against the eager formula (``kernels.reference.rope``, transformers'
``apply_rotary_pos_emb``): the same bits forward and backward, the layouts of its results, one launch each way.

CPU: the kernel runs in the Triton interpreter (conftest.py) in fp32, bf16 and fp16 (no ``tl.dot``; the kernel
rounds to bf16 by its bits, so the interpreter's truncating bf16 cast never decides a value). GPU: the same tests
compiled, plus the ``gpu`` class at the SmolLM2 step's shape.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.conftest import need_triton

need_triton()  # before anything imports the Triton kernel modules

from lora_sweep.kernels import ops, reference  # noqa: E402
from tests.conftest import record_launches  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = torch.device("cuda" if torch.cuda.is_available() and not INTERPRET else "cpu")
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# (B, H, Hk, L, d, cos batch): GQA with odd batch and length; H == Hk with a non-power-of-2 half; MQA at one
# position (a decode step), cos broadcast over the batch; several token blocks; no positions
SHAPES = [(3, 4, 2, 5, 16, 3), (1, 3, 3, 7, 6, 1), (5, 6, 1, 1, 8, 1), (2, 2, 1, 67, 4, 2), (2, 4, 2, 0, 8, 2)]
IDS = ["gqa-odd", "mha-half3", "mqa-decode", "blocks", "empty"]


def _randn(*shape: int, dtype: torch.dtype, seed: int, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * scale).to(DEVICE, dtype)


def _projections(b: int, h: int, hk: int, seq: int, d: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """q, k as the attention makes them, transposed views of (B, L, heads * d) leaves; and the leaves."""
    qp = _randn(b, seq, h * d, dtype=dtype, seed=0, scale=3.0).requires_grad_()
    kp = _randn(b, seq, hk * d, dtype=dtype, seed=1, scale=3.0).requires_grad_()
    return qp.view(b, seq, h, d).transpose(1, 2), kp.view(b, seq, hk, d).transpose(1, 2), qp, kp


def _table(bc: int, seq: int, d: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin (Bc, L, d) as transformers' rotary module builds them: one frequency per pair, repeated."""
    pos = torch.arange(seq, dtype=torch.float32)[None, :, None] + torch.arange(bc)[:, None, None] * 3
    freqs = pos / (10.0 ** (torch.arange(d // 2, dtype=torch.float32) / max(1, d // 2)))
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(DEVICE, dtype), emb.sin().to(DEVICE, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize(("b", "h", "hk", "seq", "d", "bc"), SHAPES, ids=IDS)
def test_rope_is_bit_exact_with_eager(b: int, h: int, hk: int, seq: int, d: int, bc: int,
                                      dtype: torch.dtype) -> None:
    q, k, qp, kp = _projections(b, h, hk, seq, d, dtype)
    cos, sin = _table(bc, seq, d, dtype)
    got = ops.rope(q, k, cos, sin, impl="triton")
    want = reference.rope(q, k, cos, sin)
    for g, w, x in zip(got, want, (q, k), strict=True):
        assert g.dtype == w.dtype and g.shape == w.shape and g.stride() == x.stride()
        assert torch.equal(g, w)
    dq_out = _randn(b, h, seq, d, dtype=dtype, seed=2)
    dk_out = _randn(b, hk, seq, d, dtype=dtype, seed=3).transpose(1, 2).contiguous().transpose(1, 2)  # strided
    grads = torch.autograd.grad(got, (qp, kp), (dq_out, dk_out))
    wants = torch.autograd.grad(want, (qp, kp), (dq_out, dk_out))
    for g, w in zip(grads, wants, strict=True):
        assert torch.equal(g, w)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16", "fp16"])
def test_the_backward_is_autograds_of_the_eager_formula(dtype: torch.dtype) -> None:
    """The closed form the kernel computes, dx = (rnd(rnd(g1 c1) + rnd(g2 s2)), rnd(rnd(g2 c2) - rnd(g1 s1))),
    is what autograd of ``q * cos + rotate_half(q) * sin`` gives, bit for bit, with cos halves that differ."""
    b, h, seq, d = 2, 3, 5, 8
    q = _randn(b, h, seq, d, dtype=dtype, seed=0, scale=3.0).requires_grad_()
    cos, sin = _randn(b, seq, d, dtype=dtype, seed=1), _randn(b, seq, d, dtype=dtype, seed=2)
    g = _randn(b, h, seq, d, dtype=dtype, seed=3)
    (want,) = torch.autograd.grad(reference.rope(q, q[:, :1], cos, sin)[0], q, g)
    c, s, half = cos.unsqueeze(1), sin.unsqueeze(1), d // 2
    g1, g2, c1, c2, s1, s2 = g[..., :half], g[..., half:], c[..., :half], c[..., half:], s[..., :half], s[..., half:]
    closed = torch.cat((g1 * c1 + g2 * s2, g2 * c2 - g1 * s1), dim=-1)  # each op rounds once, in the io dtype
    assert torch.equal(want, closed)
    k = q.detach()[:, :1].requires_grad_()
    (got,) = torch.autograd.grad(ops.rope(q, k, cos, sin, impl="triton")[0], q, g)
    assert torch.equal(got, closed)


def test_results_and_gradients_keep_the_operands_layouts() -> None:
    """Outputs ``empty_like`` their inputs and gradients carry the inputs' strides, so the attention's
    ``view(B, L, H, d).transpose(1, 2)`` backward passes them on without a copy; a contiguous (B, H, L, d) q and a
    non-dense one (a slice of a fused qkv projection) work too, the latter written dense in its dimension order (what
    ``empty_like`` makes of it)."""
    b, h, hk, seq, d = 3, 4, 2, 5, 8
    cos, sin = _table(b, seq, d, torch.float32)
    q = _randn(b, seq, h, d, dtype=torch.float32, seed=0).transpose(1, 2).requires_grad_()  # a strided leaf
    qkv = _randn(b, seq, (h + 2 * hk) * d, dtype=torch.float32, seed=1)
    k = qkv[..., h * d:(h + hk) * d].view(b, seq, hk, d).transpose(1, 2).requires_grad_()  # not dense
    got = ops.rope(q, k, cos, sin, impl="triton")
    want = reference.rope(q, k, cos, sin)
    dense_k = torch.empty_like(k).stride()
    assert dense_k != k.stride() and got[0].stride() == q.stride() and got[1].stride() == dense_k
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    grads = torch.autograd.grad(got, (q, k), (torch.ones_like(got[0]), torch.ones_like(got[1])))
    assert grads[0].stride() == q.stride() and grads[1].stride() == dense_k
    wants = torch.autograd.grad(want, (q, k), (torch.ones_like(want[0]), torch.ones_like(want[1])))
    assert all(torch.equal(g, w) for g, w in zip(grads, wants, strict=True))


def test_one_launch_each_way_and_no_gradient_for_what_does_not_ask(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = record_launches(monkeypatch)
    q, k, qp, _ = _projections(2, 4, 2, 3, 8, torch.float32)
    k = k.detach()  # a key side that needs no gradient
    cos, sin = _table(1, 3, 8, torch.float32)
    q_out, k_out = ops.rope(q, k, cos, sin, impl="triton")
    assert len(calls) == 1
    (q_out.sum() + k_out.sum()).backward()
    assert len(calls) == 2 and {v[0] for _, v in calls} == {"_rope_kernel"}
    assert qp.grad is not None and not k.requires_grad


def test_operands_the_kernel_does_not_take_are_refused() -> None:
    """Where eager would broadcast, promote or differentiate cos, the kernel says so instead of computing
    something else (``packer.model.fuse`` falls back to eager on these)."""
    q, k, _, _ = _projections(2, 4, 2, 3, 8, torch.float32)
    cos, sin = _table(2, 3, 8, torch.float32)
    assert ops.rope_problem(q, k, cos, sin) is None
    bad = {"promotes": (q, k, cos.double(), sin.double()), "dtype": (q, k, cos.to(torch.bfloat16), sin),
           "odd d": (q[..., :7], k[..., :7], cos[..., :7], sin[..., :7]), "length": (q, k, cos[:, :2], sin[:, :2]),
           "batch": (q, k, torch.cat([cos] * 2), torch.cat([sin] * 2)), "rank": (q, k, cos[:, None], sin[:, None]),
           "grad": (q, k, cos.clone().requires_grad_(), sin)}
    for name, args in bad.items():
        assert ops.rope_problem(*args), name
        with pytest.raises(ValueError, match="rope"):
            ops.rope(*args, impl="triton")


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE.type != "cuda", reason="needs CUDA (compiled Triton)")
class TestGPU:
    """Compiled on the H200 at the step's SmolLM2 shape: 128 rows x 48 tokens, 9 query heads over 3 key
    heads of 64; cos / sin from transformers' rotary module, per row (packed positions) and broadcast."""

    @pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
    @pytest.mark.parametrize("bc", [128, 1], ids=["per-row", "broadcast"])
    def test_bit_exact_with_transformers(self, dtype: torch.dtype, bc: int) -> None:
        from transformers import LlamaConfig
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

        b, h, hk, seq, d = 128, 9, 3, 48, 64
        config = LlamaConfig(hidden_size=h * d, num_attention_heads=h, num_key_value_heads=hk, rope_theta=100000.0)
        rotary = LlamaRotaryEmbedding(config).to(DEVICE)
        q, k, qp, kp = _projections(b, h, hk, seq, d, dtype)
        positions = torch.randint(0, 2048, (bc, seq), generator=torch.Generator().manual_seed(4)).to(DEVICE)
        cos, sin = rotary(qp, positions)
        got = ops.rope(q, k, cos, sin, impl="triton")
        want = apply_rotary_pos_emb(q, k, cos, sin)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        dq_out, dk_out = _randn(b, h, seq, d, dtype=dtype, seed=2), _randn(b, hk, seq, d, dtype=dtype, seed=3)
        grads = torch.autograd.grad(got, (qp, kp), (dq_out, dk_out))
        wants = torch.autograd.grad(want, (qp, kp), (dq_out, dk_out))
        assert all(torch.equal(g, w) for g, w in zip(grads, wants, strict=True))
