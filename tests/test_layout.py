"""The test tree itself: each test file is named after the module it tests (tests mirror the source tree), so one
basename twice under tests/ is two files testing one module, or a name that says the wrong one. (pytest's importlib
mode, set in pyproject.toml, would import both; the rule is for the reader.) A helper two test files share lives in
tests/helpers.py (a fixture in a conftest.py; one that is also a command, in a module of its own: tests/damage.py),
never in one of them: a test file imports no other."""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path


def test_test_file_basenames_are_unique() -> None:
    names = Counter(p.name for p in Path(__file__).parent.rglob("test_*.py"))
    assert not [n for n, c in names.items() if c > 1], "rename one of each pair"


def test_no_test_file_imports_another() -> None:
    pattern = re.compile(r"^\s*(?:from|import) tests\.(?:\w+\.)*test_\w+", re.M)
    importers = [str(p.relative_to(Path(__file__).parent)) for p in Path(__file__).parent.rglob("*.py")
                 if pattern.search(p.read_text())]
    assert not importers, "move the shared helper into tests/helpers.py"
