"""The train settings' table (``sweep.config.settings.SETTINGS``): one row per hyperparameter, from which TrainSpec,
the searchable names and the key aliases are derived."""

from __future__ import annotations

import dataclasses

import pytest

from lora_sweep.errors import ConfigError
from lora_sweep.packer.api import AdapterSpec
from lora_sweep.sweep.config import loader
from lora_sweep.sweep.config.settings import FORMATS, RANGED, SEARCHABLE, SETTINGS, TRAIN_ALIASES, TrainSpec
from lora_sweep.sweep.config.spec import Param


def test_every_adapter_field_has_a_row_and_takes_its_type_and_default_from_adapter_spec() -> None:
    # seed comes from the study (one per trial), extra is the packer's free-form labels: neither is a train setting
    adapter = {f.name: f for f in dataclasses.fields(AdapterSpec) if f.name not in ("seed", "extra")}
    train = {f.name: f for f in dataclasses.fields(TrainSpec)}
    assert set(adapter) <= set(train), sorted(set(adapter) - set(train))
    assert [f.name for f in dataclasses.fields(TrainSpec)] == [s.name for s in SETTINGS]
    for name, f in adapter.items():
        assert train[name].default == f.default, name
        assert train[name].type == f.type or name == "init", name  # init also reads PEFT's true


def test_every_row_has_its_meaning_on_the_field() -> None:
    for f in dataclasses.fields(TrainSpec):
        assert f.metadata["doc"].strip(), f.name


def test_searchable_names_and_ranges_come_from_the_table() -> None:
    assert SEARCHABLE == tuple(s.name for s in SETTINGS if s.search is not None)
    assert "betas" not in SEARCHABLE and "epochs" not in SEARCHABLE and "alpha_ratio" in SEARCHABLE
    assert set(RANGED) < set(SEARCHABLE) and "dora" not in RANGED and "lr" in RANGED
    with pytest.raises(ConfigError, match="takes a list of values, not a range"):
        Param("dora", "float", low=0, high=1)
    with pytest.raises(ConfigError, match="name: must be one of"):
        Param("eps", "float", low=1e-9, high=1e-6)


def test_aliases_come_from_the_table_by_format() -> None:
    rank = next(s for s in SETTINGS if s.name == "rank")
    assert rank.aliases == {"lora_r": "axolotl", "lora_rank": "torchtune", "r": "peft"}
    assert TRAIN_ALIASES["lora_r"] == TRAIN_ALIASES["r"] == "rank"
    assert loader._TRAIN is TRAIN_ALIASES
    assert all(fmt in FORMATS for s in SETTINGS for fmt in s.aliases.values())
    names = {s.name for s in SETTINGS}
    assert not names & set(TRAIN_ALIASES), "an alias must not shadow a setting"


def test_own_settings_carry_their_checks_and_adapter_fields_use_adapter_specs() -> None:
    with pytest.raises(ConfigError, match=r"^warmup_ratio: must be in \[0, 1\) \(got 1.5\)$"):
        TrainSpec(warmup_ratio=1.5)
    with pytest.raises(ConfigError, match=r"^choices: must be > 0 \(got None\)$"):
        Param("alpha_ratio", "categorical", choices=(None, 2.0))  # null is no ratio to search
    with pytest.raises(ConfigError, match=r"^rank: must be 1..256"):
        TrainSpec(rank=0)
    assert TrainSpec(init=True).init == "kaiming"
    assert TrainSpec(eval_every=None).eval_every is None
