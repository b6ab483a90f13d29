"""``time_pack`` times the steps of the pack a plan sized: that shape, on the run's step, its set-up left out."""

from __future__ import annotations

import pytest

import lora_sweep.packer.probe as probe
from lora_sweep.packer.model.load import load_base
from lora_sweep.packer.model.packed import PackedModel
from lora_sweep.packer.plan import AdapterSpec
from lora_sweep.packer.step.jobs import TrainResult


def test_it_trains_the_asked_pack_and_leaves_nothing_behind(tiny_dirs, monkeypatch) -> None:
    """Three slots of their own adapters (one sample-packed, one DoRA), 2 rows of 32 tokens each: one step shape,
    ``warmup + steps`` steps, the rank bucket held at ``max_rows``, and no slot left in the model afterwards."""
    model, _ = load_base(str(tiny_dirs("llama")))
    pm = PackedModel(model)
    seen: dict[str, object] = {}
    real_train = probe.train

    def recorded(pm_, capacity, next_job, **kwargs):  # noqa: ANN001, ANN003, ANN202
        result = real_train(pm_, capacity, next_job, **kwargs)
        seen.update(result=result, capacity=capacity, max_rows=kwargs["max_rows"], cuda=kwargs["cuda_graphs"])
        return result

    monkeypatch.setattr(probe, "train", recorded)
    specs = [AdapterSpec(rank=4, targets=("q_proj", "v_proj")), AdapterSpec(rank=8, sample_packing=True),
             AdapterSpec(rank=2, dora=True, dropout=0.1)]
    timing = probe.time_pack(pm, specs, 2, 32, steps=2, warmup=1, max_rows=16, cuda_graphs="auto")
    result = seen["result"]
    assert isinstance(result, TrainResult)
    assert (seen["capacity"], seen["max_rows"], seen["cuda"]) == (3, 16, "auto")
    assert result.steps == 3 and result.jobs_started == 3 and result.shapes == {(2, 32)}
    assert [reason for _, _, reason in result.ended] == ["interrupted"] * 3  # no slot ended before the last step
    assert timing.steps == 2 and timing.step == result.step == "eager" and 0 < timing.step_s < timing.wall_s
    assert not pm.slot_paths and pm.store is None  # the slots and their store are gone


def test_a_step_is_timed_from_one_steps_end_to_the_next(monkeypatch) -> None:
    """The set-up and the warm-up are not in the step, and the CPU's step is the median of the timed ones: a fake
    ``train`` on a fake clock (set-up and warm-up 5 s, then steps of 1, 3 and 2 s) gives 2 s."""
    clock = iter([0.0, 5.0, 6.0, 9.0, 11.0, 11.5])  # t0, the four steps' ends, the wall's end

    def fake_train(pm, capacity, next_job, *, profiler, max_global_steps, **kwargs):  # noqa: ANN001, ANN003, ANN202
        while next_job(0) is not None:
            pass
        for _ in range(max_global_steps):
            profiler.step()
        return TrainResult(steps=max_global_steps, step="eager")

    class Pm:
        device = probe.torch.device("cpu")

    monkeypatch.setattr(probe, "train", fake_train)
    monkeypatch.setattr(probe.time, "perf_counter", lambda: next(clock))
    timing = probe.time_pack(Pm(), [AdapterSpec()], 1, 16, steps=3, warmup=1, vocab=50)  # type: ignore[arg-type]
    assert (timing.step_s, timing.steps, timing.wall_s) == (2.0, 3, 11.5)


def test_it_refuses_a_pack_it_cannot_time() -> None:
    with pytest.raises(ValueError, match="needs a slot, a warm-up step and a timed step"):
        probe.time_pack(None, [], 1, 16)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="0 timed"):
        probe.time_pack(None, [AdapterSpec()], 1, 16, steps=0)  # type: ignore[arg-type]


@pytest.mark.gpu
@pytest.mark.skipif(not probe.torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_it_times_the_captured_step(tiny_dirs) -> None:
    """On CUDA the timed steps are the run's: the step captured as a CUDA graph and replayed, its capture in the
    warm-up; off, the eager step."""
    model, _ = load_base(str(tiny_dirs("llama")), device="cuda")
    pm = PackedModel(model)
    specs = [AdapterSpec(rank=8), AdapterSpec(rank=4, targets=("q_proj", "v_proj"))]
    graphed = probe.time_pack(pm, specs, 4, 64, steps=5, max_rows=8, cuda_graphs="auto")
    eager = probe.time_pack(pm, specs, 4, 64, steps=5, max_rows=8, cuda_graphs="off")
    assert (graphed.step, eager.step) == ("cuda-graph", "eager") and graphed.steps == eager.steps == 5
    assert 0 < graphed.step_s < graphed.wall_s / 5 and 0 < eager.step_s
