"""The exported model card says how to prompt the adapter: the prompt format the study trained on."""

from __future__ import annotations

from pathlib import Path

import pytest

from lora_sweep.packer.data.rows import ALPACA_PROMPT_NO_INPUT
from lora_sweep.store.api import TrialRecord
from lora_sweep.sweep.export import model_card

CONFIG = {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj"]}


def _card(tmp_path: Path, fmt: str, rows: str = "") -> str:
    train = tmp_path / "train.jsonl"
    train.write_text(rows)
    meta = {"name": "s", "model": "base", "data": str(train), "spec": {"data": {"format": fmt, "train": str(train)}}}
    return model_card(meta, TrialRecord(3, params={"lr": 1e-3}), CONFIG, tmp_path / "out", source=tmp_path / "a" / "b",
                      changes=[], merged=False)


@pytest.mark.parametrize(("fmt", "rows", "said"), [
    ("prompt_completion", "", "the prompt is the row's `prompt` text exactly as written"),
    ("alpaca", "", ALPACA_PROMPT_NO_INPUT.rstrip("\n")),
    ("chat", "", "apply_chat_template(messages, add_generation_prompt=True)"),
    ("text", "", "no prompt template"),
    ("auto", '{"instruction": "x", "output": "y"}\n', "### Instruction:\n{instruction}"),
])
def test_the_card_gives_the_prompt_format(tmp_path, fmt: str, rows: str, said: str) -> None:
    card = _card(tmp_path, fmt, rows)
    section = card[card.index("## Prompt format"):card.index("## Use")]
    assert said in section, section


def test_the_card_says_peft_is_installed_apart(tmp_path) -> None:
    """A wheel install of lora-sweep has no PEFT (it trains without it): the card's PEFT example says to install it."""
    use = _card(tmp_path, "text").split("## Use", 1)[1]
    assert use.index("`pip install peft`") < use.index("from peft import PeftModel"), use
