"""Hostile input files: a YAML alias bomb, a self-referring alias, text that is not UTF-8, data rows nested
without bound or holding lone surrogates. Each ends in one line naming the file (and line), exit 2, at once."""

from __future__ import annotations

import itertools
import json
import random
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from lora_sweep.errors import ConfigError, DataError
from lora_sweep.packer.data.rows import MAX_DEPTH, read_jsonl
from lora_sweep.sweep.config._yaml import MAX_VALUES
from lora_sweep.sweep.config.loader import load_study
from tests.conftest import write_study
from tests.damage import STUDIES, judge, study_cases
from tests.damage import main as damage_main

ROOT = Path(__file__).resolve().parents[2]
BOMB = "".join(f"{a}: &{a} [{', '.join([f'*{p}' if p else 'lol'] * 9)}]\n"
               for p, a in zip(["", *"abcdefgh"], "abcdefghi", strict=True)) + "name: bomb\n"
"""The "billion laughs": nine levels of nine aliases each, 9**9 (387 million) strings written out."""

_MEASURED = """
import resource, subprocess, sys, time
limit = 1 << 30  # the shared test machine is never at risk: a child past 1 GiB of address space fails
started = time.monotonic()
done = subprocess.run(sys.argv[1:], capture_output=True, text=True, timeout=60,
                      preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_AS, (limit, limit)))
print(done.returncode, time.monotonic() - started, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)
print(done.stderr, end="")
"""


def _sweep_measured(*args: str) -> tuple[int, float, float, str]:
    """(exit status, wall seconds, peak RSS in MB, stderr) of ``sweep ARGS`` in a process of its own."""
    out = subprocess.run([sys.executable, "-c", _MEASURED, sys.executable, "-m", "lora_sweep", *args],
                         capture_output=True, text=True, cwd=ROOT, timeout=120).stdout
    head, _, stderr = out.partition("\n")
    code, seconds, rss_kb = head.split()
    return int(code), float(seconds), int(rss_kb) / 1024, stderr


def test_an_alias_bomb_exits_2_within_5_s_and_200_mb(tmp_path) -> None:
    study = tmp_path / "bomb.yaml"
    study.write_text(BOMB)
    code, seconds, rss_mb, stderr = _sweep_measured("run", str(study))
    assert code == 2 and seconds < 5.0 and rss_mb < 200, (code, seconds, rss_mb, stderr)
    assert stderr.count("\n") == 1 and str(study) in stderr and f"{MAX_VALUES:,} values" in stderr


def test_the_alias_budget_is_the_loaders_own(tmp_path) -> None:
    study = tmp_path / "bomb.yaml"
    study.write_text(BOMB)
    started = time.monotonic()
    with pytest.raises(ConfigError, match="aliases expand"):
        load_study(study)
    assert time.monotonic() - started < 5.0


def test_aliases_within_the_budget_still_load(tmp_path) -> None:
    path = write_study(tmp_path, tmp_path, name="aliased")
    doc = yaml.safe_load(path.read_text())
    modules = ["q_proj", "v_proj"]
    doc["search"]["targets"] = {"attn": modules, "qv": modules}  # one list, twice: dumped as an anchor and an alias
    path.write_text(yaml.safe_dump(doc))
    assert "&id001" in path.read_text()
    spec = load_study(path, check_paths=False)
    assert spec.search.target_sets["attn"] == spec.search.target_sets["qv"] == ("q_proj", "v_proj")


def test_a_self_referring_alias_is_one_line(tmp_path) -> None:
    study = tmp_path / "loop.yaml"
    study.write_text("name: loop\nsearch: &s {rank: [4], again: *s}\n")
    with pytest.raises(ConfigError, match=r"loop.yaml:2: an alias refers to the value that holds it"):
        load_study(study)


def test_a_study_file_that_is_not_utf8_names_its_line(tmp_path) -> None:
    study = tmp_path / "latin1.yaml"
    study.write_bytes("name: caf\u00e9\ndescription: r\u00e9sum\u00e9\n".encode("latin-1"))
    code, _, _, stderr = _sweep_measured("run", str(study))
    assert code == 2 and stderr.count("\n") == 1 and f"{study}:1: not UTF-8 text" in stderr


def test_a_row_nested_without_bound_is_refused_by_file_and_line(tmp_path) -> None:
    data = tmp_path / "deep.jsonl"
    data.write_text('{"prompt": "1+1=", "completion": "2"}\n' + "[" * 100_000 + "]" * 100_000 + "\n")
    with pytest.raises(DataError, match=rf"deep.jsonl:2: nested deeper than {MAX_DEPTH} levels"):
        read_jsonl(data)
    data.write_text('{"prompt": "1+1=", "completion": "2", "meta": ' + "[" * (MAX_DEPTH + 1) + "]" * (MAX_DEPTH + 1)
                    + "}\n")
    with pytest.raises(DataError, match=r"deep.jsonl:1: nested deeper"):
        read_jsonl(data)


def test_a_lone_surrogate_is_refused_by_file_and_line(tmp_path) -> None:
    data = tmp_path / "surrogate.jsonl"
    rows = [{"prompt": "1+1=", "completion": "2"}, {"prompt": "x", "completion": "\ud800"}]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))  # json.dumps escapes it: \\ud800
    with pytest.raises(DataError, match=r"surrogate.jsonl:2: a string holds a lone surrogate"):
        read_jsonl(data)


def test_chat_rows_are_within_the_depth_bound(tmp_path) -> None:
    data = tmp_path / "chat.jsonl"
    data.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"},
                                             {"role": "assistant", "content": "hello \u00e9\U0001f600"}]}) + "\n")
    fmt, rows = read_jsonl(data)
    assert fmt == "chat" and rows[0]["messages"][1]["content"].endswith("\U0001f600")



def _study(tmp_path: Path, drop: tuple[str, ...] = (), **changes) -> Path:  # noqa: ANN003
    """``write_study``'s file (over an empty model folder) with ``changes`` at the top level and the keys ``drop``
    removed."""
    (tmp_path / "model").mkdir(parents=True, exist_ok=True)
    path = write_study(tmp_path, tmp_path / "model", **changes)
    doc = yaml.safe_load(path.read_text())
    for key in drop:
        del doc[key]
    path.write_text(yaml.safe_dump(doc))
    return path


def _tune(tmp_path: Path) -> dict:
    """A torchtune LoRA recipe's config over ``tmp_path`` as its checkpoint, on the demo's data."""
    return {"model": {"_component_": "torchtune.models.llama3_2.lora_llama3_2_1b", "lora_attn_modules": ["q_proj"]},
            "checkpointer": {"_component_": "torchtune.training.FullModelHFCheckpointer",
                             "checkpoint_dir": str(tmp_path)},
            "dataset": {"_component_": "torchtune.datasets.instruct_dataset", "source": "json",
                        "data_files": str(ROOT / "studies/data/arith-train.jsonl")},
            "data": {"eval": str(ROOT / "studies/data/arith-eval.jsonl")}}


# Found by mutating the example study files at random (each was a traceback before): every one is one line naming
# the key, and the file's line where it has one.
@pytest.mark.parametrize(("changes", "drop", "message"), [
    ({"evaluators": [{}]}, (), r"small.yaml:\d+: evaluators.0.name: is required"),
    ({"evaluators": [{"options": {"max_new_tokens": 4}}]}, (), r"evaluators.0.name: is required"),
    ({"model": {"path": "./" + "a" * 300}}, (), r"model.path: local model directory not found"),
    ({"model": {"path": "~no-such-user-here/model"}}, (), r"model.path: is not a usable path"),
    ({"model": {"path": "a" * 300 + ".gguf"}}, (), r"model.path: GGUF file not found"),
    ({"data": {"train": "a" * 300}}, (), r"data.train: file not found"),
    ({"data": {"train": "~no-such-user-here/rows.jsonl"}}, (), r"data.train: is not a usable path"),
    ({"data": {"train": "rows\x00.jsonl"}}, (), r"data.train: (file not found|is not a usable path)"),
    # an Axolotl key makes the file an Axolotl config, whose translation read train: and data: as mappings
    ({"adapter": "lora", "train": "1h30m"}, (), r"small.yaml:\d+: train: must be a mapping"),
    ({"adapter": "lora", "val_set_size": 0.1, "data": {"train": "a" * 300}}, (), r"data.train: file not found"),
    ({"adapter": "lora", "val_set_size": 0.1, "data": "rows.jsonl"}, (), r"val_set_size: needs datasets"),
])
def test_a_mutated_study_file_is_one_line_naming_the_key(tmp_path, changes, drop, message) -> None:
    with pytest.raises(ConfigError, match=message) as err:
        load_study(_study(tmp_path, drop, **changes))
    assert "\n" not in str(err.value)


def test_a_torchtune_configs_null_or_scalar_train_section_is_refused_or_filled(tmp_path) -> None:
    tune = {**_tune(tmp_path), "max_steps_per_epoch": 4}
    path = tmp_path / "tune.yaml"
    path.write_text(yaml.safe_dump({**tune, "train": None}))
    assert load_study(path, check_paths=False).train.max_grad_norm is None  # no clip_grad_norm: torchtune clips not
    path.write_text(yaml.safe_dump({**tune, "train": 5}))
    with pytest.raises(ConfigError, match=r"tune.yaml:\d+: train: must be a mapping \(got 5\)"):
        load_study(path, check_paths=False)


def test_an_axolotl_configs_relative_data_file_is_split_from_the_files_folder(tmp_path, monkeypatch) -> None:
    folder = tmp_path / "study"
    (folder / "data").mkdir(parents=True)
    (folder / "data" / "rows.jsonl").write_text((ROOT / "studies/data/arith-train.jsonl").read_text())
    path = _study(folder, adapter="lora", val_set_size=0.25, drop=("data",))
    doc = yaml.safe_load(path.read_text())
    path.write_text(yaml.safe_dump({**doc, "data": {"train": "data/rows.jsonl", "format": "prompt_completion"}}))
    monkeypatch.chdir(tmp_path)  # not the file's folder: the relative path is the file's
    spec = load_study(path, check_paths=False)
    assert spec.data.eval is not None and spec.data.eval.is_file() and spec.data.train.parent == spec.data.eval.parent


def test_an_override_written_over_two_lines_is_quoted_on_one(tmp_path) -> None:
    with pytest.raises(ConfigError, match=r"override 'seed.x=\[1,\\n 2\]': seed is not a mapping") as err:
        load_study(_study(tmp_path), ["seed.x=[1,\n 2]"], check_paths=False)
    assert "\n" not in str(err.value)


def test_a_custom_evaluators_unusable_file_path_is_one_line_whether_imported_or_not(tmp_path) -> None:
    from lora_sweep.evaluators.registry import deferred_user_code

    path = _study(tmp_path, evaluators=[{"name": "custom", "options": {"function": "~no-such-user-here/m.py:f"}}])
    with pytest.raises(ConfigError, match=r"evaluators.0.custom.options.function: cannot import") as err:
        load_study(path)
    with deferred_user_code(), pytest.raises(ConfigError, match=r"evaluators.0.custom.options.function: not a usable "
                                                                r"file path \(.*home directory") as deferred:
        load_study(path)  # sweep run's way: the file is looked for, not imported
    assert "\n" not in str(err.value) + str(deferred.value)


def test_an_axolotl_split_is_never_written_under_a_name_the_study_refuses(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    path = _study(tmp_path / "s", adapter="lora", val_set_size=0.25, drop=("output",))
    path.write_text(yaml.safe_dump({**yaml.safe_load(path.read_text()), "name": {"a": "b" * 300}}))
    with pytest.raises(ConfigError, match=r"name: must be a string"):
        load_study(path)
    assert [p.name for p in (tmp_path / "runs").iterdir()] == ["small"]  # the file's stem, as the study would be


def test_an_axolotl_split_that_cannot_be_written_is_one_line(tmp_path) -> None:
    blocked = tmp_path / "file"
    blocked.write_text("")
    path = _study(tmp_path, adapter="lora", val_set_size=0.25, output=str(blocked / "out"))
    with pytest.raises(ConfigError, match=r"val_set_size: cannot write the split into .*file/out/val-split"):
        load_study(path)


@pytest.mark.parametrize(("changes", "message"), [
    ({"tokenizer": "llama3"}, r"tokenizer: must be a mapping with a _component_ \(got 'llama3'\)"),
    ({"data": 5}, r"data: must be a mapping \(got 5\)"),
    ({"model": {"_component_": "torchtune.models.llama3_2.lora_llama3_2_1b", "lora_attn_modules": 0.5}},
     r"model.lora_attn_modules: must be a list of attention modules"),
    ({"model": {"_component_": "torchtune.models.llama3_2.lora_llama3_2_1b", "lora_attn_modules": [["q_proj"]]}},
     r"model.lora_attn_modules: unknown attention module \['q_proj'\]"),
])
def test_a_torchtune_configs_mistyped_section_is_one_line_naming_it(tmp_path, changes, message) -> None:
    tune = {**_tune(tmp_path), **changes}
    path = tmp_path / "tune.yaml"
    path.write_text(yaml.safe_dump(tune))
    with pytest.raises(ConfigError, match=message) as err:
        load_study(path, check_paths=False)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("source", STUDIES, ids=[p.name for p in STUDIES])
def test_randomly_damaged_study_files_are_one_line_each(tmp_path, monkeypatch, source: Path) -> None:
    """120 seeded random damages of each example study and foreign config, a third with a damaged override (a sample
    of ``python -m tests.damage study``, which found the tracebacks the tests above pin): each loads or is one
    ``UserError`` line, within 5 s (milliseconds each here; a hang is minutes)."""
    monkeypatch.chdir(tmp_path)  # an Axolotl split of a refused name is written under runs/ here
    for path, run in itertools.islice(study_cases(tmp_path, random.Random(source.name), [source]), 120):
        assert judge(run, 5.0) is None, path.read_text()


def test_the_damage_command_keeps_what_it_finds_and_fails(tmp_path, monkeypatch, capsys) -> None:
    """A reader that raises anything but a ``UserError`` is a finding: named by type and line, its file kept, exit 1."""
    def broken(path: Path, overrides: list[str]) -> None:
        raise KeyError("a loader bug")

    monkeypatch.chdir(tmp_path)  # the command works in a folder of its own and goes there
    monkeypatch.setattr("lora_sweep.sweep.config.loader.load_study", broken)
    assert damage_main(["study", "--seconds", "0.5", "--memory-gb", "0"]) == 1
    out = capsys.readouterr().out
    assert "finding 1: KeyError at test_hostile_input.py:" in out and "1 findings; kept in " in out, out
    kept = Path(out.split("(")[1].split(")")[0])
    assert kept.name == "finding-0.yaml" and kept.is_file()
    shutil.rmtree(kept.parent)


def test_the_damage_command_passes_on_the_loader_as_it_is() -> None:
    result = subprocess.run([sys.executable, "-m", "tests.damage", "study", "--seconds", "3"], cwd=ROOT,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert re.fullmatch(r"study: [\d,]+ damaged files in \d+ s \(seed 0\), 0 findings\n", result.stdout), result.stdout
