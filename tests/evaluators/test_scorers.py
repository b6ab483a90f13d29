"""Answer scorers and the held-out data reader."""

from __future__ import annotations

import json

import pytest

from lora_sweep.errors import DataError
from lora_sweep.evaluators.registry import MC_FORMAT, load_eval_data
from lora_sweep.evaluators.scorers import contains, exact_match, extract_number, numeric_match


@pytest.mark.parametrize(("text", "number"), [
    ("The answer is 42.", 42.0),
    ("Natalia sold 48/2 = 24 clips in May.\n#### 72", 72.0),
    ("#### 1,234.5 dollars, not 7", 1234.5),
    ("#### -3", -3.0),
    ("costs $1,000 and then 12", 12.0),  # no ####: the last number
    ("first 5 then -7.25.", -7.25),
    ("no digits here", None),
    ("", None),
])
def test_extract_number(text: str, number: float | None) -> None:
    assert extract_number(text) == number


def test_scorers() -> None:
    assert exact_match(" 61\n", "61") == 1.0 and exact_match("61 ", "62") == 0.0
    assert contains("I think 61.", "61") == 1.0 and contains("anything", "  ") == 0.0
    assert numeric_match("so #### 1,000", "1000") == 1.0
    assert numeric_match("42.0", "42") == 1.0
    assert numeric_match("41", "42") == 0.0 and numeric_match("none", "none") == 0.0


def test_multiple_choice_rows_are_checked(tmp_path, tiny_dirs) -> None:
    from lora_sweep.packer.model.load import load_base

    _, tok = load_base(str(tiny_dirs("llama")))
    path = tmp_path / "mc.jsonl"
    path.write_text(json.dumps({"prompt": "Q", "choices": ["a", "b"], "label": 1}) + "\n\n")
    data = load_eval_data(path, tok)
    assert data.fmt == MC_FORMAT and len(data.rows) == 1
    path.write_text(json.dumps({"prompt": "Q", "choices": ["a", "b"], "label": 0}) + "\n"
                    + json.dumps({"prompt": "Q", "choices": ["a", "b"], "label": 2}) + "\n")
    with pytest.raises(DataError, match=r"mc\.jsonl:2: field 'label' must be an index into 'choices' \(got 2\)"):
        load_eval_data(path, tok)
    path.write_text(json.dumps({"prompt": "Q", "choices": []}) + "\n")
    with pytest.raises(DataError, match=r"mc\.jsonl:1: a multiple_choice row needs 'prompt'"):
        load_eval_data(path, tok, fmt=MC_FORMAT)
