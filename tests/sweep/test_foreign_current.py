"""Axolotl's and torchtune's current LoRA examples run as their authors meant: the files of tests/sweep/data/current
with only the base model, the dataset and the output changed; the search and the budget on the command line."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from optuna.trial import TrialState

from lora_sweep.errors import ConfigError
from lora_sweep.packer.tiny.data import arithmetic_rows, write_jsonl
from lora_sweep.sweep.config.loader import load_study
from lora_sweep.sweep.session import spec_record
from lora_sweep.sweep.status import study_status
from lora_sweep.sweep.study import run_study
from tests.conftest import need_module, optuna_study

CURRENT = Path(__file__).parent / "data" / "current"


def _config(tmp_path: Path, model_dir: Path, name: str, replace: dict[str, str] | None = None) -> Path:
    """``data/current/<name>`` with BASE_MODEL, DATA and OUTPUT filled in (and any text ``replace``-d)."""
    train = tmp_path / "alpaca.jsonl"
    write_jsonl(train, arithmetic_rows(48, seed=3, fmt="alpaca"))
    text = (CURRENT / name).read_text()
    for word, value in (("BASE_MODEL", model_dir), ("DATA", train), ("OUTPUT", tmp_path / f"out-{name}"),
                        *(replace or {}).items()):
        text = text.replace(word, str(value))
    path = tmp_path / name
    path.write_text(text)
    return path


# A tiny model's 48 arithmetic rows pack into one row of the configs' 2,048-8,192 tokens, padded to that length
# (pad_to_sequence_len): each CPU step would then compute 8k positions (the Mistral config's two runs took 13 minutes
# of the suite). The command line sets the length a user shortens a first try to; the keys it replaces are checked
# by test_an_override_replaces_the_axolotl_key_whatever_the_spelling.
SHORT = "sequence_len=256"

# name: (tiny family, command-line overrides, the config's own value of the searched rank, its lr)
CONFIGS = {
    "axolotl-llama-3-qlora-1b.yml": ("llama", ["search.lora_r=[16, 32]", SHORT], 32, 2e-4),
    "axolotl-mistral-lora.yml": ("mistral", ["search.lora_r=[16, 32]", SHORT], 32, 2e-4),
    "axolotl-qwen2-qlora-fsdp.yaml": ("qwen2", ["search.lora_r=[16, 32]", SHORT], 32, 2e-4),
    "torchtune-llama3_2-1B_lora_single_device.yaml": ("llama-wide", ["search.lora_rank=[16, 64]", "model.device=cpu"],
                                                      64, 3e-4),
    "torchtune-qwen2_5-0.5B_lora_single_device.yaml": ("qwen2", ["search.lora_rank=[16, 32]", "model.device=cpu"],
                                                       32, 2e-3),
}


@pytest.fixture(scope="module")
def wide_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny llama twice as wide (128): its narrowest projection (v_proj, 128 -> 64) takes torchtune's rank 64."""
    from lora_sweep.packer.tiny.models import build_tiny_model

    return build_tiny_model("llama", tmp_path_factory.mktemp("tiny-llama-wide"), seed=0, hidden_size=128)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_current_example_runs_a_small_study_first_try(tiny_dirs, wide_llama, tmp_path, caplog, name: str) -> None:
    if "qlora" in name:  # model.quantize: nf4
        need_module("torchao", "qlora")
    family, overrides, rank, lr = CONFIGS[name]
    path = _config(tmp_path, wide_llama if family == "llama-wide" else tiny_dirs(family), name)
    with caplog.at_level(logging.WARNING):
        spec = load_study(path, [*overrides, "budget.trials=2"])
    ignored = [r.getMessage() for r in caplog.records if "ignored" in r.getMessage()]
    assert len(ignored) == 1, ignored  # every dropped key in one summary warning
    assert spec.baseline["rank"] == rank and spec.baseline["lr"] == pytest.approx(lr)
    lines: list[str] = []
    summary = run_study(spec, log=lines.append)
    trials = optuna_study(spec.out_dir, spec.name).get_trials()
    assert [t.state for t in trials] == [TrialState.COMPLETE] * 2, [t.user_attrs.get("reason") for t in trials]
    # the rank is searched; the config fixes its own alpha and lr, so the rank-16 trial would not train the
    # community default (r16, alpha 32, lr 2e-4): no trial is labelled so, the config's own is the baseline
    community = spec.train.alpha == 32 and spec.train.lr == pytest.approx(2e-4)
    assert not community
    baseline = trials[0]
    assert not any(t.user_attrs.get("default") for t in trials)
    assert baseline.user_attrs.get("baseline") and baseline.params["rank"] == rank  # the config's own setting
    assert summary.ended == "stopped: budget.trials reached: 2 trials used of 2 trials"
    info = study_status(spec.out_dir)
    roles = {b["number"]: b["role"] for b in info["best"]}
    assert roles == {0: "config baseline", 1: ""}
    assert info["vs_default"] is None or info["vs_default"]["against"] == "config baseline"
    if name == "axolotl-llama-3-qlora-1b.yml":  # the report names it too
        from lora_sweep.reports.html import write_report

        assert "#0 (config baseline)" in write_report(spec.out_dir).read_text()
    if name.startswith("torchtune"):  # num_warmup_steps: 100 against trials of a few steps
        assert any(line.startswith("warning: trial 0 warms up for 100 steps of its") and "warmup_ratio" in line
                   for line in lines), lines


def test_axolotl_identity_keys_are_ignored_with_the_others(tiny_dirs, tmp_path, caplog) -> None:
    path = _config(tmp_path, tiny_dirs("mistral"), "axolotl-mistral-lora.yml")
    with caplog.at_level(logging.WARNING):
        spec = load_study(path, ["search.lr=[1e-4, 2e-4]", "budget.trials=1"])
    ignored = next(r.getMessage() for r in caplog.records if "ignored" in r.getMessage())
    for key in ("model_type", "tokenizer_type", "attention", "pad_to_sequence_len"):
        assert key in ignored
    assert "load_in_8bit: the base runs unquantized" in caplog.text and spec.model.quantize is None
    assert spec.train.targets == ("all-linear",)  # lora_target_linear with the modules listed: every linear layer


def test_axolotl_qlora_fsdp_trusts_no_remote_code_and_trains_all_linear(tiny_dirs, tmp_path) -> None:
    need_module("torchao", "qlora")
    qwen = load_study(_config(tmp_path, tiny_dirs("qwen2"), "axolotl-qwen2-qlora-fsdp.yaml"),
                      ["search.lr=[1e-4, 2e-4]", "budget.trials=1"])
    assert qwen.model.quantize == "nf4" and qwen.train.targets == ("all-linear",)  # trust_remote_code: ignored


def test_every_refusal_of_a_file_is_named_at_once(tiny_dirs, tmp_path) -> None:
    path = _config(tmp_path, tiny_dirs("llama"), "axolotl-llama-3-qlora-1b.yml",
                   {"adapter: qlora": "adapter: ia3", "lora_model_dir:": "lora_model_dir: ./old",
                    "optimizer: adamw_bnb_8bit": "optimizer: lion", "logging_steps: 1": "logging_stepz: 1"})
    with pytest.raises(ConfigError) as err:
        load_study(path, ["search.lr=[1e-4, 2e-4]", "budget.trials=1"])
    lines = str(err.value).splitlines()
    assert lines[0] == f"{path}: 4 settings of this config cannot run here:"
    text = (CURRENT / "axolotl-llama-3-qlora-1b.yml").read_text().splitlines()
    for key in ("adapter", "lora_model_dir", "optimizer", "logging_steps"):
        line_no = next(i + 1 for i, t in enumerate(text) if t.startswith(key + ":"))
        assert any(x.startswith(f"{path}:{line_no}: ") for x in lines[1:]), (key, lines)
    assert len(lines) == 5 and "unknown key 'logging_stepz'" in str(err.value)


@pytest.mark.parametrize("override", ["data.max_length=128", "sequence_len=128", "data.sequence_len=128",
                                      "max_seq_length=128"])
def test_an_override_replaces_the_axolotl_key_whatever_the_spelling(tiny_dirs, tmp_path, override: str) -> None:
    path = _config(tmp_path, tiny_dirs("llama"), "axolotl-llama-3-qlora-1b.yml")
    spec = load_study(path, ["search.lr=[1e-4, 2e-4]", "budget.trials=1", override])
    assert spec.data.max_length == 128 and spec_record(spec)["data"]["max_length"] == 128  # the winner recorded
    lr = load_study(path, ["search.lora_r=[8, 16]", "budget.trials=1", "train.lr=1e-3"])
    assert lr.train.lr == 1e-3


@pytest.mark.parametrize("override", ["max_steps_per_epoch=2", "train.max_steps_per_epoch=2", "epochs=3"])
def test_an_override_replaces_the_torchtune_key(tiny_dirs, tmp_path, override: str) -> None:
    path = _config(tmp_path, tiny_dirs("llama"), "torchtune-llama3_2-1B_lora_single_device.yaml")
    spec = load_study(path, ["search.lora_rank=[8, 16]", "budget.trials=1", override])
    key, _, value = override.partition("=")
    field = key.rsplit(".", 1)[-1]
    assert getattr(spec.train, field) == int(value) and spec_record(spec)["train"][field] == int(value)
    moved = load_study(path, ["search.lora_rank=[8, 16]", "budget.trials=1", "train.warmup_ratio=0.1",
                              "train.warmup_steps=0", "batch_size=1"])
    assert (moved.train.warmup_ratio, moved.train.warmup_steps, moved.train.micro_batch) == (0.1, 0, 1)


def test_a_baseline_outside_the_space_is_skipped_with_a_warning(tiny_dirs, tmp_path, caplog) -> None:
    path = _config(tmp_path, tiny_dirs("mistral"), "axolotl-mistral-lora.yml")
    spec = load_study(path, ["search.lora_r=[8, 16]", "budget.trials=1", SHORT])
    with caplog.at_level(logging.WARNING):
        run_study(spec, log=lambda m: None)
    assert "no baseline trial of the config's own hyperparameters: its rank=32 lies outside search.rank" in caplog.text
    # nor a community default: the rank-16 trial would train the config's alpha 16, not the default's 32
    assert "no community-default trial: the study fixes alpha 16" in caplog.text
    (only,) = optuna_study(spec.out_dir, spec.name).get_trials()
    assert not only.user_attrs.get("default") and not only.user_attrs.get("baseline")
