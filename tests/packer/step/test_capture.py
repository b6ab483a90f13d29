"""``packer.step.capture.capture``: side-stream warm-ups, then one captured run that replays (CUDA only)."""

from __future__ import annotations

import pytest
import torch

from lora_sweep.packer.step.capture import capture

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_warmups_then_a_graph_that_replays_on_the_same_buffers() -> None:
    x = torch.zeros(4, device="cuda")
    calls = []

    def fn() -> None:
        calls.append("fn")
        x.add_(1.0)

    captured = capture(fn, warmups=3)
    assert calls == ["fn"] * 4  # three warm-ups and the captured run
    assert x.tolist() == [3.0] * 4  # the captured run does not execute
    captured.graph.replay()
    captured.graph.replay()
    torch.cuda.synchronize()
    assert x.tolist() == [5.0] * 4
    assert captured.warmup_s > 0 and captured.capture_s > 0


def test_a_separate_warmup_and_a_shared_pool() -> None:
    x = torch.zeros(2, device="cuda")
    pool = torch.cuda.graph_pool_handle()
    first = capture(lambda: x.add_(1.0), warmups=1, warmup=lambda: x.add_(10.0), pool=pool)
    second = capture(lambda: x.mul_(2.0), warmups=0, pool=pool)
    assert x.tolist() == [10.0, 10.0]
    first.graph.replay()
    second.graph.replay()
    torch.cuda.synchronize()
    assert x.tolist() == [22.0, 22.0]


def test_a_host_sync_under_capture_raises() -> None:
    x = torch.ones(2, device="cuda")
    with pytest.raises(RuntimeError):
        capture(lambda: x.sum().item(), warmups=1)
