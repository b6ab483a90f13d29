"""The dependency direction of the design card, checked two ways: import-linter's contracts
(pyproject.toml) and, for what it cannot see, what importing a module really loads."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _loaded(module: str) -> set[str]:
    """The top-level names importing ``module`` loads; a project package counts as its own name
    (``lora_sweep.packer.x`` -> ``packer``), a third-party one as its distribution's (``torch``)."""
    code = f"import json, sys; import {module}; print(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    names = json.loads(out.stdout)
    return {n.split(".")[1] if n.startswith("lora_sweep.") else n.split(".")[0] for n in names}


def test_import_contracts_hold() -> None:
    exe = shutil.which("lint-imports")
    if exe is None:
        pytest.fail("lint-imports not installed: pip install -e '.[dev]'")
    out = subprocess.run([exe, "--no-cache"], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    # a contract over a near-empty graph passes vacuously: the whole project is analysed (414 at the rename)
    files, deps = map(int, re.search(r"Analyzed (\d+) files, (\d+) dependencies", out.stdout).groups())
    assert files > 100 and deps > 350, out.stdout


def test_store_loads_no_heavy_or_project_module() -> None:
    mods = _loaded("lora_sweep.sweep.store")
    banned = {"torch", "optuna", "packer", "kernels", "evaluators", "reports", "transformers"}
    assert not mods & banned


def test_kernels_and_packer_import_without_sweep_deps() -> None:
    """The GPU image has no optuna, sqlite-utils, plotly or lm-eval: packer must not need them."""
    mods = _loaded("lora_sweep.packer.step.train")
    assert not mods & {"optuna", "sqlite_utils", "plotly", "lm_eval", "sweep"}


def test_the_checkout_root_is_no_import_root_for_its_folders(tmp_path: Path) -> None:
    """``python -m pytest`` and ``python -m lora_sweep`` run from the root put it on sys.path: once lora_sweep is
    imported none of its six folders is found there as a top-level name (an installed distribution of that name
    is, e.g. Hugging Face's kernels), while other modules there (tests) still are."""
    code = ("import json, importlib.util as u, lora_sweep\n"
            "specs = {n: u.find_spec(n) for n in lora_sweep.FOLDERS}\n"
            "print(json.dumps({n: s.origin if s else None for n, s in specs.items()}))\n"
            "import tests.conftest\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    origins = json.loads(out.stdout)
    assert set(origins) == {"sweep", "packer", "kernels", "evaluators", "reports", "benchmarks"}
    assert not [o for o in origins.values() if o and Path(o).resolve().is_relative_to(ROOT)], origins
    plain = subprocess.run([sys.executable, "-c", "import importlib.util as u; print(u.find_spec('packer').origin)"],
                           cwd=ROOT, capture_output=True, text=True, check=True)
    assert Path(plain.stdout.strip()).resolve() == ROOT / "packer" / "__init__.py"  # without the guard: shadowed
