"""``sweep plan`` predicts with the step of the pack it sized, timed (``sweep.pack_step``): that shape, that time,
cached by what determines it, bounded in cost."""

from __future__ import annotations

import json
import math

import pytest

import lora_sweep.sweep.pack_step as pack_step
from lora_sweep.packer.plan import BaseShape, MemoryModel
from lora_sweep.packer.probe import PackTiming
from lora_sweep.sweep.config.loader import load_study
from lora_sweep.sweep.pack_step import PackTimer, bucket_lengths, slot_specs, step_length
from lora_sweep.sweep.planning import largest_rank, plan_report
from tests.conftest import write_study

MM = MemoryModel(base_bytes=1000, bytes_per_token=10, bytes_per_token_rank=1, bytes_per_param=16,
                 seconds_per_token=1e-5, seconds_per_step=0.02)
BASE = BaseShape((("q_proj", 64, 64), ("v_proj", 64, 64)), 1000, forward_s=0.002, load_s=2.0, imports_s=3.0)
LENGTHS = [20] * 40  # every step pads to 32: the timed length is the run's mean one


class FakeStep:
    """A loaded base whose ``Packer.time_pack`` (as the timer calls it) is a fake step of ``seconds``: records what
    it was asked to time."""

    def __init__(self, seconds: float) -> None:
        self.seconds, self.calls = seconds, list[dict[str, object]]()

    def time_pack(self, specs, rows, length, **kwargs) -> PackTiming:  # noqa: ANN001, ANN003
        self.calls.append({"pm": self, "slots": len(specs), "specs": specs, "rows": rows, "length": length, **kwargs})
        # as ``time_pack`` on the CPU: at least ``steps``, as many as ``min_s`` holds, at most ``max_steps``
        timed = min(kwargs["max_steps"], max(kwargs["steps"], math.ceil(kwargs["min_s"] / self.seconds)))
        return PackTiming(self.seconds, timed, 4 * self.seconds, "eager")


def _spec(tmp_path, tiny_dirs, name="timed", *overrides, **changes):  # noqa: ANN001, ANN002, ANN003, ANN202
    changes = {"budget": {"trials": 12}, "train": {"max_steps": 40, "micro_batch": 4},
               "pruning": {"kind": "cohort_sha", "rungs": [10, 20], "reduction_factor": 3}, **changes}
    return load_study(write_study(tmp_path, tiny_dirs("llama"), name, **changes), list(overrides))


def _timer(spec, fake, load=None, **kwargs) -> PackTimer:  # noqa: ANN001
    """A timer whose model load gives ``fake`` (or calls ``load``)."""
    return PackTimer(spec, "cpu", LENGTHS, load or (lambda: fake), **kwargs)


def test_the_prediction_is_the_sized_packs_timed_step(tiny_dirs, tmp_path, monkeypatch) -> None:
    """The plan times the pack it sized (its slots, the space's largest micro-batch, the run's step length, the rank
    bucket of the space's most rank rows) and predicts with that step: a step 4x slower makes the training time 4x,
    whatever the calibration's line said."""
    monkeypatch.setenv("LORA_SWEEP_CACHE", str(tmp_path / "cache"))
    spec = _spec(tmp_path, tiny_dirs)
    fast, slow = FakeStep(0.05), FakeStep(0.2)
    one = plan_report(spec, [MM], "test", BASE, "cpu", timer=_timer(spec, fast))
    (call,) = fast.calls
    assert call["pm"] is fast and (call["slots"], call["rows"], call["length"]) == (one.slots, 4, 32)
    assert call["max_rows"] == largest_rank(spec) and call["warmup"] == 1
    # at least 3 steps, on the CPU as many as 3 s holds (``time_pack``), up to 60
    assert (call["steps"], call["min_s"], call["max_steps"]) == (3, pack_step.PACK_TIMED_S, pack_step.PACK_MAX_STEPS)
    assert one.predicted_step_s == pytest.approx(0.05)  # the run's mean step is the timed one (every row pads to 32)
    assert one.predicted_total_s == pytest.approx(one.pack_steps * 0.05)
    probes = plan_report(spec, [MM], "test", BASE, "cpu")  # no timer: the calibration's line
    assert probes.predicted_step_s != pytest.approx(0.05)
    spec_slow = _spec(tmp_path, tiny_dirs, "slow", "seed=1")  # another pack (other slots drawn): not from the cache
    four = plan_report(spec_slow, [MM], "test", BASE, "cpu", timer=_timer(spec_slow, slow))
    assert len(slow.calls) == 1 and four.pack_steps == one.pack_steps
    assert four.predicted_total_s == pytest.approx(4 * one.predicted_total_s)
    # the evaluation's per-token time is the line's, scaled through the measured step alike
    assert four.memory.seconds_per_token == pytest.approx(4 * one.memory.seconds_per_token)
    assert four.memory.bytes_per_token == MM.bytes_per_token  # the memory stays the probes'
    table = four.table()
    assert "predicted step                       200 ms (a mean step of 3 slots x 4 rows x 32.0 tokens" in table
    assert "median of 15 steps of 3 slots x 4 rows x 32 tokens, eager step, after 1 warm-up and a turnover" in table
    assert "time: the sized pack's own steps, timed" in table and "(no pruning)" not in table
    assert "cohort SHA keeping 1/3 at steps 10, 20 of 40" in table


def test_between_lengths_the_calibrations_line_carries_the_measured_step(tiny_dirs, tmp_path, monkeypatch) -> None:
    """A run's mean step is shorter than the timed one (the longest row of a step varies): the prediction follows
    the calibration's line from the measured point, scaled through it."""
    monkeypatch.setenv("LORA_SWEEP_CACHE", str(tmp_path / "cache"))
    spec = _spec(tmp_path, tiny_dirs)
    fake = FakeStep(0.3)
    timer = _timer(spec, fake)
    timer.lengths = [10] * 95 + [20] * 5  # most steps pad to 16, some to 32
    report = plan_report(spec, [MM], "test", BASE, "cpu", timer=timer)
    timed = report.timed
    assert timed is not None and timed.length == 32 and 16 < timed.mean_length < 32
    line = MM.step_seconds
    assert report.predicted_step_s == pytest.approx(0.3 * line(timed.mean_tokens) / line(timed.tokens))


def test_the_timing_is_cached_by_the_calibration_and_the_pack(tiny_dirs, tmp_path, monkeypatch) -> None:
    """A second plan of the same pack reads the step back without loading the model; another sequence length (the
    calibration's key), another pack (slots), or other slots' adapters (the space) time again."""
    monkeypatch.setenv("LORA_SWEEP_CACHE", str(tmp_path / "cache"))
    spec = _spec(tmp_path, tiny_dirs)
    fake = FakeStep(0.1)
    first = _timer(spec, fake)(3, 16, 4, MM)
    assert len(fake.calls) == 1 and first.where.startswith("median of 30 steps")
    (entry,) = (tmp_path / "cache" / "pack_step").iterdir()
    record = json.loads(entry.read_text())
    assert record["step_s"] == 0.1 and record["key"]["calibration"]["seq_len"] == 48
    assert record["key"]["pack"]["rows"] == 4 and len(record["key"]["pack"]["slots"]) == 3

    def refused():  # noqa: ANN202
        raise AssertionError("a cached timing loads no model")

    again = _timer(spec, fake, load=refused)(3, 16, 4, MM)
    assert len(fake.calls) == 1 and again.step_s == 0.1 and again.where == f"cached ({entry})"
    _timer(spec, fake)(4, 16, 4, MM)  # a fourth slot
    longer = _spec(tmp_path, tiny_dirs, "timed", "data.max_length=64")
    _timer(longer, fake)(3, 16, 4, MM)
    other = _spec(tmp_path, tiny_dirs, "timed", "search.rank=[2]")
    _timer(other, fake)(3, 16, 4, MM)
    assert len(fake.calls) == 4 and len(list((tmp_path / "cache" / "pack_step").iterdir())) == 4


def test_a_pack_too_slow_to_time_keeps_the_calibrations_line(tiny_dirs, tmp_path, monkeypatch) -> None:
    """The timing is bounded: on the CPU at least ``PACK_STEPS`` steps and as many more as ``PACK_TIMED_S`` holds
    (``time_pack``), at most ``PACK_MAX_STEPS`` and as many as the line says fit the budget, fewer where not even
    those do, and where not even the warm-up and one step do, none (no model loaded): the plan says so."""
    monkeypatch.setenv("LORA_SWEEP_CACHE", str(tmp_path / "cache"))
    fake = FakeStep(1.0)
    tokens = 3 * 4 * 32
    for seed, seconds, steps in ((10, 0.5, (3, 60)), (11, 1.0, (3, 59)), (12, 30.0, (1, 1))):  # 60 s: 30 s, 30 s
        mm = MemoryModel(base_bytes=1000, bytes_per_token=10, seconds_per_token=0.0, seconds_per_step=seconds)
        _timer(_spec(tmp_path, tiny_dirs, f"s{seed}", f"seed={seed}"), fake)(3, 16, 4, mm)
        assert (fake.calls[-1]["steps"], fake.calls[-1]["max_steps"]) == steps
    spec = _spec(tmp_path, tiny_dirs)
    line = MM.step_seconds(tokens)
    fake.calls.clear()

    def refused():  # noqa: ANN202
        raise AssertionError("nothing timed: no model loaded")

    timer = _timer(spec, fake, load=refused, budget_s=1.5 * line)
    timer.spec = _spec(tmp_path, tiny_dirs, "untimed", "seed=2")  # another pack than the one cached above
    slower = MemoryModel(base_bytes=1000, bytes_per_token=10, seconds_per_token=2e-5, seconds_per_step=0.03)
    report = plan_report(timer.spec, [MM, slower], "test", BASE, "cpu", timer=timer)  # two calibrations
    assert not fake.calls and report.timed is not None and report.timed.step_s is None
    mean_tokens = report.timed.mean_tokens  # the pack's mean step, at which the range is taken too
    assert report.predicted_step_s == pytest.approx(MM.step_seconds(mean_tokens))
    assert report.step_range_s == pytest.approx((MM.step_seconds(mean_tokens), slower.step_seconds(mean_tokens)))
    table = report.table()
    assert f"not timed: its warm-up and one step of 3 slots x 4 rows x 32 tokens would take about {2 * line:.0f} s" \
        in table and "two timed probes extrapolated to the pack" in table


def test_a_step_pads_every_row_to_the_longest_of_all_slots_rows(tiny_dirs, tmp_path) -> None:
    """The run's step is as long as the longest row of every slot's micro-batch (padded to one of the pack's
    lengths), not one slot's: with a few long rows, a pack of 8 slots x 4 rows nearly always meets one."""
    spec = _spec(tmp_path, tiny_dirs)
    lengths = [10] * 90 + [40] * 10
    assert bucket_lengths(spec, lengths, 8) == (16, 48)
    one_slot, eight = step_length(spec, lengths, 1, 4), step_length(spec, lengths, 8, 4)
    assert eight[0] == 48 and eight[1] > 46  # 1 - 0.9 ** 32: 97% of the steps meet a 40-token row
    assert one_slot[1] == pytest.approx(16 + 32 * (1 - 0.9 ** 4), abs=3) and one_slot[0] == 48
    packed = _spec(tmp_path, tiny_dirs, "packed", train={"max_steps": 40, "micro_batch": 4, "sample_packing": True})
    assert step_length(packed, lengths, 2, 4)[0] == 48 == packed.data.max_length  # packed rows fill the row


def test_the_timed_slots_are_drawn_from_the_space(tiny_dirs, tmp_path) -> None:
    """Each slot a random point of the space over the fixed values (seeded): the pack mixes the target sets, ranks
    and variants a run's does."""
    search = {"rank": [2, 4, 8, 16], "targets": {"attn": ["q_proj", "v_proj"], "all": "all-linear"},
              "lr": {"low": 1e-4, "high": 3e-2, "log": True}, "dora": [False, True], "init": ["gaussian", "pissa"],
              "alpha": {"low": 4.0, "high": 64.0}, "warmup_steps": {"low": 0, "high": 10}}
    spec = _spec(tmp_path, tiny_dirs, search=search)
    specs = slot_specs(spec, 8)
    assert specs == slot_specs(spec, 8) and len(specs) == 8
    assert {s.rank for s in specs} <= {2, 4, 8, 16} and len({s.rank for s in specs}) > 1
    assert {s.targets for s in specs} == {("q_proj", "v_proj"), ("all-linear",)}
    assert all(1e-4 <= s.lr <= 3e-2 for s in specs) and all(s.micro_batch == 4 for s in specs)
    assert {s.dora for s in specs} == {False, True} and {s.init for s in specs} == {"gaussian", "pissa"}
    assert all(4 <= s.alpha <= 64 for s in specs) and len({s.alpha for s in specs}) == 8  # a float range's draws
    assert all(isinstance(s.warmup_steps, int) and 0 <= s.warmup_steps <= 10 for s in specs)  # an int range's


def test_a_pack_sharded_over_gpus_is_not_timed_in_one_process(tiny_dirs, tmp_path, monkeypatch) -> None:
    """``pack.shard: fsdp`` over 2 GPUs steps in two processes with FSDP's collectives: the plan keeps the line (and
    says why) rather than time one process's whole-base step; over one GPU it times as any pack, on the eager step
    the sharded run takes."""
    monkeypatch.setenv("LORA_SWEEP_CACHE", str(tmp_path / "cache"))
    spec = _spec(tmp_path, tiny_dirs, "sharded", pack={"max_slots": 3, "shard": "fsdp"})
    fake = FakeStep(0.1)

    def refused():  # noqa: ANN202
        raise AssertionError("nothing timed: no model loaded")

    two = _timer(spec, fake, load=refused, gpus=2)(3, 16, 4, MM)
    assert two.step_s is None and two.where == "not timed: a pack sharded over 2 GPUs steps in 2 processes; " \
                                               "the probes' line" and not fake.calls
    one = _timer(spec, fake)(3, 16, 4, MM)
    assert one.step_s == 0.1 and fake.calls[0]["cuda_graphs"] == "off"


class FakeTurnover(FakeStep):
    """A fake step that also measured the pack's start and its slots' turnover."""

    def __init__(self, seconds: float, setup_s: float, turnover_s: float) -> None:
        super().__init__(seconds)
        self.setup_s, self.turnover_s = setup_s, turnover_s

    def time_pack(self, specs, rows, length, **kwargs) -> PackTiming:  # noqa: ANN001, ANN003
        timing = super().time_pack(specs, rows, length, **kwargs)
        return PackTiming(timing.step_s, timing.steps, timing.wall_s, timing.step, self.setup_s, self.turnover_s)


def test_the_plan_counts_the_packs_start_and_every_trials_slot_turnover(tiny_dirs, tmp_path, monkeypatch) -> None:
    """A run ends every trial's slot (its adapter saved) and starts another in it, and starts its pack once: the
    plan times both on the sized pack (a turnover after the timed steps, the adapters saved by ``Packer.save``), says
    them on their own line and adds them to the total; a second plan reads them back from the cache."""
    monkeypatch.setenv("LORA_SWEEP_CACHE", str(tmp_path / "cache"))
    spec = _spec(tmp_path, tiny_dirs)
    fake = FakeTurnover(0.05, setup_s=1.5, turnover_s=0.3)
    report = plan_report(spec, [MM], "test", BASE, "cpu", timer=_timer(spec, fake))
    (call,) = fake.calls
    assert call["turnover"] is True and callable(call["on_end"])
    assert report.turnover_s == pytest.approx(1.5 + 12 * 0.3)  # the pack's start, then 12 trials' turnovers
    table = report.table()
    assert ("predicted slot turnover              5 s: the pack's start 1.5 s, then 300 ms per trial (its slot's "
            "end, its adapter saved, a new slot's start) x 12 trials, measured on the sized pack") in table
    total = report.predicted_total_s + report.predicted_eval_s + report.startup_s + 5.1 + report.storage_s
    assert f"predicted time for the trial budget  {total:.0f} s (" in table and "slot turnover 5 s" in table

    def refused():  # noqa: ANN202
        raise AssertionError("a cached timing loads no model")

    again = plan_report(spec, [MM], "test", BASE, "cpu", timer=_timer(spec, fake, load=refused))
    assert again.turnover_s == report.turnover_s and again.timed is not None and again.timed.setup_s == 1.5
    untimed = plan_report(spec, [MM], "test", BASE, "cpu")
    assert untimed.turnover_s == 0 and "not counted: the sized pack was not timed" in untimed.table()


def test_the_turnover_is_timed_on_the_loaded_model_with_the_adapters_saved(tiny_dirs, tmp_path, monkeypatch) -> None:
    """On the real tiny model: every slot of the timed pack ends once (an accumulating one too) and is saved as a
    run saves it, a new slot starts in it, and the pack's start and the turnover are measured beside the step, and
    a batch of the study's evaluation on the slots that ended (less from the turnover, in which it ran)."""
    from lora_sweep.packer.api import open_base

    monkeypatch.setenv("LORA_SWEEP_CACHE", str(tmp_path / "cache"))
    spec = _spec(tmp_path, tiny_dirs, search={"rank": [2, 4], "gradient_accumulation_steps": [1, 2]},
                 train={"max_steps": 40, "micro_batch": 2})
    packer = open_base(str(tiny_dirs("llama")), device="cpu")
    saved: list[tuple[int, list[str]]] = []
    real_save = packer.save

    def save(items, **kwargs):  # noqa: ANN001, ANN003, ANN202
        futures = real_save(items, **kwargs)
        saved.extend((slot, sorted(p.name for p in f.result().iterdir())) for (slot, _, _), f in zip(items, futures,
                                                                                                   strict=True))
        return futures

    monkeypatch.setattr(packer, "save", save)
    specs = slot_specs(spec, 3)
    assert {s.gradient_accumulation_steps for s in specs} == {1, 2}  # the seed draws both
    timed = PackTimer(spec, "cpu", LENGTHS, lambda: packer)(3, 4, 2, MM)
    assert timed.step_s is not None and timed.step_s > 0 and timed.setup_s > 0 and timed.turnover_s >= 0
    # the first slots to end scored a batch of the held-out rows with each of the study's evaluators, timed
    assert set(timed.eval_batch_s) == {e.name for e in spec.evaluators} == {"heldout_loss", "generation"}
    assert all(seconds > 0 for seconds in timed.eval_batch_s.values())
    assert set(timed.eval_first_s) == set(timed.eval_batch_s) and min(timed.eval_first_s.values()) >= 0
    assert 1 <= timed.eval_slots <= 3
    assert sorted(slot for slot, _ in saved) == [0, 1, 2]  # each slot's adapter, once
    assert all("adapter_config.json" in files for _, files in saved)  # written as a run writes it
    assert not packer.model.slot_paths and packer.model.store is None  # nothing left behind


def test_a_users_evaluator_is_never_run_by_the_plan(tiny_dirs, tmp_path, monkeypatch) -> None:
    """The sized pack's ending slots are scored by the study's built-in evaluators only: a ``custom`` function (a
    user's code) is neither imported nor run by a plan, and its estimate stays its declared cost's."""
    from lora_sweep.evaluators.registry import deferred_user_code
    from lora_sweep.packer.api import open_base

    monkeypatch.setenv("LORA_SWEEP_CACHE", str(tmp_path / "cache"))
    marker = tmp_path / "imported"
    evaluators = [{"name": "custom", "options": {"function": "metrics.py:score", "metric": "m"}}, "heldout_loss"]
    path = write_study(tmp_path, tiny_dirs("llama"), "user", budget={"trials": 4}, evaluators=evaluators,
                       train={"max_steps": 40, "micro_batch": 2})
    (path.parent / "metrics.py").write_text(f"open({str(marker)!r}, 'w').close()\n\n\ndef score(generation, row):\n"
                                            f"    return 1.0\n")
    with deferred_user_code():
        spec = load_study(path)
    packer = open_base(str(tiny_dirs("llama")), device="cpu")
    timed = PackTimer(spec, "cpu", LENGTHS, lambda: packer)(2, 4, 2, MM)
    assert set(timed.eval_batch_s) == {"heldout_loss"} and not marker.exists()


def test_a_short_evaluation_batch_is_timed_until_its_batches_hold_a_second(monkeypatch) -> None:
    """Each evaluator's batch on the sized pack is timed as the steps are: at least three times, then until as many
    as ``EVAL_TIMED_S`` holds of the fastest, at most ``EVAL_MAX_REPEATS``: 0.125 s batches 8 times, 0.5 s ones 3,
    0.01 s ones 25 (a batch another process slowed does not shorten it)."""
    clock = [0.0]

    def batches(seconds):  # noqa: ANN001, ANN202
        it = iter(seconds)

        def call() -> None:
            clock[0] += next(it)
        return call

    monkeypatch.setattr("time.perf_counter", lambda: clock[0])
    assert pack_step.timed_repeats(batches([0.125] * 50)) == [0.125] * 8
    assert pack_step.timed_repeats(batches([0.5] * 50)) == [0.5] * 3
    assert len(pack_step.timed_repeats(batches([0.01] * 50))) == pack_step.EVAL_MAX_REPEATS == 25
    assert len(pack_step.timed_repeats(batches([0.125, 2.0, 2.0] + [0.125] * 50))) == 8
