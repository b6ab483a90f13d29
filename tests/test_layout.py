"""The test tree itself: each test file is named after the module it tests (tests mirror the source tree), so one
basename twice under tests/ is two files testing one module, or a name that says the wrong one. (pytest's importlib
mode, set in pyproject.toml, would import both; the rule is for the reader.)"""

from __future__ import annotations

from collections import Counter
from pathlib import Path


def test_test_file_basenames_are_unique() -> None:
    names = Counter(p.name for p in Path(__file__).parent.rglob("test_*.py"))
    assert not [n for n, c in names.items() if c > 1], "rename one of each pair"
