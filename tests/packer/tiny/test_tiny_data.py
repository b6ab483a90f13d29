"""The tiny models' arithmetic task (``packer.tiny.data``): deterministic, distinct, correct items in every format,
the committed demo files it regenerates, and atomic JSONL writes.

Run: python -m pytest tests/packer/tiny/test_tiny_data.py -q
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lora_sweep.errors import ConfigError
from lora_sweep.packer.tiny.data import arithmetic_rows, write_jsonl
from lora_sweep.packer.tiny.models import main

REPO = Path(__file__).resolve().parents[3]
DEMO_FILES = ("arith-train.jsonl", "arith-eval.jsonl")


def _solve(instruction: str, inp: str) -> str:
    """Independent oracle: parse the item and compute the answer."""
    if instruction == "Add the numbers.":
        a, b = inp.split("+")
        return str(int(a) + int(b))
    if instruction == "Subtract the second number from the first.":
        a, b = inp.split("-")
        return str(int(a) - int(b))
    assert instruction == "Reverse the digits.", instruction
    assert inp.isdigit(), inp
    return inp[::-1]


def test_arithmetic_rows_are_deterministic_distinct_and_correct():
    rows = arithmetic_rows(600, seed=5)
    assert rows == arithmetic_rows(600, seed=5)
    assert rows != arithmetic_rows(600, seed=6)
    assert rows[:100] == arithmetic_rows(100, seed=5)
    assert len({(r["instruction"], r["input"]) for r in rows}) == len(rows)
    assert {r["instruction"] for r in rows} == {
        "Add the numbers.",
        "Subtract the second number from the first.",
        "Reverse the digits.",
    }
    for row in rows:
        assert set(row) == {"instruction", "input", "output"}
        assert row["output"] == _solve(row["instruction"], row["input"])


def test_formats_hold_the_same_items():
    alpaca = arithmetic_rows(30, seed=2)
    items = [(r["instruction"], r["input"], r["output"]) for r in alpaca]
    completions = arithmetic_rows(30, seed=2, fmt="prompt_completion")
    assert [(*r["prompt"].removesuffix("\n").split("\n"), r["completion"]) for r in completions] == items
    chats = arithmetic_rows(30, seed=2, fmt="chat")
    for (instruction, inp, output), chat in zip(items, chats, strict=True):
        assert chat["messages"] == [
            {"role": "user", "content": f"{instruction}\n{inp}"},
            {"role": "assistant", "content": output},
        ]
    with pytest.raises(ConfigError, match="alpaca, prompt_completion, chat"):
        arithmetic_rows(3, seed=0, fmt="sharegpt")


def test_committed_demo_data_matches_the_generator(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    main(["--write-demo-data", str(tmp_path / "data")])
    assert capsys.readouterr().out.split() == [str(tmp_path / "data" / name) for name in DEMO_FILES]
    for name in DEMO_FILES:
        assert (tmp_path / "data" / name).read_bytes() == (REPO / "studies" / "data" / name).read_bytes(), name

    train, held_out = (
        [json.loads(line) for line in (tmp_path / "data" / n).read_text().splitlines()] for n in DEMO_FILES
    )
    assert (len(train), len(held_out)) == (2000, 200)
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in held_out}
    for r in train + held_out:
        instruction, inp, rest = r["prompt"].split("\n")
        assert rest == "" and r["completion"] == _solve(instruction, inp)


def test_write_jsonl_replaces_atomically(tmp_path: Path):
    path = tmp_path / "rows.jsonl"
    write_jsonl(path, [{"a": 1}, {"b": "é"}])
    assert path.read_text(encoding="utf-8") == '{"a": 1}\n{"b": "é"}\n'
    with pytest.raises(TypeError):
        write_jsonl(path, [{"a": 2}, {"b": object()}])
    assert path.read_text(encoding="utf-8") == '{"a": 1}\n{"b": "é"}\n'  # old content intact
    assert [p.name for p in tmp_path.iterdir()] == ["rows.jsonl"]  # no temp file left
