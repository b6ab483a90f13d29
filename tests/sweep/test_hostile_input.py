"""Hostile input files: a YAML alias bomb, a self-referring alias, text that is not UTF-8, data rows nested
without bound or holding lone surrogates. Each ends in one line naming the file (and line), exit 2, at once."""

from __future__ import annotations

import json
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

