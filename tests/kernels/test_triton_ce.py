"""The fused linear cross-entropy of a fixed-shape batch (``kernels.triton_ce``) against torch's ``F.cross_entropy`` on
``(hidden @ W.T).float()``, slot by slot: losses, counts and the gradient of the hidden states.

CPU: the Triton interpreter (conftest.py), fp32 and bf16 logits. GPU (``gpu``): bf16 at the SmolLM2-135M step's
shape, eager and captured in a CUDA graph, against the fp32 reference and the plain path's time.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from tests.conftest import need_triton

need_triton()  # before anything imports the Triton kernel modules

from lora_sweep.kernels import reference  # noqa: E402
from lora_sweep.kernels.ops import linear_ce  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = torch.device("cuda" if torch.cuda.is_available() and not INTERPRET else "cpu")
IGNORE = -100


def _ce_module():  # noqa: ANN202
    import lora_sweep.kernels.triton_ce as ce

    return ce


def _case(dtype: torch.dtype, *, t_per_slot: int = 7, capacity: int = 4, h: int = 24, vocab: int = 300,
          seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """hidden (T, H), weight (V, H), bias (V,), targets (T,): slot 2 has no target at all, the others some ignored
    rows (as a fixed-shape batch's prompts, padding and last positions are)."""
    gen = torch.Generator().manual_seed(seed)
    n = t_per_slot * capacity
    hidden = torch.randn(n, h, generator=gen).to(dtype)
    weight = (torch.randn(vocab, h, generator=gen) / h ** 0.5).to(dtype)
    bias = (0.1 * torch.randn(vocab, generator=gen)).to(dtype)
    targets = torch.randint(0, vocab, (n,), generator=gen)
    targets[torch.rand(n, generator=gen) < 0.3] = IGNORE
    targets[2 * t_per_slot:3 * t_per_slot] = IGNORE  # slot 2: no targets
    targets[0], targets[1] = vocab - 1, 0  # the first and last columns, in the last (partial) and the first block
    return hidden.to(DEVICE), weight.to(DEVICE), bias.to(DEVICE), targets.to(DEVICE)


def _oracle(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor,
            capacity: int, grad_losses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per slot: mean of ``F.cross_entropy`` over its target rows of ``F.linear(hidden, W, b).float()`` (0 without
    targets), its count, and autograd's gradient of ``sum_g grad_losses[g] * loss_g`` with respect to hidden."""
    x = hidden.detach().clone().requires_grad_()
    logits = F.linear(x, weight, bias).float()
    losses, counts = [], []
    for rows, y in zip(logits.chunk(capacity), targets.chunk(capacity), strict=True):
        keep = y != IGNORE
        counts.append(keep.sum().float())
        losses.append(F.cross_entropy(rows[keep], y[keep]) if keep.any() else rows.sum() * 0.0)
    loss = torch.stack(losses)
    (loss * grad_losses).sum().backward()
    return loss.detach(), torch.stack(counts), x.grad


def _fused(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor,
           capacity: int, grad_losses: torch.Tensor, chunk: int | None = None
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    x = hidden.detach().clone().requires_grad_()
    losses, counts = linear_ce(x, weight, bias, targets, capacity, impl="triton", chunk=chunk)
    (losses * grad_losses).sum().backward()
    return losses.detach(), counts, x.grad


@pytest.mark.parametrize("chunk", [None, 5], ids=["all-rows", "chunks-of-5"])
@pytest.mark.parametrize("block", [64, None], ids=["5-blocks", "one-block"])
@pytest.mark.parametrize("with_bias", [False, True], ids=["no-bias", "bias"])
def test_fp32_losses_and_hidden_gradient_equal_torch_per_slot(block: int | None, with_bias: bool, chunk: int | None,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """V = 300: with 64-column blocks the online logsumexp crosses five blocks, the last one partial. In chunks of
    5 rows (bounded logits memory) a chunk starts and ends inside a slot's 7 rows: the same losses and gradient."""
    if block is not None:
        monkeypatch.setattr(_ce_module(), "_MAX_BLOCK", block)
    hidden, weight, bias, targets = _case(torch.float32)
    bias = bias if with_bias else None
    grad_losses = torch.tensor([0.5, -2.0, 3.0, 1.25], device=DEVICE)  # slot 2 (no targets) gets a factor too
    losses, counts, dx = _fused(hidden, weight, bias, targets, 4, grad_losses, chunk)
    want_losses, want_counts, want_dx = _oracle(hidden, weight, bias, targets, 4, grad_losses)
    assert counts.tolist() == want_counts.tolist() and counts[2] == 0 and counts.min() == 0 < counts.max()
    # fp32: the same sums in another order (blocks of the vocabulary; a per-slot sum of rows)
    torch.testing.assert_close(losses, want_losses, rtol=1e-6, atol=1e-6)
    assert losses[2] == 0 and (dx[14:21] == 0).all()  # the slot without targets: loss 0, zero gradient
    assert (dx[targets == IGNORE] == 0).all() and dx.abs().max() > 0.01
    torch.testing.assert_close(dx, want_dx, rtol=1e-5, atol=1e-7)  # one more fp32 GEMM over V = 300 terms


def test_bf16_logits_within_bf16_tolerance() -> None:
    """bf16 hidden and head: the logits are the same bf16 GEMM's; the kernel's fp32 math on them matches torch's on
    their fp32 copy, and the gradient, rounded to bf16 before its GEMM as autograd's is, within bf16 rounding."""
    hidden, weight, bias, targets = _case(torch.bfloat16, seed=1)
    grad_losses = torch.tensor([1.0, 0.25, 1.0, -0.5], device=DEVICE)
    losses, counts, dx = _fused(hidden, weight, None, targets, 4, grad_losses)
    want_losses, want_counts, want_dx = _oracle(hidden, weight, None, targets, 4, grad_losses)
    assert dx.dtype == torch.bfloat16 and counts.tolist() == want_counts.tolist()
    torch.testing.assert_close(losses, want_losses, rtol=1e-5, atol=1e-5)  # fp32 math on identical bf16 logits
    torch.testing.assert_close(dx.float(), want_dx.float(), rtol=2e-2, atol=2e-3)  # bf16: 8 mantissa bits


def test_no_grad_forward_equals_the_training_forward_and_the_reference() -> None:
    """Under no_grad (evaluation) no gradient is written and no second GEMM runs: the same losses."""
    hidden, weight, bias, targets = _case(torch.float32, seed=2)
    x = hidden.clone().requires_grad_()
    train_losses, _ = linear_ce(x, weight, bias, targets, 4, impl="triton")
    with torch.no_grad():
        losses, counts = linear_ce(x, weight, bias, targets, 4, impl="triton")
    assert losses.grad_fn is None and train_losses.grad_fn is not None
    want, want_counts = reference.linear_ce(hidden, weight, bias, targets, 4)
    torch.testing.assert_close(losses, train_losses.detach(), rtol=0, atol=0)
    torch.testing.assert_close(losses, want, rtol=1e-6, atol=1e-6)
    assert counts.tolist() == want_counts.tolist()


def test_rows_kernel_writes_the_scaled_softmax_gradient_in_place(monkeypatch: pytest.MonkeyPatch) -> None:
    """``cross_entropy_rows``: the logits become ``(softmax - onehot) * scale[group]``, 0 on ignored rows; without a
    scale they are left as they were."""
    ce = _ce_module()
    monkeypatch.setattr(ce, "_MAX_BLOCK", 32)
    gen = torch.Generator().manual_seed(3)
    logits = (3 * torch.randn(12, 77, generator=gen)).to(DEVICE)  # 77: two full blocks and a partial one
    targets = torch.randint(0, 77, (12,), generator=gen).to(DEVICE)
    targets[[1, 6]] = IGNORE
    scale = torch.tensor([0.5, 2.0, 0.25], device=DEVICE)  # groups of 4 rows
    want_nll = F.cross_entropy(logits, targets, reduction="none")  # 0 where ignored
    want = (logits.softmax(-1) - F.one_hot(targets.clamp(min=0), 77)) * scale.repeat_interleave(4)[:, None]
    want[targets == IGNORE] = 0
    kept = logits.clone()
    torch.testing.assert_close(ce.cross_entropy_rows(kept, targets), want_nll, rtol=1e-6, atol=1e-6)
    assert torch.equal(kept, logits)
    nll = ce.cross_entropy_rows(logits, targets, scale, 4)
    torch.testing.assert_close(nll, want_nll, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(logits, want, rtol=1e-6, atol=1e-7)


def test_launcher_refuses_what_it_cannot_compute() -> None:
    hidden, weight, _, targets = _case(torch.float32)
    with pytest.raises(ValueError, match="multiple of capacity"):
        linear_ce(hidden, weight, None, targets, 3, impl="triton")  # T = 28
    with pytest.raises(ValueError, match="frozen"):
        linear_ce(hidden, weight.clone().requires_grad_(), None, targets, 4, impl="triton")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_smollm2_shape_bf16_in_a_cuda_graph_is_exact_and_faster_than_the_plain_loss() -> None:
    """The step's loss at its H200 shape (16 slots x 8 rows x 48 positions, hidden 576, vocabulary 49,152,
    bf16): within bf16 tolerance of the fp32 reference, a graph replay equal to the eager call, and forward + backward
    faster than the plain path (bf16 logits, their fp32 copy, torch's cross-entropy), both replayed from a graph."""
    torch.manual_seed(0)
    dev, c, n, h, vocab = torch.device("cuda"), 16, 16 * 8 * 48, 576, 49152
    hidden = torch.randn(n, h, device=dev, dtype=torch.bfloat16, requires_grad=True)
    weight = (torch.randn(vocab, h, device=dev) / h ** 0.5).to(torch.bfloat16)
    targets = torch.randint(0, vocab, (n,), device=dev)
    targets[torch.rand(n, device=dev) < 0.4] = IGNORE
    targets[3 * 384:4 * 384] = IGNORE  # one slot without targets (a free slot)
    grad_losses = torch.rand(c, device=dev) + 0.5

    def fused() -> torch.Tensor:
        hidden.grad = None
        losses, _ = linear_ce(hidden, weight, None, targets, c, impl="triton")
        (losses * grad_losses).sum().backward()
        return losses.detach()

    def plain() -> torch.Tensor:
        hidden.grad = None
        logits = F.linear(hidden, weight)
        nll = F.cross_entropy(logits.float(), targets, reduction="none").view(c, -1).sum(1)
        losses = nll / (targets != IGNORE).view(c, -1).sum(1).clamp(min=1)
        (losses * grad_losses).sum().backward()
        return losses.detach()

    eager_losses, eager_dx = fused(), hidden.grad.clone()
    want_losses, want_counts, want_dx = _oracle(hidden.float(), weight.float(), None, targets, c, grad_losses)
    torch.testing.assert_close(eager_losses, want_losses, rtol=1e-2, atol=1e-2)  # bf16 logits vs fp32 ones
    torch.testing.assert_close(eager_dx.float(), want_dx, rtol=5e-2, atol=1e-4)
    assert eager_losses[3] == 0 and (eager_dx[3 * 384:4 * 384] == 0).all()

    times = {}
    for name, fn in (("fused", fused), ("plain", plain)):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = fn()
        graph.replay()
        if name == "fused":
            torch.testing.assert_close(out, eager_losses, rtol=1e-6, atol=0)  # the same kernels on the same data
            torch.testing.assert_close(hidden.grad, eager_dx, rtol=1e-2, atol=1e-6)  # bf16: one ulp at most
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(20):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        times[name] = start.elapsed_time(end) / 20
    print(f"loss forward + backward per step, graph replay: fused {times['fused']:.3f} ms, "
          f"plain {times['plain']:.3f} ms")
    assert times["fused"] < times["plain"]
