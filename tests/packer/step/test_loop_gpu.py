"""The fixed-shape step captured as a CUDA graph: graph == eager (with accumulation, sample packing and activation
checkpointing too), replay after refills, fallback, the warning of a study the step cannot train (H200 only)."""

from __future__ import annotations

import random
import warnings
from dataclasses import replace

import pytest
import torch

from lora_sweep.packer.data.packing import slot_stream
from lora_sweep.packer.data.rows import Example, SlotStream
from lora_sweep.packer.model.load import load_base
from lora_sweep.packer.model.packed import PackedModel
from lora_sweep.packer.plan import AdapterSpec
from lora_sweep.packer.step import loop
from lora_sweep.packer.step.train import SlotJob, train
from tests.conftest import Recorder, random_examples

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

PAD = 0


def _specs() -> list[AdapterSpec]:
    """Eight jobs over three slots: ranks 4-64, micro-batches 1-8, dropout on some, different lengths (slots
    end and are refilled mid-run), different targets, lrs and schedules."""
    ranks, micro = (4, 64, 8, 16, 32, 4, 64, 8), (1, 8, 3, 2, 5, 4, 1, 8)
    wide = ("q_proj", "o_proj", "gate_proj", "down_proj")  # the tiny model's k/v are 32 wide: rank 64 skips them
    return [AdapterSpec(rank=r, alpha=2 * r, lr=2e-3 * (1 + i % 3), micro_batch=m, max_steps=8 + 3 * i, seed=i,
                        dropout=0.1 if i % 3 == 1 else 0.0,
                        targets=wide if r == 64 else ("all-linear",) if i % 2 else ("q_proj", "v_proj"),
                        schedule=("constant", "cosine", "linear")[i % 3], warmup_steps=i % 4, weight_decay=0.01 * i)
            for i, (r, m) in enumerate(zip(ranks, micro, strict=True))]


def _run(model_dir, specs, capacity, *, cuda_graphs, examples=None, dtype="float32", impl="triton",  # noqa: ANN001
         **kw):  # noqa: ANN003, ANN202
    model, _ = load_base(str(model_dir), attn_implementation="sdpa", device="cuda", dtype=dtype)
    pm = PackedModel(model, impl=impl)
    jobs = [SlotJob(s, slot_stream(examples or random_examples(64, seed=10 + i), s.micro_batch, s.seed,
                                   sample_packing=s.sample_packing, row_len=48), key=i)
            for i, s in enumerate(specs)]
    rec = Recorder(pm)
    result = train(pm, capacity, lambda slot: jobs.pop(0) if jobs else None, pad_id=PAD, on_step=rec.on_step,
                   on_end=rec.on_end, cuda_graphs=cuda_graphs, **kw)
    return rec, result


def _same(a: Recorder, b: Recorder, rtol: float = 1e-6) -> None:
    assert a.losses.keys() == b.losses.keys()
    for key in a.losses:
        torch.testing.assert_close(torch.tensor(a.losses[key]), torch.tensor(b.losses[key]), rtol=rtol, atol=0)
        for path, (wa, wb) in a.final[key].items():
            torch.testing.assert_close(wa, b.final[key][path][0], rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(wb, b.final[key][path][1], rtol=1e-5, atol=1e-6)


def test_graph_equals_eager_fp32_with_refills_mixed_ranks_and_dropout(tiny_dirs) -> None:
    specs = _specs()
    eager, r_eager = _run(tiny_dirs("llama"), specs, 3, cuda_graphs="off")
    graph, r_graph = _run(tiny_dirs("llama"), specs, 3, cuda_graphs="auto")
    assert r_eager.graphs == 0 and r_graph.graphs >= 1
    assert r_graph.steps >= 30 and r_graph.jobs_started == len(specs)
    _same(eager, graph)


def test_graph_equals_eager_fp32_with_accumulation_sample_packing_and_checkpointing(tiny_dirs) -> None:
    """The same eight jobs with accumulation k 1-4 mixed in one pack, half of them sample-packed, every decoder
    layer recomputed in the backward: one captured step per key, the eager step's losses within 1e-6."""
    specs = [replace(s, gradient_accumulation_steps=1 + i % 4, sample_packing=i % 2 == 0)
             for i, s in enumerate(_specs())]
    eager, r_eager = _run(tiny_dirs("llama"), specs, 3, cuda_graphs="off", activation_checkpointing=True)
    graph, r_graph = _run(tiny_dirs("llama"), specs, 3, cuda_graphs="auto", activation_checkpointing=True)
    assert r_eager.step == "eager" and r_graph.step == "cuda-graph" and r_graph.graphs >= 1
    assert r_graph.steps >= 30 and r_graph.jobs_started == len(specs)
    assert [len(graph.losses[i]) for i in range(len(specs))] == [s.max_steps for s in specs]
    _same(eager, graph)


def test_graph_equals_eager_fp32_with_chunked_ce(tiny_dirs) -> None:
    """chunked_ce on the fused loss: the logits of 64 token rows at a time (the tiny model's steps hold up to
    3 x 8 x 32), the same losses as all at once, captured or not."""
    specs = _specs()
    whole, _ = _run(tiny_dirs("llama"), specs, 3, cuda_graphs="auto")
    eager, _ = _run(tiny_dirs("llama"), specs, 3, cuda_graphs="off", chunked_ce=64)
    graph, result = _run(tiny_dirs("llama"), specs, 3, cuda_graphs="auto", chunked_ce=64)
    assert result.step == "cuda-graph"
    _same(eager, graph)
    for key, curve in whole.losses.items():  # other GEMM shapes for the head: the same sums in another order
        torch.testing.assert_close(torch.tensor(graph.losses[key]), torch.tensor(curve), rtol=1e-5, atol=0)


def test_graph_equals_eager_fp32_on_the_torch_path(tiny_dirs) -> None:
    """The torch (non-Triton) path of the step on CUDA, captured: each slot's LoRA scale is a (C, 1, 1) view of the
    step's segment table, so a replay reads the scales the host wrote for that step. Scales 2-6 (alpha / r), refills
    putting another scale into the same slot, mixed ranks 4-64 and accumulation k 1-4 mixed: the captured step equals
    the eager one within 1e-6 per step. (Dropout on this path draws its masks with torch generators from Python seeds:
    eager only, so none here.)"""
    specs = [replace(s, dropout=0.0, alpha=float((1 + i % 3) * 2 * s.rank), gradient_accumulation_steps=1 + i % 4)
             for i, s in enumerate(_specs())]
    eager, r_eager = _run(tiny_dirs("llama"), specs, 3, cuda_graphs="off", impl="torch")
    graph, r_graph = _run(tiny_dirs("llama"), specs, 3, cuda_graphs="auto", impl="torch")
    assert r_eager.step == "eager" and r_graph.step == "cuda-graph" and r_graph.graphs >= 1
    assert r_graph.steps >= 30 and r_graph.jobs_started == len(specs)
    _same(eager, graph)


def test_optimizer_in_backward_trains_on_the_captured_step_and_says_what_it_keeps(tiny_dirs) -> None:
    """optimizer_in_backward on CUDA: the captured step, one warning that its gradient buffer stays, and the updates
    of the same step without the option, eager (bitwise: the option changes nothing in the step)."""
    specs = [replace(s, max_grad_norm=None) for s in _specs()[:4]]
    model, _ = load_base(str(tiny_dirs("llama")), attn_implementation="sdpa", device="cuda")
    pm = PackedModel(model, impl="triton")
    jobs = [SlotJob(s, SlotStream(random_examples(64, seed=10 + i), s.micro_batch, seed=s.seed), key=i)
            for i, s in enumerate(specs)]
    ref = Recorder(pm)
    train(pm, 2, lambda slot: jobs.pop(0) if jobs else None, pad_id=PAD, on_step=ref.on_step, on_end=ref.on_end,
          cuda_graphs="off")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        graph, result = _run(tiny_dirs("llama"), specs, 2, cuda_graphs="auto", optimizer_in_backward=True)
    messages = [str(w.message) for w in caught if "optimizer_in_backward" in str(w.message)]
    assert len(messages) == 1 and "gradient buffer" in messages[0] and result.step == "cuda-graph"
    assert ref.losses.keys() == graph.losses.keys() == set(range(len(specs)))
    _same(ref, graph)  # graph == eager, the option changing nothing in the step


W5_RTOL = 2e-2
"""The W5 gate's tolerance (``benchmarks.gpu_bench.correctness_gate``): bf16 losses and weights, relative."""


def test_graph_equals_eager_bf16_within_w5_tolerances(tiny_dirs) -> None:
    """bf16: the same jobs as the fp32 test; every per-step loss and every final adapter within the W5 gate."""
    specs = _specs()
    eager, _ = _run(tiny_dirs("llama"), specs, 3, cuda_graphs="off", dtype="bfloat16")
    graph, result = _run(tiny_dirs("llama"), specs, 3, cuda_graphs="auto", dtype="bfloat16")
    assert result.graphs >= 1 and result.steps >= 30
    assert eager.losses.keys() == graph.losses.keys() == set(range(len(specs)))
    for key in eager.losses:
        a, b = torch.tensor(eager.losses[key]), torch.tensor(graph.losses[key])
        assert a.shape == b.shape and bool(torch.isfinite(a).all())
        assert float(((a - b).abs() / a.abs()).max()) < W5_RTOL, key
        for path, (wa, wb) in eager.final[key].items():
            ga, gb = graph.final[key][path]
            for x, y in ((wa, ga), (wb, gb)):
                assert float((x.float() - y.float()).norm() / x.float().norm().clamp(min=1e-12)) < W5_RTOL, (key, path)


def test_replay_after_refill_captures_once(tiny_dirs) -> None:
    """Rows of one length, one micro-batch: every refill (new ranks, lrs, seeds) replays the first graph."""
    rng = random.Random(0)
    rows = [Example(tuple(rng.randrange(3, 300) for _ in range(20)), (-100,) * 5 + tuple(range(3, 18)))
            for _ in range(32)]
    wide = ("q_proj", "o_proj", "gate_proj", "down_proj")  # rank 64 fits these; one set: one graph key
    specs = [replace(s, micro_batch=4, dropout=0.0, targets=wide) for s in _specs()[:6]]
    eager, _ = _run(tiny_dirs("llama"), specs, 2, cuda_graphs="off", examples=rows, max_rows=64)
    graph, result = _run(tiny_dirs("llama"), specs, 2, cuda_graphs="on", examples=rows, max_rows=64)
    assert result.graphs == 1 and result.capture_s > 0 and result.warmup_s > 0
    _same(eager, graph)


def test_capture_failure_falls_back_to_eager(tiny_dirs, monkeypatch: pytest.MonkeyPatch) -> None:
    """A step that cannot be captured (here: a host sync inside it) warns once and trains eagerly, unchanged."""
    def syncing(losses):  # noqa: ANN001, ANN202
        def fn(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            out = losses(*args, **kwargs)
            out[0].sum().item()  # a host sync: illegal while capturing
            return out

        return fn

    specs = _specs()[:4]
    eager, _ = _run(tiny_dirs("llama"), specs, 2, cuda_graphs="off")
    for name in ("slot_losses", "head_losses"):  # full logits, or the fused loss of the Triton path
        monkeypatch.setattr(loop, name, syncing(getattr(loop, name)))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fallback, result = _run(tiny_dirs("llama"), specs, 2, cuda_graphs="auto")
    messages = [str(w.message) for w in caught if "CUDA graph capture failed" in str(w.message)]
    assert len(messages) == 1 and result.graphs == 0
    _same(eager, fallback)
