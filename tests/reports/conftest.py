"""Fixtures of the report tests, and a line at the end of the run naming the screenshots kept."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.reports._browser import KEPT
from tests.reports._study import fixture_study


@pytest.fixture(scope="session")
def study(tmp_path_factory: pytest.TempPathFactory, tiny_dirs) -> Path:
    """The fixture study directory (see ``_study.py``)."""
    return fixture_study(tmp_path_factory, tiny_dirs)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    for path in KEPT:
        terminalreporter.write_line(f"report screenshot: {path}")
