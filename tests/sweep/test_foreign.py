"""Axolotl and torchtune configs as study files: every key of their published LoRA examples."""

from __future__ import annotations

import logging
import re
import subprocess
import sys
from pathlib import Path

import optuna
import pytest
import yaml
from optuna.trial import TrialState

from lora_sweep.errors import ConfigError
from lora_sweep.sweep.config.loader import load_study
from lora_sweep.sweep.study import run_study
from tests.conftest import need_module, optuna_study
from tests.helpers import foreign_config

ROOT = Path(__file__).resolve().parents[2]
DATA = Path(__file__).parent / "data"


def _trials(out: Path, name: str) -> list[optuna.trial.FrozenTrial]:
    return optuna_study(out, name).get_trials()


def test_axolotl_lora_1b_runs_a_small_study(tiny_dirs, tmp_path, caplog) -> None:
    path = foreign_config(tmp_path, tiny_dirs("llama"), "axolotl-lora-1b.yml")
    with caplog.at_level(logging.WARNING):
        spec = load_study(path)
    warnings = [r.getMessage() for r in caplog.records if "ignored" in r.getMessage()]
    assert len(warnings) == 1, warnings  # one summary warning for every dropped key
    for key in ("wandb_project", "flash_attention", "deepspeed", "fsdp", "logging_steps", "saves_per_epoch", "bf16",
                "tf32", "special_tokens", "eval_sample_packing"):
        assert key in warnings[0]
    assert "adamw_8bit runs as fp32 AdamW" in caplog.text
    t = spec.train
    assert (t.gradient_accumulation_steps, t.micro_batch, t.epochs, t.sample_packing) == (2, 2, 1, True)
    assert (t.alpha, t.dropout, t.schedule, t.warmup_steps, t.weight_decay) == (32, 0.05, "cosine", 10, 0.0)
    assert set(t.targets) == {"gate_proj", "down_proj", "up_proj", "q_proj", "v_proj", "k_proj", "o_proj"}
    assert {p.name for p in spec.search.params} == {"rank", "lr"}  # searched: the file's lora_r, lr are dropped
    assert spec.data.max_length == 96 and spec.data.format == "alpaca" and not spec.data.train_on_prompt
    assert spec.pack.activation_checkpointing and spec.out_dir == tmp_path / "out-axolotl-lora-1b.yml"
    train_rows = spec.data.train.read_text().splitlines()
    eval_rows = spec.data.eval.read_text().splitlines()
    assert (len(train_rows), len(eval_rows)) == (43, 5) and not set(train_rows) & set(eval_rows)  # seeded split
    assert load_study(path).data.eval.read_text() == spec.data.eval.read_text()  # the same split again
    run_study(spec, log=lambda m: None)
    trials = _trials(spec.out_dir, spec.name)
    assert len(trials) == 2 and all(tr.state == TrialState.COMPLETE for tr in trials)


def test_an_axolotl_configs_wandb_keys_log_to_wandb_offline_with_no_key_of_ours(tiny_dirs, tmp_path, caplog,
                                                                                monkeypatch) -> None:
    need_module("wandb", "wandb")
    from lora_sweep import api
    from tests.sweep.trackers.readers import wandb_logged

    monkeypatch.setenv("WANDB_SILENT", "true")
    path = foreign_config(tmp_path, tiny_dirs("llama"), "axolotl-lora-1b.yml", wandb_project="sweeps",
                          wandb_mode="offline", wandb_watch="gradients")
    with caplog.at_level(logging.WARNING):
        spec = load_study(path)
    assert [(t.name, dict(t.options)) for t in spec.trackers] == [("wandb", {"project": "sweeps", "mode": "offline"})]
    ignored = next(r.getMessage() for r in caplog.records if "ignored" in r.getMessage())
    assert "wandb_watch" in ignored and "wandb_project" not in ignored and "wandb_mode" not in ignored
    api.run(spec, log=lambda m: None)
    logged = wandb_logged(spec.out_dir)
    assert len(logged.parents) == 1 and sorted(logged.children) == [0, 1]
    assert all(c.state == "COMPLETE" and c.loss_steps for (c,) in logged.children.values())


def test_torchtune_lora_recipe_runs_a_small_study(tiny_dirs, tmp_path) -> None:
    spec = load_study(foreign_config(tmp_path, tiny_dirs("llama"), "torchtune-1B-lora.yaml"))
    t = spec.train
    assert set(t.targets) == {"q_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    assert (t.alpha, t.lr, t.weight_decay, t.schedule, t.warmup_steps) == (128, 3e-4, 0.01, "cosine", 2)
    assert (t.micro_batch, t.gradient_accumulation_steps, t.epochs, t.max_steps_per_epoch) == (4, 2, 1, 3)
    assert spec.pack.chunked_ce is True and spec.model.dtype == "float32" and spec.data.format == "alpaca"
    run_study(spec, log=lambda m: None)
    trials = _trials(spec.out_dir, spec.name)
    assert len(trials) == 2 and all(tr.state == TrialState.COMPLETE for tr in trials)
    import sqlite3

    with sqlite3.connect(spec.out_dir / "results.db") as db:
        assert {s for (s,) in db.execute("select steps_done from trials")} == {3}  # 1 epoch capped at 3 steps


def test_a_torchtune_configs_own_alpha_makes_its_baseline_the_reference_not_a_community_default(
        tiny_dirs, tmp_path, caplog) -> None:
    """lora_alpha: 128 is fixed and the rank searched over [8, 16]: the rank-16 trial would train alpha 128, so
    no trial is labelled the community default (r16, alpha 32); the config's own (rank 8, alpha 128) is the
    baseline trial, named so in the run's lines, status and the report, and the best is measured against it."""
    from lora_sweep.reports.html import write_report
    from lora_sweep.sweep.status import study_status

    model = {"_component_": "torchtune.models.llama3_2.lora_llama3_2_1b", "lora_attn_modules": ["q_proj", "v_proj"],
             "lora_rank": 8, "lora_alpha": 128, "lora_dropout": 0.0}
    path = foreign_config(tmp_path, tiny_dirs("llama"), "torchtune-1B-lora.yaml", model=model,
                          search={"lora_rank": [8, 16]}, budget={"trials": 3})
    spec = load_study(path)
    lines: list[str] = []
    with caplog.at_level(logging.WARNING):
        run_study(spec, log=lines.append)
    assert "no community-default trial: the study fixes alpha 128, lr 0.0003 (the community default trains rank 16, " \
           "alpha 32, lr 0.0002)" in caplog.text
    trials = _trials(spec.out_dir, spec.name)
    assert not any(t.user_attrs.get("default") for t in trials)
    assert trials[0].user_attrs.get("baseline") and trials[0].params == {"rank": 8}
    assert any(line.startswith("trial 0 (config baseline) started") for line in lines), lines
    info = study_status(spec.out_dir)
    assert info["vs_default"]["against"] == "config baseline" and info["vs_default"]["default"] == 0
    html = write_report(spec.out_dir).read_text()
    assert "against the config baseline trial #0 (the config&#x27;s own hyperparameters)" in html or \
        "the config baseline is the best" in html


@pytest.mark.parametrize(("changes", "expected"), [({}, None), ({"clip_grad_norm": None}, None),
                                                    ({"clip_grad_norm": 0.5}, 0.5)])
def test_a_torchtune_config_clips_only_when_clip_grad_norm_is_set(tiny_dirs, tmp_path, changes, expected) -> None:
    """torchtune's LoRA recipes clip only with ``clip_grad_norm`` set; our own default (1.0) must not leak in."""
    path = foreign_config(tmp_path, tiny_dirs("llama"), "torchtune-1B-lora.yaml", **changes)
    assert load_study(path).train.max_grad_norm == expected


def _cli(path: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lora_sweep", "run", str(path), "--quiet"], capture_output=True,
                          text=True, timeout=120, cwd=ROOT)


def test_axolotl_qlora_1b_runs_a_small_study_over_an_nf4_base(tiny_dirs, tmp_path) -> None:
    need_module("torchao", "qlora")
    spec = load_study(foreign_config(tmp_path, tiny_dirs("llama"), "axolotl-qlora-1b.yml"))
    assert spec.model.quantize == "nf4"  # adapter: qlora and load_in_4bit: true
    t = spec.train
    assert (t.gradient_accumulation_steps, t.micro_batch, t.sample_packing, t.warmup_ratio) == (4, 2, True, 0.1)
    run_study(spec, log=lambda m: None)
    trials = _trials(spec.out_dir, spec.name)
    assert len(trials) == 2 and all(tr.state == TrialState.COMPLETE for tr in trials)


@pytest.mark.parametrize("changes", [{"adapter": "lora"}, {"load_in_4bit": False}])
def test_either_qlora_key_alone_asks_for_the_nf4_base(tiny_dirs, tmp_path, changes: dict) -> None:
    path = foreign_config(tmp_path, tiny_dirs("llama"), "axolotl-qlora-1b.yml", **changes)
    assert load_study(path).model.quantize == "nf4"


def test_the_lora_config_keeps_the_base_unquantised(tiny_dirs, tmp_path) -> None:
    assert load_study(foreign_config(tmp_path, tiny_dirs("llama"), "axolotl-lora-1b.yml")).model.quantize is None


def test_torchtune_qlora_builder_asks_for_the_nf4_base(tiny_dirs, tmp_path) -> None:
    path = foreign_config(tmp_path, tiny_dirs("llama"), "torchtune-1B-lora.yaml")
    doc = yaml.safe_load(path.read_text())
    doc["model"]["_component_"] = "torchtune.models.llama3_2.qlora_llama3_2_1b"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    assert load_study(path).model.quantize == "nf4"


REFUSED = {
    "adapter": ("dora", "adapter: must be one of lora, qlora (got 'dora')"),
    "gptq": (True, "gptq: a GPTQ base is not supported yet"),
    "datasets": ([{"path": "teknium/GPT4-LLM-Cleaned", "type": "alpaca"}], "datasets.0.path: only local files work"),
    "optimizer": ("lion_8bit", "optimizer: only AdamW is supported"),
    "group_by_length": (True, "group_by_length: batches grouped by length are not supported"),
    "lora_model_dir": ("./old-adapter", "lora_model_dir: starting from a saved adapter is not supported yet"),
}


@pytest.mark.parametrize("key", list(REFUSED))
def test_each_refused_axolotl_key_is_one_error_naming_it(tiny_dirs, tmp_path, key: str) -> None:
    value, message = REFUSED[key]
    path = foreign_config(tmp_path, tiny_dirs("llama"), "axolotl-lora-1b.yml", **{key: value})
    with pytest.raises(ConfigError, match=re.escape(message)) as err:
        load_study(path)
    assert "\n" not in str(err.value) and str(path) in str(err.value)


def test_refused_key_exits_2_through_the_cli(tiny_dirs, tmp_path) -> None:
    path = foreign_config(tmp_path, tiny_dirs("llama"), "axolotl-lora-1b.yml",
                          datasets=[{"path": "teknium/GPT4-LLM-Cleaned", "type": "alpaca"}])
    result = _cli(path)
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "datasets.0.path: only local files work" in result.stderr


TT_REFUSED = {
    "model": ({"_component_": "torchtune.models.llama3_2.dora_llama3_2_1b", "lora_attn_modules": ["q_proj"]},
              r"only LoRA model builders \(lora_\*, qlora_\*\) are supported \(got dora_llama3_2_1b\)"),
    "dataset": ({"_component_": "torchtune.datasets.alpaca_cleaned_dataset"}, "only local files work"),
    "optimizer": ({"_component_": "torch.optim.SGD", "lr": 0.1},
                  r"optimizer._component_: SGD is not supported \(expected AdamW\)"),
}


@pytest.mark.parametrize("key", list(TT_REFUSED))
def test_each_refused_torchtune_key_is_one_error_naming_it(tiny_dirs, tmp_path, key: str) -> None:
    value, message = TT_REFUSED[key]
    with pytest.raises(ConfigError, match=message) as err:
        load_study(foreign_config(tmp_path, tiny_dirs("llama"), "torchtune-1B-lora.yaml", **{key: value}))
    assert "\n" not in str(err.value) and key in str(err.value)


# Keys of the formats that the example files above lack, with a value a user would write.
EXTRA_KEYS = {
    "torchtune": {"dataset.split": "train", "optimizer.foreach": True, "loss.num_output_chunks": 8, "seed": 42,
                  "log_level": "INFO", "clip_grad_norm": 1.0, "optimizer_in_bwd": False, "dataset.train_on_input": True,
                  "model.use_dora": False, "model.quantize_base": False, "model.apply_lora_to_output": False},
    "axolotl": {"datasets.0.ds_type": "json", "datasets.0.split": "train", "seed": None, "val_set_size": 0.1,
                "lora_fan_in_fan_out": None, "bf16": "auto", "trust_remote_code": False, "load_in_8bit": False,
                "warmup_ratio": 0.1, "peft_use_rslora": True, "train_on_inputs": False},
}


def _paths(data: dict, prefix: tuple = ()) -> list[tuple]:
    """Every key path of a config: top-level keys, the keys of a ``_component_`` mapping, a dataset entry's."""
    out = []
    for key, value in data.items():
        path = (*prefix, key)
        if key == "_component_":
            continue
        out.append(path)
        if not prefix and isinstance(value, dict) and "_component_" in value:
            out += _paths(value, path)
        if key == "datasets" and isinstance(value, list) and value and isinstance(value[0], dict):
            out += _paths(value[0], (key, 0))
    return out


def _set(data: dict, path: tuple, value, remove: bool = False):  # noqa: ANN001, ANN202
    import copy

    data = copy.deepcopy(data)
    node = data
    for part in path[:-1]:
        node = node[part]
    if remove:
        node.pop(path[-1], None)
    else:
        node[path[-1]] = value
    return data


OTHER_VALUES = {"adapter": "qlora", "optimizer": "adamw_8bit", "dataset.source": "hf", "tokenizer.max_seq_len": 64}
"""A value other than the file's for keys that hold what the engine does anyway (not flags, not null)."""
PARTNERS = {"adapter": "load_in_4bit", "load_in_4bit": "adapter"}
"""Keys that each ask for the same setting (``adapter: qlora`` and ``load_in_4bit: true``: the NF4 base): one is
judged with its partner removed."""


def _fate(tmp_path: Path, data: dict, path: tuple, caplog) -> str:  # noqa: ANN001
    """How the translation treats the key at ``path``: ``mapped`` (the study mapping changes without it, or with
    another value), ``ignored`` (named in a warning: the ignored keys' one, or what runs otherwise than written),
    ``refused`` (another value is an error naming it), or ``silent``."""
    from lora_sweep.sweep.config import _foreign, loader
    from lora_sweep.sweep.config._yaml import read

    def translate(d: dict) -> tuple[dict | str, list[str]]:
        file = tmp_path / "c.yaml"
        file.write_text(yaml.safe_dump(d, sort_keys=False))
        caplog.clear()
        try:
            out: dict | str = _foreign.translate(*read(file, False), loader._TRAIN, loader._TOP,
                                                 [*loader._TOP, *loader._RELOCATE], loader._TRAIN_FIELDS)
        except ConfigError as err:
            out = str(err)
        return out, [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]

    dotted = ".".join(map(str, path))
    word = re.compile(rf"(?<![\w.]){re.escape(dotted)}(?![\w])|(?<![\w.]){re.escape(str(path[0]))}(?=, |$)")
    names = lambda text: bool(word.search(text)) or (path[0] in text and str(path[-1]) in text)  # noqa: E731
    if path[0] in PARTNERS:
        data = _set(data, (PARTNERS[path[0]],), None, remove=True)
    with caplog.at_level(logging.WARNING):
        full, said = translate(data)
        assert isinstance(full, dict), full
        if any(word.search(m) for m in said):  # the ignored keys' warning, or one saying it runs otherwise
            return "ignored"
        if translate(_set(data, path, None, remove=True))[0] != full:
            return "mapped"
        node = data
        for part in path:
            node = node[part]
        other = not node if isinstance(node, bool) else True if node is None else OTHER_VALUES.get(dotted, node)
        if other == node:
            return "silent"
        changed, said = translate(_set(data, path, other))
        if isinstance(changed, str):
            return "refused" if names(changed) else f"refused without naming it: {changed}"
        if any(names(m) for m in said):
            return "ignored"  # runs otherwise than written, and says so
        return "mapped" if changed != full else "silent"


@pytest.mark.parametrize("name", ["torchtune-1B-lora.yaml", "axolotl-lora-1b.yml", "axolotl-qlora-1b.yml"])
def test_every_key_of_a_foreign_config_is_mapped_ignored_or_refused(tiny_dirs, tmp_path, caplog, name) -> None:
    data = yaml.safe_load(foreign_config(tmp_path, tiny_dirs("llama"), name).read_text())
    kind = "torchtune" if name.startswith("torchtune") else "axolotl"
    for dotted, value in EXTRA_KEYS[kind].items():
        parts = tuple(int(p) if p.isdigit() else p for p in dotted.split("."))
        data = _set(data, parts, value)
    ours = {"search", "budget", "data", "objectives", "output", "name", "evaluators", "pruning", "pack"}
    paths = [p for p in _paths(data) if p[0] not in ours]
    parents = {p[:-1] for p in paths}  # a mapping walked key by key is judged by its keys
    fates = {".".join(map(str, p)): _fate(tmp_path, data, p, caplog) for p in paths if p not in parents}
    assert not [k for k, f in fates.items() if f not in ("mapped", "ignored", "refused")], fates


def test_a_configs_own_keys_work_as_overrides_and_bf16_on_a_cpu_is_said(tiny_dirs, tmp_path) -> None:
    """``device=cpu`` and ``dtype=bf16`` are torchtune's own spellings: overrides of them are applied to the config
    before it is translated, as ``tune run`` would; an unknown key is still refused."""
    path = foreign_config(tmp_path, tiny_dirs("llama"), "torchtune-1B-lora.yaml", device="cuda")
    spec = load_study(path, ["device=cpu", "dtype=bf16", "model.lora_dropout=0.1", "budget.trials=1"])
    assert (spec.model.device, spec.model.dtype, spec.train.dropout) == ("cpu", "bfloat16", 0.1)
    with pytest.raises(ConfigError, match="devcie"):
        load_study(path, ["devcie=cpu"])
    lines: list[str] = []
    run_study(spec, log=lines.append)
    assert any(line.startswith("warning: model.dtype: bfloat16 on a CPU: the base and adapters run in bfloat16")
               for line in lines), lines
