"""The Axolotl and torchtune key tables (``sweep/config/foreign.yaml``, read by ``sweep.config._foreign``): every row
moves a key to one a study file has, a row's value table refuses the values it does not list, every rule a row names
exists, and the guide's tables (docs/guides/foreign-configs.md) name every key the data names."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from lora_sweep.errors import ConfigError
from lora_sweep.sweep.config import _foreign
from lora_sweep.sweep.config import spec as S

SECTIONS = {"train": S.TrainSpec, "model": S.ModelSpec, "data": S.DataSpec, "pack": S.PackSpec}


@pytest.mark.parametrize("table", [_foreign.AXOLOTL, _foreign.TORCHTUNE], ids=["axolotl", "torchtune"])
def test_every_row_moves_to_a_key_of_ours(table: dict) -> None:
    for src, row in table.items():
        dest = row["to"]
        if dest is None:  # dropped, named with the ignored keys
            continue
        parts = dest.split(".")
        if len(parts) == 1:
            assert parts[0] in {f.name for f in dataclasses.fields(S.StudySpec)}, src
        else:
            assert parts[1] in {f.name for f in dataclasses.fields(SECTIONS[parts[0]])}, src


def test_a_value_table_maps_and_refuses(tmp_path) -> None:
    from lora_sweep.sweep.config._yaml import read

    file = tmp_path / "tt.yaml"
    file.write_text("dtype: bf16\n")
    doc, _ = read(file, False)
    out = _foreign._Out(doc, {})
    assert _foreign._move(out, _foreign.TORCHTUNE, ("dtype",), "bf16")
    assert out.data == {"model": {"dtype": "bfloat16"}}
    with pytest.raises(ConfigError, match=r"tt.yaml:1: dtype: must be one of bf16, fp32, fp16 \(got 'int8'\)"):
        _foreign._move(out, _foreign.TORCHTUNE, ("dtype",), "int8")
    assert not _foreign._move(out, _foreign.TORCHTUNE, ("no_such_key",), 1)
    assert _foreign._move(out, _foreign.TORCHTUNE, ("optimizer", "fused"), True) and out.dropped == ["optimizer.fused"]


def test_torchtune_names_of_the_train_settings_are_the_settings_tables(tmp_path) -> None:
    """A component's option named as a train setting moves to it by the settings' torchtune column (one declaration:
    ``Setting("rank", torchtune="lora_rank")``), and a top-level one is the loader's alias of it."""
    from lora_sweep.sweep.config._yaml import read
    from lora_sweep.sweep.config.settings import SETTINGS, TRAIN_ALIASES

    file = tmp_path / "tt.yaml"
    file.write_text("model: {}\n")
    out = _foreign._Out(read(file, False)[0], {})
    named = [(s.name, alias) for s in SETTINGS for alias in s.torchtune.split()]
    assert ("rank", "lora_rank") in named and ("max_grad_norm", "clip_grad_norm") in named
    for i, (name, alias) in enumerate(named):
        assert _foreign._move(out, _foreign.TORCHTUNE, ("model", alias), i)
        assert out.data["train"][name] == i and TRAIN_ALIASES[alias] == name


def test_every_rule_a_row_names_is_a_function() -> None:
    names = {r["rule"] for r in [*_foreign.AXOLOTL.values(), *_foreign.TORCHTUNE.values()] if "rule" in r}
    names |= {*_foreign._T["axolotl_rules"].values(), *_foreign._T["torchtune_rules"].values()}
    assert names and names <= set(_foreign.RULES)
    assert {"datasets", "component", "when_set"} <= names


def test_the_builders_and_values_of_the_data_refuse_the_others(tmp_path) -> None:
    from lora_sweep.sweep.config._yaml import read

    file = tmp_path / "tt.yaml"
    file.write_text("loss: {}\n")
    out = _foreign._Out(read(file, False)[0], {})
    _foreign.RULES["component"](out, "loss", {"_component_": "torchtune.modules.loss.CEWithChunkedOutputLoss"})
    assert out.data == {"pack": {"chunked_ce": True}}
    with pytest.raises(ConfigError, match=r"loss._component_: KLLoss is not supported \(expected CrossEntropyLoss, "
                                          r"CEWithChunkedOutputLoss, LinearCrossEntropyLoss\)"):
        _foreign.RULES["component"](out, "loss", {"_component_": "x.KLLoss"})


GUIDE = (Path(__file__).resolve().parents[2] / "docs" / "guides" / "foreign-configs.md").read_text()


def _named_in_guide(key: str) -> bool:
    """Whether the guide's tables name ``key`` in their code spans: as a word (``adapter: lora|qlora``), or by a
    written pattern (``tokenizer_*``, ``fsdp*``, ``is_*_derived_model``)."""
    table = "\n".join(line for line in GUIDE.splitlines() if line.startswith("|"))
    spans = re.findall(r"`([^`]+)`", table)
    patterns = [re.escape(w).replace(r"\*", r"\w*") for w in spans if re.fullmatch(r"[\w*]+", w) and "*" in w]
    return any(re.search(rf"(?<!\w){re.escape(key)}(?!\w)", w) for w in spans) or any(
        re.fullmatch(p, key) for p in patterns)


def test_the_guide_names_every_key_of_the_data() -> None:
    """docs/guides/foreign-configs.md's tables are the data's, for a reader: each key foreign.yaml lists (accepted
    only at its default, an identity key, an optimizer, a dataset type, a moved key, a torchtune builder) is named
    there, so a row added to the data without its line in the guide fails here."""
    t = _foreign._T
    keys = [*t["default_only"], *t["identity"], *t["optimizers"], *t["optimizers_8bit"], *t["formats"],
            *t["axolotl_moves"], *(k.split(".")[-1] for k in t["torchtune_moves"]), *t["torchtune_targets"],
            *t["torchtune_mlp_targets"], *(n for builders in t["torchtune_builders"].values() for n in builders),
            *t["torchtune_rules"], *t["axolotl_rules"]]
    missing = [k for k in keys if not _named_in_guide(k)]
    assert not missing, f"foreign.yaml keys the guide's tables do not name: {missing}"
    assert not _named_in_guide("no_such_key")
