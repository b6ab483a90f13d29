"""``sweep plan``'s time model counts what a trial really runs: optimizer steps x accumulation, and epochs."""

from __future__ import annotations

import math

from lora_sweep.packer.data.packing import batches_per_epoch
from lora_sweep.packer.data.rows import load_examples
from lora_sweep.packer.model.load import load_base
from lora_sweep.sweep.config.loader import load_study
from lora_sweep.sweep.planning import trial_micro_steps
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


def test_a_sharded_plan_counts_one_ranks_share_of_the_base_per_gpu(tiny_dirs, tmp_path) -> None:
    """``pack.shard: fsdp`` over N GPUs: the plan's memory is per GPU, the whole base replaced by what one rank
    holds of it (``packer.model.shard.base_share``: its shard, the head kept whole, two units gathered), the slots'
    adapters, optimizer state and activations as in a one-GPU pack."""
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
    pm = PackedModel(model)
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

    from lora_sweep.sweep.cli import cli

    sharded = tmp_path / "sharded.yaml"
    result = CliRunner().invoke(cli, ["plan", str(sharded), "--gpus", "2"])
    assert result.exit_code == 0, result.output
    assert "predicted peak of a full pack per GPU (2 GPUs, FSDP)" in result.stdout, result.stdout
    assert "(each rank reads its shard by rows)" in result.stdout  # from the cache too
    # a world size the cache holds no share for (3): the plan loads the model and computes it (no refusal)
    three = CliRunner().invoke(cli, ["plan", str(sharded), "--gpus", "3"])
    assert three.exit_code == 0 and "per GPU (3 GPUs, FSDP)" in three.stdout, three.output


def test_the_plan_models_the_evaluations_time_from_its_step_model(tiny_dirs, tmp_path) -> None:
    """``sweep plan`` predicted 48 s for a run of 74 s, 31% of which was evaluation: the evaluators' forwards are
    now counted, a forward costing the step's fixed time and a third of its per-token time."""
    import pytest

    from lora_sweep.packer.plan import MemoryModel
    from lora_sweep.sweep.planning import eval_rows, eval_seconds

    mm = MemoryModel(base_bytes=0, bytes_per_token=0, bytes_per_token_rank=0, bytes_per_param=0,
                     seconds_per_token=3e-4, seconds_per_step=0.01)
    evaluators = [{"name": "heldout_loss"}, {"name": "generation", "options": {"max_new_tokens": 4, "batch_size": 4}}]
    spec = load_study(write_study(tmp_path, tiny_dirs("llama"), "evals", budget={"trials": 6}, evaluators=evaluators))
    rows = eval_rows(spec)
    assert rows == sum(1 for line in spec.data.eval.read_text().splitlines() if line.strip()) > 0

    def forward(tokens: float) -> float:
        return 0.01 + 3e-4 * tokens / 3

    heldout = math.ceil(rows / 8) * forward(8 * 3 * 20.0)  # 3 slots, rows of 20 tokens
    generation = math.ceil(rows / 4) * (forward(4 * 3 * 20.0) + 4 * forward(4 * 3))
    per_pack = heldout + generation + heldout  # the cohort SHA rung at step 6 scores the proxy once more
    seconds, line = eval_seconds(spec, mm, 3, rows, 20.0, 12)
    assert seconds == pytest.approx(per_pack * 2)  # 6 trials, 3 at a time
    assert line.startswith(f"{seconds:.0f} s: heldout_loss over {rows} rows, generation of 4 tokens for {rows} "
                           f"prompts per trial, 3 slots at a time, 1 proxy evaluation per trial")
    longer = load_study(write_study(tmp_path, tiny_dirs("llama"), "evals", budget={"trials": 6},
                                    evaluators=evaluators, pruning={"kind": "none"}, train={"eval_every": 4}))
    assert eval_seconds(longer, mm, 3, rows, 20.0, 12)[0] == pytest.approx((heldout * 4 + generation) * 2)
