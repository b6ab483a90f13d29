"""The field table (``sweep/config/fields.yaml``): one row per study-file key, the train settings' rows
(``sweep.config.settings.SETTINGS``) those from which TrainSpec, the searchable names and the key aliases are
derived."""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil
from pathlib import Path

import pytest

from lora_sweep.errors import ConfigError
from lora_sweep.packer.api import AdapterSpec
from lora_sweep.sweep.config import loader
from lora_sweep.sweep.config.settings import FIELDS, FORMATS, RANGED, SEARCHABLE, SETTINGS, TRAIN_ALIASES, TrainSpec
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


def _config_dataclasses() -> dict[str, type]:
    """Every dataclass the config layer defines (sweep/config/*.py), but the table's own row type and the foreign
    translation's scratch state."""
    folder = Path(loader.__file__).parent
    found: dict[str, type] = {}
    for info in pkgutil.iter_modules([str(folder)]):
        module = importlib.import_module(f"lora_sweep.sweep.config.{info.name}")
        for name, obj in vars(module).items():
            if dataclasses.is_dataclass(obj) and isinstance(obj, type) and obj.__module__ == module.__name__:
                found[name] = obj
    assert {"StudySpec", "TrainSpec", "Param", "TrackerSpec"} <= set(found)
    return {n: c for n, c in found.items() if n not in ("Setting", "_Out")}


COLUMNS = {"doc", "aliases", "flat", "amount", "spellings", "short", "required"}
"""The columns fields.yaml's header describes (a TrainSpec row also has ``search`` and one per alias format)."""


def test_every_field_has_a_row_and_every_row_a_field() -> None:
    classes = _config_dataclasses()
    assert set(FIELDS) == set(classes), "fields.yaml's classes differ from the config layer's dataclasses"
    for name, cls in classes.items():
        assert list(FIELDS[name]) == [f.name for f in dataclasses.fields(cls)], name  # in the field order
        for field, row in FIELDS[name].items():
            assert row["doc"].strip(), (name, field)
            assert set(row) <= COLUMNS | (set(FORMATS) | {"search"} if name == "TrainSpec" else set()), (name, field)
        shorts = [field for field, row in FIELDS[name].items() if row.get("short")]
        assert len(shorts) <= 1 and all(row.get("short") for row in FIELDS[name].values() if "required" in row), name


def test_units_and_spellings_come_from_the_table(tmp_path) -> None:
    budget, objective = FIELDS["Budget"], FIELDS["Objective"]
    assert budget["wall_time"]["amount"] and objective["direction"]["spellings"]["maximise"] == "maximize"
    study = tmp_path / "s.yaml"
    data = tmp_path / "d.jsonl"
    data.write_text('{"text": "a"}\n')
    study.write_text(f"model: gpt2\ndata: {{train: {data}, eval: {data}}}\nsearch: {{rank: [4, 8]}}\n"
                     "budget: {wall_time: 1h30m}\nobjectives: [{metric: eval_loss, direction: minimise}]\n")
    spec = loader.load_study(study)
    assert spec.budget.wall_time == 5400 and spec.objectives[0].direction == "minimize"
    spelled = ("messages", "sharegpt", "completion")
    formats = [loader.load_study(study, [f"data.format={f}"]).data.format for f in spelled]
    assert formats == ["chat", "chat", "prompt_completion"]
    study.write_text(study.read_text().replace("1h30m", "90 minutes"))
    with pytest.raises(ConfigError, match=r"budget.wall_time: must be seconds or a duration like 90m, 2h, 1h30m"):
        loader.load_study(study)


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


def test_a_scalar_section_and_a_required_key_come_from_the_table(tmp_path) -> None:
    """``short``: a scalar written for a section is its short field's value; ``required``: its error says what."""
    data = tmp_path / "d.jsonl"
    data.write_text('{"text": "a"}\n')
    study = tmp_path / "s.yaml"
    study.write_text(f"model: gpt2\ndata: {{train: {data}, eval: {data}}}\nsearch: {{rank: [4, 8]}}\n"
                     "budget: {trials: 2}\nsampler: random\npack: 4\n")
    spec = loader.load_study(study)
    assert (spec.model.path, spec.data.train, spec.sampler.name, spec.pack.max_slots) == ("gpt2", data, "random", 4)
    study.write_text(study.read_text().replace("model: gpt2\n", ""))
    with pytest.raises(ConfigError, match=r"s.yaml:1: model.path: is required \(a hub id, a local directory or a "
                                          r"\.gguf file\)$"):
        loader.load_study(study)
    study.write_text(f"model: gpt2\ndata: {{eval: {data}}}\nsearch: {{rank: [4, 8]}}\nbudget: {{trials: 2}}\n")
    with pytest.raises(ConfigError, match=r"s.yaml:2: data.train: is required \(a JSON-lines file\)$"):
        loader.load_study(study)
