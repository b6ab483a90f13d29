"""The adapter-variant keys of a study file (``lr_ratio``, ``dora``, ``init``): fixed, searched, under their Axolotl /
PEFT / torchtune spellings, carried into every trial's ``AdapterSpec``; a variant the packer does not train yet is
refused at load in one line naming the key."""

from __future__ import annotations

from pathlib import Path

import optuna
import pytest
import yaml

from lora_sweep.errors import ConfigError
from lora_sweep.packer.plan import AdapterSpec
from lora_sweep.sweep.config.loader import load_study
from lora_sweep.sweep.config.space import adapter_spec
from lora_sweep.sweep.sampling import suggest

STUDY = {
    "name": "variants",
    "model": "org/tiny-model",
    "data": {"train": "train.jsonl", "eval": "eval.jsonl"},
    "search": {"rank": [4, 8]},
    "budget": {"trials": 4},
}


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    for name in ("train.jsonl", "eval.jsonl"):
        (tmp_path / name).write_text('{"instruction": "a", "output": "b"}\n')
    return tmp_path


def _load(folder: Path, **changes: object):  # noqa: ANN202
    path = folder / "study.yaml"
    path.write_text(yaml.safe_dump({**STUDY, **changes}, sort_keys=False))
    return load_study(path, check_paths=False)


def _error(folder: Path, **changes: object) -> str:
    with pytest.raises(ConfigError) as err:
        _load(folder, **changes)
    assert "\n" not in str(err.value)
    return str(err.value)


def test_defaults_are_plain_lora() -> None:
    spec = AdapterSpec()
    assert (spec.lr_ratio, spec.dora, spec.init) == (1.0, False, "kaiming")


@pytest.mark.parametrize(("train", "expected"), [
    ({"lr_ratio": 16}, {"lr_ratio": 16}),
    ({"loraplus_lr_ratio": 8.0}, {"lr_ratio": 8.0}),
    ({"init": "gaussian"}, {"init": "gaussian"}),
    ({"init_lora_weights": "gaussian"}, {"init": "gaussian"}),
    ({"peft_init_lora_weights": True}, {"init": "kaiming"}),
    ({"init_lora_weights": "default"}, {"init": "kaiming"}),
    ({"use_dora": False}, {"dora": False}),
    ({"peft_use_dora": False}, {"dora": False}),
])
def test_fixed_values_and_their_aliases_reach_the_adapter(folder: Path, train: dict, expected: dict) -> None:
    study = _load(folder, train=train)
    spec = adapter_spec({"rank": 4}, study.train, seed=0, space=study.search)
    assert {k: getattr(spec, k) for k in expected} == expected


def test_a_top_level_axolotl_key_is_a_train_value(folder: Path) -> None:
    study = _load(folder, loraplus_lr_ratio=4)
    assert study.train.lr_ratio == 4


def test_a_principal_init_needs_dropout_zero(folder: Path) -> None:
    assert "train.init: pissa needs dropout 0" in _error(folder, train={"init": "pissa", "dropout": 0.1})
    assert _load(folder, train={"init_lora_weights": "olora"}).train.init == "olora"


def test_searched_variants_are_trial_parameters(folder: Path) -> None:
    study = _load(folder, search={"lr_ratio": {"low": 1, "high": 32, "log": True}, "init": ["gaussian", "pissa"],
                                  "dora": [False]})
    trial = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=3)).ask()
    params = suggest(trial, study.search)
    spec = adapter_spec(params, study.train, seed=0, space=study.search)
    assert 1 <= spec.lr_ratio <= 32 and spec.init in ("gaussian", "pissa") and spec.dora is False


@pytest.mark.parametrize(("changes", "message"), [
    ({"train": {"lr_ratio": 0}}, "train.lr_ratio: must be > 0 (got 0.0)"),
    ({"train": {"init": "loftq"}}, "train.init: must be one of kaiming, gaussian, pissa, olora"),
    ({"search": {"dora": {"low": 0, "high": 1}}}, "search.dora: takes a list of values, not a range"),
])
def test_bad_values_are_one_line_naming_the_key(folder: Path, changes: dict, message: str) -> None:
    assert message in _error(folder, **changes)


@pytest.mark.parametrize(("changes", "message"), [
    ({"search": {"dora": [False, True]}, "model": {"path": "org/tiny-model", "quantize": "nf4"}},
     "search.dora: dora reads the whole float base weight (the row norms of W + s B A), which model.quantize: nf4 "
     "does not keep on one process"),
    ({"train": {"dora": True}, "pack": {"shard": "fsdp", "max_slots": 4}},
     "train.dora: dora reads the whole float base weight (the row norms of W + s B A), which pack.shard: fsdp does "
     "not keep"),
])
def test_dora_over_a_quantized_or_sharded_base_is_refused_at_load(folder: Path, changes: dict, message: str) -> None:
    assert message in _error(folder, **changes)


@pytest.mark.parametrize("changes", [{"train": {"use_dora": True}},  # auto kernels: Triton on a GPU
                                     {"train": {"dora": True}, "pack": {"kernels": "triton"}},
                                     {"train": {"dora": True}, "pack": {"kernels": "torch"}},
                                     {"search": {"dora": [False, True]}, "model": {"path": "m", "device": "cpu"}},
                                     {"train": {"dora": True, "dropout": 0.1}},  # PEFT's DoRA on the dropped input
                                     {"search": {"dora": [False, True], "dropout": [0.0, 0.05]}}])
def test_dora_loads_on_either_kernels(folder: Path, changes: dict) -> None:
    study = _load(folder, **changes)
    assert True in ({study.train.dora} | set(next((p.choices for p in study.search.params if p.name == "dora"), ())))


def test_a_searched_dropout_with_a_principal_init_is_refused_at_load(folder: Path) -> None:
    message = _error(folder, search={"init": ["kaiming", "pissa"], "dropout": [0.0, 0.05]})
    assert "search: can propose init: pissa, dropout: 0.05, which is refused (init: pissa needs dropout 0" in message
    message = _error(folder, search={"init": ["kaiming", "pissa"]}, train={"dropout": 0.1})
    assert "search: can propose init: pissa, which is refused (init: pissa needs dropout 0" in message
    assert _load(folder, search={"init": ["kaiming", "pissa"]}, train={"dropout": 0.0}).train.dropout == 0.0


def test_the_planner_sizes_a_principal_trial_by_its_rows(folder: Path) -> None:
    from lora_sweep.sweep.planning import largest_rank

    assert largest_rank(_load(folder, search={"rank": [4, 8]})) == 8
    assert largest_rank(_load(folder, search={"rank": [4, 8], "init": ["gaussian", "olora"]})) == 16
    assert largest_rank(_load(folder, train={"init": "pissa"})) == 2 * 8


def test_a_study_recorded_without_the_variant_keys_resumes_at_their_defaults(folder: Path) -> None:
    from lora_sweep.sweep.session import spec_changes, spec_record

    earlier = spec_record(_load(folder))
    for key in ("lr_ratio", "dora", "init"):
        del earlier["train"][key]  # a record written before these keys existed
    assert spec_changes(earlier, spec_record(_load(folder))) == []
    changed = spec_changes(earlier, spec_record(_load(folder, train={"lr_ratio": 4})))
    assert changed == ["train.lr_ratio changed (null -> 4.0)"]


@pytest.mark.parametrize("changes", [{"model": {"path": "org/tiny-model", "quantize": "nf4"}},
                                     {"pack": {"shard": "fsdp", "max_slots": 4}}])
def test_a_principal_init_over_a_quantized_or_sharded_base_is_refused_at_load(folder: Path, changes: dict) -> None:
    assert "train.init: pissa decomposes the whole float base weight" in _error(folder, train={"init": "pissa"},
                                                                                  **changes)


def test_a_space_that_can_train_dora_calibrates_with_dora_probes(folder: Path) -> None:
    """The plan sizes every slot of such a space as a DoRA slot (``packer.probe.calibrate(dora=True)``), cached apart
    from the plain calibration."""
    from lora_sweep.sweep.calibration import calibration_key, probe_options

    plain = _load(folder)
    assert not probe_options(plain)["dora"] and calibration_key(plain, "cpu")["dora"] is False
    for changes in ({"train": {"dora": True}}, {"search": {"dora": [False, True]}}):
        study = _load(folder, **changes)
        assert probe_options(study)["dora"] and calibration_key(study, "cpu")["dora"] is True
    assert not probe_options(_load(folder, search={"dora": [False]}))["dora"]


def test_dora_probes_train_the_largest_dropout_the_space_can(folder: Path) -> None:
    """``probe_options``: a DoRA slot with dropout keeps more (``packer.probe.calibrate(dropout=)``), so the DoRA probes
    train the largest dropout of the space, cached apart; plain probes none."""
    from lora_sweep.sweep.calibration import calibration_key, probe_options

    cases = [({"train": {"dropout": 0.1}}, 0.0), ({"train": {"dora": True, "dropout": 0.0}}, 0.0),
             ({"train": {"dora": True, "dropout": 0.1}}, 0.1),
             ({"search": {"dora": [False, True], "dropout": [0.0, 0.05, 0.2]}}, 0.2),
             ({"search": {"dora": [True], "dropout": {"low": 0.0, "high": 0.3}}}, 0.3)]
    for changes, want in cases:
        study = _load(folder, **changes)
        assert probe_options(study)["dropout"] == want and calibration_key(study, "cpu")["dropout"] == want, changes
