"""``sweep plan``'s time model counts what a trial really runs: optimizer steps x accumulation, and epochs."""

from __future__ import annotations

import math

from lora_sweep.packer.data import load_examples
from lora_sweep.packer.model import load_base
from lora_sweep.packer.packing import batches_per_epoch
from lora_sweep.sweep.loader import load_study
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
