"""Every study file the README and the docs show is one the loader accepts: each ```yaml block with a ``model:``
and a ``data:`` key loads through ``load_study`` (its data files created beside it, its model not built)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from lora_sweep.sweep.config.loader import load_study

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def _study_blocks() -> list[tuple[str, str]]:
    blocks = []
    for page in PAGES:
        for i, text in enumerate(re.findall(r"^ *```yaml\n(.*?)^ *```", page.read_text(), flags=re.M | re.S)):
            text = re.sub(r"^ {4}", "", text, flags=re.M) if text.startswith("    ") else text  # inside a list item
            data = yaml.safe_load(text)
            if isinstance(data, dict) and {"model", "data"} <= set(data):
                blocks.append((f"{page.relative_to(ROOT)}#{i}", text))
    return blocks


BLOCKS = _study_blocks()


def test_the_readme_and_the_getting_started_page_show_a_study_file() -> None:
    assert {name.split("#")[0] for name, _ in BLOCKS} >= {"README.md", "docs/getting-started.md"}


@pytest.mark.parametrize("name,text", BLOCKS, ids=[n for n, _ in BLOCKS])
def test_study_block_loads(name: str, text: str, tmp_path: Path) -> None:
    folder = tmp_path / "studies"
    folder.mkdir()
    data = yaml.safe_load(text)["data"]
    for key in ("train", "eval"):
        if key in data:
            path = folder / data[key]
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps({"prompt": "Card: Anna 1987 Rome ->", "completion": " Rome/1987/Anna"}) + "\n")
    study = folder / "study.yaml"
    study.write_text(text)
    spec = load_study(study, check_paths=False)
    assert spec.name == yaml.safe_load(text)["name"]
    assert spec.search.params, f"{name}: searches nothing"
