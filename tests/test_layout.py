"""The test tree itself: pytest imports test modules by basename (no ``__init__.py`` files, rootdir-relative), so
two test files with one name anywhere under tests/ break the collection of the whole suite."""

from __future__ import annotations

from collections import Counter
from pathlib import Path


def test_test_file_basenames_are_unique() -> None:
    names = Counter(p.name for p in Path(__file__).parent.rglob("test_*.py"))
    assert not [n for n, c in names.items() if c > 1], "rename one of each pair"
