"""``time_pack`` times the steps of the pack a plan sized: that shape, on the run's step, its set-up left out."""

from __future__ import annotations

import random
import statistics
from collections.abc import Iterator

import pytest

import lora_sweep.packer.probe as probe
from lora_sweep.packer.model.load import load_base
from lora_sweep.packer.model.packed import PackedModel
from lora_sweep.packer.plan import AdapterSpec
from lora_sweep.packer.step.jobs import SlotEnd, TrainResult


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
    # no slot ended before the window closed: at its last step's read-back, on the CPU
    assert [reason for _, _, reason in result.ended] == ["stopped"] * 3
    assert timing.steps == 2 and timing.step == result.step == "eager" and 0 < timing.step_s < timing.wall_s
    assert not pm.slot_paths and pm.store is None  # the slots and their store are gone


class FakeClock:
    """``time.perf_counter`` of a fake host: a step's work moves it by that step's seconds."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def fake_train(clock: FakeClock, seconds: Iterator[float], setup_s: float = 0.0):  # noqa: ANN201
    """``packer.step.train.train`` as ``time_pack`` calls it on the CPU, on ``clock``: each global step takes the next
    of ``seconds`` (the first also ``setup_s``), then reads back (``should_stop`` asked for every live slot), ends its
    finished and stopped slots, and marks the profiler; a slot of accumulation k takes an optimizer step (and
    reports it) every k steps."""

    def train(pm, capacity, next_job, *, profiler, max_global_steps, should_stop=None, on_end=None,
              **kwargs):  # noqa: ANN001, ANN003, ANN202
        live: dict[int, list] = {}  # slot: [job, steps, stopped]
        result = TrainResult(step="eager")
        clock.now += setup_s
        while result.steps < max_global_steps:
            for slot in range(capacity):
                if slot not in live and (job := next_job(slot)) is not None:
                    live[slot] = [job, 0, False]
            if not live:
                break
            clock.now += next(seconds)
            result.steps += 1
            for state in live.values():
                state[1] += 1
                k = state[0].spec.gradient_accumulation_steps
                if should_stop is not None and state[1] % k == 0 and state[1] // k < state[0].spec.max_steps:
                    state[2] = state[2] or should_stop(None)
            done = {s: st[1] // st[0].spec.gradient_accumulation_steps >= st[0].spec.max_steps
                    for s, st in live.items()}
            ends = [SlotEnd(s, st[0], st[1], "finished" if done[s] else "stopped")
                    for s, st in sorted(live.items()) if done[s] or st[2]]
            if ends and on_end is not None:
                on_end(ends)
            for e in ends:
                del live[e.slot]
            profiler.step()
        return result

    return train


class Cpu:
    device = probe.torch.device("cpu")


def _timed(monkeypatch, seconds, **kwargs) -> probe.PackTiming:  # noqa: ANN001
    """``time_pack`` of one slot on the fake host whose steps take ``seconds`` (after a 5 s set-up)."""
    clock = FakeClock()
    monkeypatch.setattr(probe, "train", fake_train(clock, iter(seconds), setup_s=5.0))
    monkeypatch.setattr(probe.time, "perf_counter", clock)
    return probe.time_pack(Cpu(), [AdapterSpec()], 1, 16, vocab=50, **kwargs)  # type: ignore[arg-type]


def test_a_step_is_timed_from_one_steps_end_to_the_next(monkeypatch) -> None:
    """The set-up and the warm-up are not in the step, and the CPU's step of three is their median: set-up 5 s, a
    warm-up of 1 s, then steps of 1, 3 and 2 s give 2 s, the set-up 5 s (the first step's end less a step)."""
    timing = _timed(monkeypatch, [1.0, 1.0, 3.0, 2.0, 9.0], steps=3, warmup=1)
    assert (timing.step_s, timing.steps, timing.setup_s) == (2.0, 3, 4.0)


def test_short_steps_are_timed_until_they_add_up_to_min_s(monkeypatch) -> None:
    """On the CPU the timed steps go on until ``steps`` of them and ``min_s`` seconds, whichever is later, at most
    ``max_steps``: 0.125 s steps with 2 s asked are timed by 16; 1 s steps by the 3 asked; the bound holds."""
    assert _timed(monkeypatch, [0.125] * 100, steps=3, min_s=2.0, max_steps=50).steps == 16
    assert _timed(monkeypatch, [1.0] * 100, steps=3, min_s=2.0, max_steps=50).steps == 3
    assert _timed(monkeypatch, [0.125] * 100, steps=3, min_s=2.0, max_steps=8).steps == 8
    assert _timed(monkeypatch, [0.125] * 100, steps=3, min_s=2.0).steps == 3  # no max_steps: the 3 asked


def test_a_noisy_hosts_step_is_steadier_when_timed_long_enough(monkeypatch) -> None:
    """A shared host's steps: 250 ms of work each, and a random wait for the CPU on top (exponential, 30% of a step
    on average). Over 40 places the window may fall, the median of three steps spreads twice as wide as the median
    of the steps that 3 s holds of the fastest (12 here), which stays within 30% of the host's median step."""
    rng = random.Random(0)
    host = [0.25 * (1 + rng.expovariate(1 / 0.3)) for _ in range(4000)]
    steady = statistics.median(host)
    short, long = [], []
    for offset in range(0, 2000, 50):
        short.append(_timed(monkeypatch, host[offset:], steps=3).step_s / steady)
        long.append(_timed(monkeypatch, host[offset:], steps=3, min_s=3.0, max_steps=60).step_s / steady)
    assert statistics.stdev(long) < 0.5 * statistics.stdev(short)
    assert max(abs(r - 1) for r in long) < 0.3 < max(abs(r - 1) for r in short)


def test_the_turnover_comes_before_the_timed_steps(monkeypatch) -> None:
    """With ``turnover``, every slot ends once after the warm-up (its adapter handed to ``on_end``), a new slot of the
    same adapter starts, and the steps timed are the new slots' once all have started: an accumulating slot ends at
    its first optimizer step; the turnover's extra seconds are per slot."""
    clock = FakeClock()
    # the warm-up, then the turnover's two steps (each 0.5 s over the steps' 1 s), then the timed steps
    monkeypatch.setattr(probe, "train", fake_train(clock, iter([1.0, 1.5, 1.5] + [1.0] * 50)))
    monkeypatch.setattr(probe.time, "perf_counter", clock)
    handed: list[tuple[int, str]] = []
    timing = probe.time_pack(Cpu(), [AdapterSpec(), AdapterSpec(gradient_accumulation_steps=2)], 1, 16, vocab=50,
                             steps=4, turnover=True,
                             on_end=lambda ends: handed.extend((e.slot, e.reason) for e in ends))  # type: ignore
    assert handed == [(0, "finished"), (1, "finished")]  # the timed slots' ends are not handed on
    assert (timing.step_s, timing.steps) == (1.0, 4) and timing.turnover_s == pytest.approx(0.5)


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
