"""The Axolotl and torchtune key tables (``sweep.config._foreign.AXOLOTL`` / ``TORCHTUNE``): every row moves a key
to one a study file has, and a row's value table refuses the values it does not list."""

from __future__ import annotations

import dataclasses

import pytest

from lora_sweep.errors import ConfigError
from lora_sweep.sweep.config import _foreign
from lora_sweep.sweep.config import spec as S

SECTIONS = {"train": S.TrainSpec, "model": S.ModelSpec, "data": S.DataSpec, "pack": S.PackSpec}


@pytest.mark.parametrize("table", [_foreign.AXOLOTL, _foreign.TORCHTUNE], ids=["axolotl", "torchtune"])
def test_every_row_moves_to_a_key_of_ours(table: dict) -> None:
    for src, (dest, _) in table.items():
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
