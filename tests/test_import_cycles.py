"""No import circle among our modules: import-linter's ``acyclic`` contract (pyproject.toml, run by
``python .ci/lint_imports.py`` in CI) within each package, and the whole module graph across packages; and no
module of the folders importing the entry points on top (cli.py, api.py at the root, which the contracts' graph
does not hold).

The contract is shown to fail on a circle by running it on a copy of the packages with one added, and the walk to
find an import of the entry points of each form that a module could write."""

from __future__ import annotations

import ast
import runpy
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

import lora_sweep
from tests.conftest import PACKAGE_FOLDERS, missing

try:
    import grimp  # import-linter's graph (the dev extra); a machine with only the runtime packages skips the module
except ImportError:
    missing("grimp (import-linter's graph, the dev extra)", "pip install 'lora-sweep[dev]'")

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
CONFIG = PYPROJECT["tool"]["importlinter"]
ACYCLIC = next(c for c in CONFIG["contracts"] if c.get("id") == "acyclic")
FOLDERS = PACKAGE_FOLDERS
LINT_IMPORTS = ROOT / ".ci" / "lint_imports.py"
runpy.run_path(str(LINT_IMPORTS))  # grimp names the namespace roots as lint-imports does in CI


def test_acyclic_contract_covers_every_package() -> None:
    assert ACYCLIC["type"] == "acyclic_siblings" and len(FOLDERS) == 8
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
    for name in ("__init__.py", "__main__.py", "cli.py", "api.py", "errors.py"):
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


TOP = ("lora_sweep.cli", "lora_sweep.benchmarks", "lora_sweep.api")
"""The tiers above the folders the contracts' layers order, highest first: the ``sweep`` command (the root's cli.py,
whose ``bench`` runs benchmarks), the benchmark commands (one, vs_peft.py, runs a sweep through the Python API as a
user does), the Python API (the root's api.py, over sweep/ and reports/). A module imports no tier above its own."""
LAZY = {name for name, module in lora_sweep._API.items() if module == "lora_sweep.api"}
"""The public API's names, which the package's ``__getattr__`` imports from ``lora_sweep.api``."""


def _above(tier: str) -> tuple[str, ...]:
    """The modules (and packages) a module of ``tier`` (one of ``TOP``, or any other for a folder below them all)
    may not import."""
    return TOP[: TOP.index(tier)] if tier in TOP else TOP


def _reaches(module: str, above: tuple[str, ...]) -> bool:
    return any(module == a or module.startswith(a + ".") for a in above)


def _from_package(name: str, above: tuple[str, ...]) -> bool:
    """Whether ``lora_sweep.<name>`` (a submodule, or one of the lazily loaded API names) is above."""
    return _reaches(f"lora_sweep.{name}", above) or (name in LAZY and "lora_sweep.api" in above)


def _imports_up(tree: ast.Module, package: str, above: tuple[str, ...]) -> list[tuple[int, str]]:
    """(line, what) of each import in ``tree`` (a module of ``package``) of a module in ``above``: ``import``,
    ``from ... import`` (relative ones resolved), ``importlib.import_module("...")`` and ``lora_sweep.<name>``."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if _reaches(a.name, above)]
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            module = ".".join([*base, *([node.module] if node.module else [])])
            if _reaches(module, above):
                found.append((node.lineno, module))
            elif module == "lora_sweep":
                found += [(node.lineno, f"lora_sweep.{a.name}") for a in node.names if _from_package(a.name, above)]
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr == "import_module" and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str) and _reaches(node.args[0].value, above)):
            found.append((node.lineno, node.args[0].value))
        elif (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
              and node.value.id == "lora_sweep" and _from_package(node.attr, above)):
            found.append((node.lineno, f"lora_sweep.{node.attr}"))
    return found


def imports_up(root: Path) -> list[str]:
    """``file:line -> module`` for every import, by a module of the folders under ``root`` or by its api.py, of a
    tier above the module's own (function-level and ``TYPE_CHECKING`` ones included, as in the contracts)."""
    paths = [p for folder in FOLDERS for p in sorted((root / folder).rglob("*.py"))]
    found = []
    for path in [*paths, *[p for p in [root / "api.py"] if p.exists()]]:
        parts = ("lora_sweep", *path.relative_to(root).with_suffix("").parts)
        tier = ".".join(parts[:2])
        for line, module in _imports_up(ast.parse(path.read_text(), str(path)), ".".join(parts[:-1]), _above(tier)):
            found.append(f"{path.relative_to(root)}:{line} -> {module}")
    return found


def test_nothing_imports_a_tier_above_its_own() -> None:
    """Nothing points back up a layer to the top: import-linter's layers contract orders the folders; the root's
    cli.py and api.py are outside its graph, so the sources are walked for them."""
    assert len(list(ROOT.joinpath("sweep").rglob("*.py"))) > 30  # the walk reads the real tree
    assert not imports_up(ROOT)


def _plant(root: Path, module: str, code: str) -> list[str]:
    (root / module).parent.mkdir(parents=True, exist_ok=True)
    (root / module).write_text(code)
    return [line.split(":")[0] for line in imports_up(root)]


@pytest.mark.parametrize("code", [
    "import lora_sweep.cli\n",
    "from lora_sweep.api import run\n",
    "from lora_sweep import api\n",
    "from lora_sweep import load_study  # the package's lazy name, from lora_sweep.api\n",
    "def f():\n    from ... import cli\n",
    "import importlib\nimportlib.import_module('lora_sweep.api')\n",
    "import lora_sweep\n\ndef f(spec):\n    return lora_sweep.run(spec)\n",
    "from lora_sweep.benchmarks import cpu_bench\n",
])
def test_an_import_of_an_entry_point_by_a_folder_is_found(tmp_path: Path, code: str) -> None:
    """Each way a module of a folder below the top could load cli.py, api.py or a benchmark fails the walk;
    importing the package's own errors (lora_sweep.errors, beside them at the root) does not."""
    module = "sweep/config/upward.py"
    assert _plant(tmp_path, module, "from lora_sweep import errors\nfrom lora_sweep.errors import UserError\n") == []
    assert _plant(tmp_path, module, code) == [module]


def test_the_tiers_on_top(tmp_path: Path) -> None:
    """A benchmark may run a study through the Python API, not through the CLI; the API imports neither."""
    assert _plant(tmp_path, "benchmarks/user.py", "from lora_sweep import api, run\n") == []
    assert _plant(tmp_path, "benchmarks/user.py", "from lora_sweep.cli import main\n") == ["benchmarks/user.py"]
    (tmp_path / "benchmarks/user.py").unlink()
    assert _plant(tmp_path, "api.py", "from lora_sweep.sweep import study\nfrom lora_sweep import errors\n") == []
    assert _plant(tmp_path, "api.py", "def bench():\n    from lora_sweep.benchmarks import cpu_bench\n") == ["api.py"]
    assert _plant(tmp_path, "api.py", "from . import cli\n") == ["api.py"]
