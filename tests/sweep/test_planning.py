"""``sweep plan``'s time model counts what a trial really runs: optimizer steps x accumulation, and epochs."""

from __future__ import annotations

import math

from lora_sweep.packer.data.packing import batches_per_epoch
from lora_sweep.packer.data.rows import load_examples
from lora_sweep.packer.model.load import load_base
from lora_sweep.sweep.config.loader import load_study
from lora_sweep.sweep.planning import padded_mean_length, step_mean_length, trial_micro_steps
from tests.conftest import write_study


def _spec(tmp_path, model_dir, **train):  # noqa: ANN001, ANN003, ANN202
    return load_study(write_study(tmp_path, model_dir, "timed", train={"micro_batch": 4, **train}))


def test_a_trial_takes_its_optimizer_steps_times_its_accumulation(tiny_dirs, tmp_path) -> None:
    spec = _spec(tmp_path, tiny_dirs("llama"), max_steps=12, gradient_accumulation_steps=3)
    assert trial_micro_steps(spec, 4) == 36


def test_a_searched_accumulation_counts_its_largest_value(tiny_dirs, tmp_path) -> None:
    path = write_study(tmp_path, tiny_dirs("llama"), "searched", train={"max_steps": 10, "micro_batch": 4},
                       search={"rank": [2, 4], "gradient_accumulation_steps": [1, 4]})
    assert trial_micro_steps(load_study(path), 4) == 40


def test_epochs_count_the_data_as_a_trial_does(tiny_dirs, tmp_path) -> None:
    spec = _spec(tmp_path, tiny_dirs("llama"), epochs=2, gradient_accumulation_steps=2)
    _, tokenizer = load_base(str(tiny_dirs("llama")))
    examples = load_examples(spec.data.train, tokenizer, fmt=spec.data.format, max_length=spec.data.max_length)
    batches = batches_per_epoch(examples, 4)
    assert batches > 4
    assert trial_micro_steps(spec, 4, examples) == 2 * math.ceil(batches / 2) * 2  # 2 epochs, accumulation 2
    capped = _spec(tmp_path, tiny_dirs("llama"), epochs=2, max_steps_per_epoch=3, gradient_accumulation_steps=2)
    assert trial_micro_steps(capped, 4, examples) == 2 * 3 * 2


def test_a_sample_packed_study_times_steps_of_packed_rows(tiny_dirs, tmp_path) -> None:
    """With ``train.sample_packing`` a step holds packed rows of up to ``data.max_length`` tokens, not the examples:
    the plan's tokens per row are the packed rows' (the Axolotl example's plan counted a step's tokens 8x too few)."""
    lengths = [6, 10, 5, 15, 8, 12, 7, 11] * 8
    plain = _spec(tmp_path, tiny_dirs("llama"))
    assert step_mean_length(plain, lengths) == padded_mean_length(lengths, 4)
    packed = _spec(tmp_path, tiny_dirs("llama"), sample_packing=True)
    assert packed.data.max_length >= 32 and max(lengths) < packed.data.max_length
    assert step_mean_length(packed, lengths) > 0.75 * packed.data.max_length > 2 * padded_mean_length(lengths, 4)


def test_a_sharded_plan_counts_one_ranks_share_of_the_base_per_gpu(tiny_dirs, tmp_path) -> None:
    """``pack.shard: fsdp`` over N GPUs: the plan's memory is per GPU, the whole base replaced by what one rank
    holds of it (``packer.model.shard.base_share``: its shard, the head kept whole, two units gathered), the slots'
    adapters, optimizer state and activations as in a one-GPU pack."""
    from lora_sweep.packer.api import Packer
    from lora_sweep.packer.model.packed import PackedModel
    from lora_sweep.packer.model.shard import base_share
    from lora_sweep.packer.probe import plain_param_bytes
    from lora_sweep.sweep.planning import plan_pack

    model, _ = load_base(str(tiny_dirs("llama")))
    share = base_share(model, 2).peak
    whole = plain_param_bytes(model)
    # (two layers: the two units gathered beside the shard outweigh the saving; a deep model's share is far less)
    assert share != whole, "the share must differ from the base for the check to mean something"
    spec = load_study(write_study(tmp_path, tiny_dirs("llama"), "sharded", pack={"max_slots": 3, "shard": "fsdp"}))
    pm = Packer(PackedModel(model))
    one = plan_pack(spec, pm)
    two = plan_pack(spec, pm, gpus=2)
    assert (one.gpus, two.gpus) == (1, 2)
    assert two.predicted_peak_bytes == one.predicted_peak_bytes - whole + share
    assert two.base_bytes == one.memory.base_bytes - whole + share
    table = two.table()
    assert "predicted peak of a full pack per GPU (2 GPUs, FSDP)" in table and "replicated on every GPU" in table
    # loading: a safetensors checkpoint loads by rows (packer.model.shard_load), one rank's share and one padded chunk
    load = base_share(model, 2).load_peak
    assert two.load_peak_bytes == load < share and two.predicted_peak_bytes > load
    assert "peak while loading the base, per GPU" in table and "GiB (each rank reads its shard by rows)" in table
    unsharded = load_study(write_study(tmp_path, tiny_dirs("llama"), "whole", pack={"max_slots": 3}))
    assert plan_pack(unsharded, pm, gpus=2).predicted_peak_bytes == one.predicted_peak_bytes  # shard: none
    from click.testing import CliRunner

    from lora_sweep.cli import cli

    sharded = tmp_path / "sharded.yaml"
    result = CliRunner().invoke(cli, ["plan", str(sharded), "--gpus", "2"])
    assert result.exit_code == 0, result.output
    assert "predicted peak of a full pack per GPU (2 GPUs, FSDP)" in result.stdout, result.stdout
    assert "(each rank reads its shard by rows)" in result.stdout  # from the cache too
    # a world size the cache holds no share for (3): the plan loads the model and computes it (no refusal)
    three = CliRunner().invoke(cli, ["plan", str(sharded), "--gpus", "3"])
    assert three.exit_code == 0 and "per GPU (3 GPUs, FSDP)" in three.stdout, three.output


def test_the_plan_times_the_evaluations_the_schedule_runs(tiny_dirs, tmp_path) -> None:
    """Trials finishing together are scored together (each forward's fixed time once for all of them), a rung scores
    its arrivals on the proxy (a held-out loss), and a forward costs the base forward's fixed time (measured) plus a
    third of the step's per-token time."""
    import pytest

    from lora_sweep.packer.plan import MemoryModel
    from lora_sweep.sweep.planning import eval_rows, eval_seconds
    from lora_sweep.sweep.schedule import Schedule

    mm = MemoryModel(base_bytes=0, bytes_per_token=0, bytes_per_token_rank=0, bytes_per_param=0,
                     seconds_per_token=3e-4, seconds_per_step=0.5)  # the step's fixed time is not a forward's
    evaluators = [{"name": "heldout_loss"}, {"name": "generation", "options": {"max_new_tokens": 4, "batch_size": 4}}]
    spec = load_study(write_study(tmp_path, tiny_dirs("llama"), "evals", budget={"trials": 6}, evaluators=evaluators))
    rows = eval_rows(spec)
    assert rows == sum(1 for line in spec.data.eval.read_text().splitlines() if line.strip()) > 0
    # 3 trials finished in 2 evaluations, 6 reached the rung in 2, no eval_every
    schedule = Schedule(pack_steps=24, reached=(6,), finished=3, rung_events=2, final_events=2)
    per_token, fixed = 3e-4 / 3, 0.01
    heldout = math.ceil(rows / 8) * (2 * fixed + 3 * 8 * 20.0 * per_token)
    generation = math.ceil(rows / 4) * (2 * 5 * fixed + 3 * 4 * (20.0 + 4) * per_token)
    rungs = math.ceil(rows / 8) * (2 * fixed + 6 * 8 * 20.0 * per_token)
    seconds, line = eval_seconds(spec, mm, fixed, schedule, rows, 20.0)
    assert seconds == pytest.approx(heldout + generation + rungs)
    assert line == (f"{seconds:.0f} s: heldout_loss over {rows} rows, generation of 4 tokens for {rows} prompts for "
                    f"each of 3 finished trials, 6 rung evaluations")
    every = Schedule(pack_steps=24, reached=(), finished=3, rung_events=0, final_events=2, curve_events=4,
                     curve_evals=9)
    curve = math.ceil(rows / 8) * (4 * fixed + 9 * 8 * 20.0 * per_token)
    assert eval_seconds(spec, mm, fixed, every, rows, 20.0)[0] == pytest.approx(heldout + generation + curve)


def test_the_plan_counts_the_pack_steps_under_the_rungs_and_the_start_up(tiny_dirs, tmp_path, monkeypatch) -> None:
    """``sweep plan`` said "(no pruning)" and counted every trial to its last step for a study that prunes: the time
    is now the expected schedule's pack steps (``sweep.schedule``) plus the run's start-up measured at calibration."""
    monkeypatch.setenv("LORA_SWEEP_CACHE", str(tmp_path / "cache"))  # no other test's tokenizing of the same rows
    from lora_sweep.packer.plan import BaseShape, MemoryModel
    from lora_sweep.sweep.planning import pack_schedule, plan_report
    from lora_sweep.sweep.schedule import expected_schedule

    mm = MemoryModel(base_bytes=1000, bytes_per_token=10, bytes_per_token_rank=1, bytes_per_param=16,
                     seconds_per_token=1e-5, seconds_per_step=0.02)
    base = BaseShape((("q_proj", 64, 64), ("v_proj", 64, 64)), 1000, forward_s=0.002, load_s=2.0, imports_s=3.0)
    path = write_study(tmp_path, tiny_dirs("llama"), "pruned", budget={"trials": 12}, train={"max_steps": 40,
                       "micro_batch": 4, "gradient_accumulation_steps": 2}, pruning={"kind": "cohort_sha",
                       "rungs": [10, 20], "reduction_factor": 3})
    spec = load_study(path)
    report = plan_report(spec, [mm], "test", base, "cpu", mean_len=20.0)
    expected = expected_schedule(12, 3, 40, (10, 20), 3, spared=1)  # the community default (rank 16 in the space)
    assert pack_schedule(spec, 3, 40) == expected == report.schedule
    assert report.pack_steps == math.ceil(expected.pack_steps * 2) < 12 * 40 * 2 / 3
    assert report.predicted_total_s == report.pack_steps * report.predicted_step_s
    assert report.startup_s == 5.0
    table = report.table()
    assert "(no pruning)" not in table
    total = report.predicted_total_s + report.predicted_eval_s + 5.0
    assert f"predicted time for the trial budget  {total:.0f} s ({report.pack_steps} pack steps" in table
    reached = expected.reached[0]
    assert f"cohort SHA keeping 1/3 at steps 10, 20 of 40: of 12 trials {reached:.1f} reach step 10" in table
    flat = load_study(write_study(tmp_path, tiny_dirs("llama"), "flat", budget={"trials": 12}, pruning={"kind": "none"},
                                  train={"max_steps": 40, "micro_batch": 4}))
    plain = plan_report(flat, [mm], "test", base, "cpu", mean_len=20.0)
    assert plain.pack_steps == 12 * 40 / 3 and "none (every trial trains to its last step)" in plain.table()
    unmeasured = plan_report(flat, [mm], "test", BaseShape(base.projections, 1000), "cpu", mean_len=20.0)
    assert "start-up not counted: the cached calibration was measured inside a run" in unmeasured.table()


def test_the_start_up_counts_the_imports_from_the_processs_start(tiny_dirs, tmp_path, monkeypatch) -> None:
    """A run's split counts its imports from the process's start (``sweep.timing.process_started``), the
    interpreter's own start included: the plan's start-up measures them from the same point, not from
    ``lora_sweep``'s import."""
    import time

    import lora_sweep.sweep.timing as timing
    from lora_sweep.sweep.planning import load_and_calibrate

    monkeypatch.setenv("LORA_SWEEP_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(timing, "process_started", lambda: (time.time() - 1e6, "process"))
    spec = _spec(tmp_path, tiny_dirs("llama"))
    _, _, base, _, _ = load_and_calibrate(spec, "cpu", 1, 1)
    assert 1e6 - 1 <= base.imports_s < 1e6 + 600 and base.load_s > 0  # (1 s: the clock's float rounding)


def test_the_start_up_counts_the_datas_tokenizing(tiny_dirs, tmp_path, monkeypatch) -> None:
    """A run reads and tokenizes its training and held-out rows before its first step (its split's ``load:data``):
    the plan times the training rows' tokenizing where it tokenizes them, keeps it with their lengths, and adds it to
    the start-up, the held-out rows at the same pace."""
    from lora_sweep.packer.plan import BaseShape, MemoryModel
    from lora_sweep.sweep.calibration import tokenize_seconds
    from lora_sweep.sweep.planning import plan_report, train_lengths

    monkeypatch.setenv("LORA_SWEEP_CACHE", str(tmp_path / "cache"))
    spec = _spec(tmp_path, tiny_dirs("llama"))
    mm = MemoryModel(base_bytes=1000, bytes_per_token=10, seconds_per_token=1e-5, seconds_per_step=0.02)
    base = BaseShape((("q_proj", 64, 64),), 1000, forward_s=0.002, load_s=2.0, imports_s=3.0)
    assert tokenize_seconds(spec) == 0 and plan_report(spec, [mm], "test", base, "cpu").startup_s == 5.0
    _, tokenizer = load_base(str(tiny_dirs("llama")))
    train_lengths(spec, tokenizer)
    seconds = tokenize_seconds(spec)
    assert seconds > 0 and plan_report(spec, [mm], "test", base, "cpu").startup_s == 5.0 + seconds
    unmeasured = BaseShape(base.projections, 1000)  # a calibration a run made: no start-up measured, none counted
    assert plan_report(spec, [mm], "test", unmeasured, "cpu").startup_s == 0


def test_each_evaluators_estimate_goes_through_its_batch_measured_on_the_sized_pack(tiny_dirs, tmp_path) -> None:
    """The estimate per batch (a base forward's fixed time, a third of the step's per-token time) left the runs'
    evaluations 2-3x above it: with a batch of each evaluator scored on the sized pack's ending slots, each
    evaluator's estimate (finals, rungs) is scaled by that batch's seconds over the same batch as estimated."""
    import pytest

    from lora_sweep.packer.plan import MemoryModel
    from lora_sweep.sweep.planning import eval_rows, eval_seconds
    from lora_sweep.sweep.schedule import Schedule

    mm = MemoryModel(base_bytes=0, bytes_per_token=0, bytes_per_token_rank=0, bytes_per_param=0,
                     seconds_per_token=3e-4, seconds_per_step=0.5)
    evaluators = [{"name": "heldout_loss"}, {"name": "generation", "options": {"max_new_tokens": 4, "batch_size": 4}}]
    spec = load_study(write_study(tmp_path, tiny_dirs("llama"), "evals", budget={"trials": 6}, evaluators=evaluators))
    rows = eval_rows(spec)
    schedule = Schedule(pack_steps=24, reached=(6,), finished=3, rung_events=2, final_events=2)
    per_token, fixed = 3e-4 / 3, 0.01
    heldout = math.ceil(rows / 8) * (2 * fixed + 3 * 8 * 20.0 * per_token)
    generation = math.ceil(rows / 4) * (2 * 5 * fixed + 3 * 4 * (20.0 + 4) * per_token)
    rungs = math.ceil(rows / 8) * (2 * fixed + 6 * 8 * 20.0 * per_token)
    one_heldout = fixed + 2 * 8 * 20.0 * per_token  # one batch of 2 slots, as the plan estimates it
    measured = {"heldout_loss": 3 * one_heldout}  # measured 3x that; generation not measured: as estimated
    seconds, line = eval_seconds(spec, mm, fixed, schedule, rows, 20.0, measured, 2)
    assert seconds == pytest.approx(3 * heldout + generation + 3 * rungs)
    assert line.endswith("6 rung evaluations; scaled by a batch of each scored on the sized pack (heldout_loss x3.00)")
    assert eval_seconds(spec, mm, fixed, schedule, rows, 20.0, measured, 0)[0] == pytest.approx(
        heldout + generation + rungs)  # no slots scored: nothing to scale by
    # what its first call took beyond a batch (the rows' tokenizing): once a run, though it scores finals and rungs
    once, line = eval_seconds(spec, mm, fixed, schedule, rows, 20.0, measured, 2, {"heldout_loss": 1.5})
    assert once == pytest.approx(seconds + 1.5)
    assert line.endswith("(heldout_loss x3.00 and 1.5 s once)")
