"""No import circle among our modules: import-linter's ``acyclic`` contract (pyproject.toml, run by
``python .ci/lint_imports.py`` in CI) within each package, and the whole module graph across packages.

The contract is shown to fail on a circle by running it on a copy of the packages with one added."""

from __future__ import annotations

import runpy
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import grimp
import pytest

from tests.conftest import PACKAGE_FOLDERS

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
CONFIG = PYPROJECT["tool"]["importlinter"]
ACYCLIC = next(c for c in CONFIG["contracts"] if c.get("id") == "acyclic")
FOLDERS = PACKAGE_FOLDERS
LINT_IMPORTS = ROOT / ".ci" / "lint_imports.py"
runpy.run_path(str(LINT_IMPORTS))  # grimp names the namespace roots as lint-imports does in CI


def test_acyclic_contract_covers_every_package() -> None:
    assert ACYCLIC["type"] == "acyclic_siblings" and len(FOLDERS) == 7
    assert sorted(CONFIG["root_packages"]) == sorted(ACYCLIC["ancestors"]) == sorted(f"lora_sweep.{f}" for f in FOLDERS)


def test_the_graph_the_contracts_check_is_the_whole_project() -> None:
    """A contract over a graph of one module passes vacuously: the graph holds every module and import."""
    graph = grimp.build_graph(*CONFIG["root_packages"])
    files = {f"lora_sweep.{'.'.join(p.relative_to(ROOT).with_suffix('').parts)}".removesuffix(".__init__")
             for folder in FOLDERS for p in (ROOT / folder).rglob("*.py")}
    assert files <= graph.modules and len(files) > 100
    assert {f"lora_sweep.{folder}" for folder in FOLDERS} <= graph.modules  # the contracts' layers
    assert sum(len(graph.find_modules_directly_imported_by(m)) for m in graph.modules) > 350


def _copy_tree(dest: Path) -> None:
    """The package's sources as lora_sweep/ and pyproject.toml beside it, nothing else (no caches, no tests)."""
    package = dest / "lora_sweep"
    for folder in FOLDERS:
        shutil.copytree(ROOT / folder, package / folder, ignore=shutil.ignore_patterns("__pycache__", "*.sh"))
    for name in ("__init__.py", "__main__.py"):
        shutil.copy(ROOT / name, package / name)
    shutil.copy(ROOT / "pyproject.toml", dest / "pyproject.toml")


def _check(tree: Path) -> subprocess.CompletedProcess[str]:
    # cwd first on sys.path (lint-imports puts it there): the copy, not the installed checkout, is analysed
    return subprocess.run([sys.executable, str(LINT_IMPORTS), "--contract", "acyclic", "--no-cache"], cwd=tree,
                          capture_output=True, text=True, env={"PATH": str(Path(sys.executable).parent),
                                                               "PYTHONPATH": str(tree)})


@pytest.mark.parametrize("module, line, package", [
    # a function-level import closing a circle, as gpu_bench -> gpu_profile -> gpu_bench did
    ("packer/plan.py", "\n\ndef _circle():\n    from lora_sweep.packer.step import train  # noqa: F401\n",
     "lora_sweep.packer"),
    # a circle between two sibling modules of the benchmarks package
    ("benchmarks/shapes.py", "\nimport lora_sweep.benchmarks.gpu_bench  # noqa: E402,F401\n",
     "lora_sweep.benchmarks"),
])
def test_a_circle_breaks_the_contract(tmp_path: Path, module: str, line: str, package: str) -> None:
    _copy_tree(tmp_path)
    kept = _check(tmp_path)
    assert kept.returncode == 0, kept.stdout + kept.stderr
    with open(tmp_path / "lora_sweep" / module, "a") as f:
        f.write(line)
    broken = _check(tmp_path)
    assert broken.returncode == 1, broken.stdout + broken.stderr
    assert f"No cycles are allowed in {package}." in broken.stdout


def test_no_circle_across_packages() -> None:
    """Every module of every package, one graph: no direct import ``a -> b`` with a chain ``b -> ... -> a``.
    The contract's ignored imports (each a documented circle left to remove) are taken out first."""
    graph = grimp.build_graph(*CONFIG["root_packages"])
    for expression in ACYCLIC.get("ignore_imports", []):
        importer, imported = (s.strip() for s in expression.split("->"))
        graph.remove_import(importer=importer, imported=imported)
    circles = sorted((a, b) for a in graph.modules for b in graph.find_modules_directly_imported_by(a)
                     if graph.chain_exists(importer=b, imported=a))
    assert not circles, circles
