"""The dependency direction of the design card, checked two ways: import-linter's contracts
(pyproject.toml) and, for what it cannot see, what importing a module really loads."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _loaded(module: str) -> set[str]:
    code = f"import json, sys; import {module}; print(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    return set(json.loads(out.stdout))


def test_import_contracts_hold() -> None:
    exe = shutil.which("lint-imports")
    if exe is None:
        pytest.fail("lint-imports not installed: pip install -e '.[dev]'")
    out = subprocess.run([exe], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_store_loads_no_heavy_or_project_module() -> None:
    mods = _loaded("sweep.store")
    banned = {"torch", "optuna", "packer", "kernels", "evaluators", "reports", "transformers"}
    assert not {m.split(".")[0] for m in mods} & banned


def test_kernels_and_packer_import_without_sweep_deps() -> None:
    """The GPU image has no optuna, sqlite-utils, plotly or lm-eval: packer must not need them."""
    mods = _loaded("packer.train")
    assert not {m.split(".")[0] for m in mods} & {"optuna", "sqlite_utils", "plotly", "lm_eval", "sweep"}
