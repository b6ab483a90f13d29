"""The base's fused RMSNorm and SiLU-gated product (``kernels.triton_norm``, ``kernels.triton_swiglu``) against
``kernels.reference``: values and gradients.

CPU: the kernels run in the Triton interpreter (conftest.py), fp32 (and bf16 loads and stores, which the
interpreter gets right: no ``tl.dot`` here). GPU: the same tests compiled, plus the ``gpu`` class in bf16 at a
Llama-3-8B row width.
"""

from __future__ import annotations

import os
import threading

import pytest
import torch

from tests.conftest import need_triton

need_triton()  # before anything imports the Triton kernel modules

from lora_sweep.kernels import ops, reference  # noqa: E402
from tests.conftest import record_launches  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = torch.device("cuda" if torch.cuda.is_available() and not INTERPRET else "cpu")
# (leading shape, D): odd rows and widths, one feature, a power of 2, several rows per program (D <= 256), no rows
SHAPES = [((3, 5), 37), ((2, 7), 64), ((1, 1), 1), ((4, 33), 256), ((1, 9), 129), ((0, 3), 16)]
IDS = ["odd", "pow2", "d1", "d256", "d129", "empty"]
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}


def _randn(*shape: int, dtype: torch.dtype = torch.float32, seed: int = 0, grad: bool = True) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(DEVICE, dtype).requires_grad_(grad)


def _grads(out: torch.Tensor, inputs: tuple[torch.Tensor, ...], dy: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return torch.autograd.grad(out, inputs, dy, allow_unused=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("lead", "d"), SHAPES, ids=IDS)
def test_rms_norm_matches_the_reference(lead: tuple[int, int], d: int, dtype: torch.dtype) -> None:
    x = _randn(*lead, d, dtype=dtype) * 3 + 1  # a mean away from 0: the normalisation has work to do
    w = _randn(d, dtype=dtype, seed=1, grad=False)
    y = ops.rms_norm(x, w, 1e-5, impl="triton")
    want = reference.rms_norm(x, w, 1e-5)
    assert y.shape == want.shape and y.dtype == want.dtype
    torch.testing.assert_close(y, want, **TOL[dtype])
    if x.numel():
        dy = _randn(*lead, d, dtype=dtype, seed=2, grad=False)
        torch.testing.assert_close(_grads(y, (x,), dy)[0], _grads(want, (x,), dy)[0], **TOL[dtype])


def test_rms_norm_weight_gradient_and_promoted_dtype() -> None:
    """A weight that trains (off the packer's path, kept correct): its gradient; a fp32 weight over a bf16
    input gives a fp32 output, as the module's ``weight * x.to(input_dtype)`` does."""
    x = _randn(5, 7, 48) * 2
    w = _randn(48, seed=1) + 1
    y = ops.rms_norm(x, w, 1e-6, impl="triton")
    want = reference.rms_norm(x, w, 1e-6)
    dy = _randn(5, 7, 48, seed=2, grad=False)
    for got, ref in zip(_grads(y, (x, w), dy), _grads(want, (x, w), dy), strict=True):
        torch.testing.assert_close(got, ref, **TOL[torch.float32])
    xb = x.detach().to(torch.bfloat16)
    mixed = ops.rms_norm(xb, w.detach(), 1e-6, impl="triton")
    assert mixed.dtype == torch.float32
    # x * rstd is rounded to bf16 before the weight: an rstd one fp32 ulp apart can flip that rounding
    torch.testing.assert_close(mixed, reference.rms_norm(xb, w.detach(), 1e-6), **TOL[torch.bfloat16])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("lead", "d"), SHAPES, ids=IDS)
def test_silu_mul_matches_the_reference(lead: tuple[int, int], d: int, dtype: torch.dtype) -> None:
    gate = _randn(*lead, d, dtype=dtype) * 4  # past both knees of the sigmoid
    up = _randn(*lead, d, dtype=dtype, seed=1)
    y = ops.silu_mul(gate, up, impl="triton")
    want = reference.silu_mul(gate, up)
    assert y.shape == want.shape and y.dtype == want.dtype
    torch.testing.assert_close(y, want, **TOL[dtype])
    if gate.numel():
        dy = _randn(*lead, d, dtype=dtype, seed=2, grad=False)
        for got, ref in zip(_grads(y, (gate, up), dy), _grads(want, (gate, up), dy), strict=True):
            torch.testing.assert_close(got, ref, **TOL[dtype])


def test_silu_mul_spans_several_programs_and_rejects_mismatched_inputs() -> None:
    gate, up = _randn(3, 1500) * 4, _randn(3, 1500, seed=1)  # 4500 elements: three programs, a ragged last one
    y = ops.silu_mul(gate, up, impl="triton")
    torch.testing.assert_close(y, reference.silu_mul(gate, up), **TOL[torch.float32])
    with pytest.raises(ValueError, match="must match"):
        ops.silu_mul(gate, up[:, :10], impl="triton")


def test_rms_norm_rejects_rows_wider_than_the_kernel() -> None:
    with pytest.raises(ValueError, match="wider than"):
        ops.rms_norm(torch.ones(1, 70000, device=DEVICE), torch.ones(70000, device=DEVICE), 1e-6, impl="triton")


def test_auto_and_torch_run_the_reference_on_the_cpu() -> None:
    x, w = torch.randn(2, 3, 8), torch.randn(8)
    for impl in ("torch", "auto"):
        assert torch.equal(ops.rms_norm(x, w, 1e-6, impl=impl), reference.rms_norm(x, w, 1e-6))
        assert torch.equal(ops.silu_mul(x, x, impl=impl), reference.silu_mul(x, x))


def test_triton_on_cpu_without_interpreter_is_rejected(monkeypatch: pytest.MonkeyPatch) -> None:
    import lora_sweep.kernels._jit as J

    monkeypatch.setattr(J, "INTERPRET", False)
    with pytest.raises(RuntimeError, match="CUDA"):
        ops.rms_norm(torch.ones(1, 4), torch.ones(4), 1e-6, impl="triton")
    with pytest.raises(RuntimeError, match="CUDA"):
        ops.silu_mul(torch.ones(4), torch.ones(4), impl="triton")


def test_precompile_warms_both_ways_even_on_another_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    """Inside ``kernels.ops.precompile`` both ops launch nothing, forward or backward (the backward on a plain
    thread, as CUDA autograd's device thread runs it), and warm exactly the variants a real call launches."""
    calls = record_launches(monkeypatch)

    def call() -> tuple[torch.Tensor, torch.Tensor]:
        x, gate = _randn(3, 5, 40), _randn(3, 5, 40, seed=1)
        y = ops.silu_mul(ops.rms_norm(x, torch.ones(40, device=DEVICE), 1e-6, impl="triton"), gate,
                             impl="triton")
        worker = threading.Thread(target=y.backward, args=(torch.ones_like(y),))
        worker.start()
        worker.join()
        return x, gate

    x, gate = None, None

    def warm() -> None:
        nonlocal x, gate
        x, gate = call()

    ops.precompile(warm)
    warmed = {v for inside, v in calls if inside}
    assert len(calls) == 4 and len(warmed) == 4 and all(inside for inside, _ in calls), calls
    assert x.grad is not None and gate.grad is not None  # the Functions ran; their outputs are left unwritten
    call()
    assert {v for inside, v in calls if not inside} == warmed


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE.type != "cuda", reason="needs CUDA (compiled Triton)")
class TestGPU:
    """bf16 on the H200 at a Llama-3-8B width: 1,000 rows of 4,096 and their 14,336-wide MLP middles."""

    def test_rms_norm_bf16(self) -> None:
        x = _randn(1000, 4096, dtype=torch.bfloat16) * 2
        w = _randn(4096, dtype=torch.bfloat16, seed=1, grad=False)
        y, want = ops.rms_norm(x, w, 1e-5, impl="triton"), reference.rms_norm(x, w, 1e-5)
        torch.testing.assert_close(y, want, **TOL[torch.bfloat16])
        dy = _randn(1000, 4096, dtype=torch.bfloat16, seed=2, grad=False)
        torch.testing.assert_close(_grads(y, (x,), dy)[0], _grads(want, (x,), dy)[0], **TOL[torch.bfloat16])

    def test_silu_mul_bf16(self) -> None:
        gate, up = _randn(1000, 14336, dtype=torch.bfloat16) * 4, _randn(1000, 14336, dtype=torch.bfloat16, seed=1)
        y, want = ops.silu_mul(gate, up, impl="triton"), reference.silu_mul(gate, up)
        torch.testing.assert_close(y, want, **TOL[torch.bfloat16])
        dy = _randn(1000, 14336, dtype=torch.bfloat16, seed=2, grad=False)
        for got, ref in zip(_grads(y, (gate, up), dy), _grads(want, (gate, up), dy), strict=True):
            torch.testing.assert_close(got, ref, **TOL[torch.bfloat16])
