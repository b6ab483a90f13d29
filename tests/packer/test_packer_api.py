"""``lora_sweep.packer.api``, the packer's face: every name resolves to its module's own object, the type checker's
imports and the runtime table agree, importing the face loads nothing heavy, and the import contract that keeps
sweep and evaluators on it covers every other module of the packer."""

from __future__ import annotations

import ast
import importlib
import json
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

import lora_sweep.packer.api as api
from tests.conftest import PACKAGE_FOLDERS

ROOT = Path(__file__).resolve().parents[2]


def _type_checking_imports() -> dict[str, set[str]]:
    """Module under ``lora_sweep.packer`` -> the names the ``if TYPE_CHECKING:`` block of api.py imports from it."""
    tree = ast.parse((ROOT / "packer" / "api.py").read_text())
    block = next(n for n in tree.body if isinstance(n, ast.If) and getattr(n.test, "id", "") == "TYPE_CHECKING")
    out: dict[str, set[str]] = {}
    for node in block.body:
        assert isinstance(node, ast.ImportFrom) and node.module is not None
        out.setdefault(node.module.removeprefix("lora_sweep.packer."), set()).update(a.name for a in node.names)
    return out


def test_the_runtime_table_and_the_type_checkers_imports_name_the_same_things() -> None:
    assert _type_checking_imports() == {m: set(names) for m, names in api._WHERE.items()}


@pytest.mark.parametrize("name", api.__all__)
def test_each_name_is_its_modules_own_object(name: str) -> None:
    module = importlib.import_module(f"lora_sweep.packer.{api._MODULE[name]}")
    home = getattr(module, name, None) or importlib.import_module(f"{module.__name__}.{name}")
    assert getattr(api, name) is home


def test_an_unknown_name_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="has no attribute 'PackingSpec'"):
        api.PackingSpec  # noqa: B018


def test_importing_the_face_loads_neither_torch_nor_a_packer_module() -> None:
    code = ("import json, sys; import lora_sweep.packer.api as a; heavy = sorted(n for n in sys.modules if n == "
            "'torch' or n.startswith('lora_sweep.packer.') and n != 'lora_sweep.packer.api'); a.AdapterSpec; "
            "print(json.dumps([heavy, 'torch' in sys.modules]))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    heavy, torch_after_plan = json.loads(out.stdout)
    assert heavy == [] and torch_after_plan is False  # packer.plan is stdlib only: its name costs no torch


def test_the_face_contract_forbids_every_other_packer_module() -> None:
    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    (face,) = [c for c in contracts if c["name"].endswith("only through packer.api")]
    children = {p.stem for p in (ROOT / "packer").iterdir() if p.suffix == ".py" or (p / "__init__.py").is_file()}
    assert {m.removeprefix("lora_sweep.packer.") for m in face["forbidden_modules"]} == children - {"api"}


def _imported_from_the_face() -> set[str]:
    """Names the package's modules outside packer/ (sweep, evaluators, the entry points ...) import from the face."""
    names: set[str] = set()
    # the package's own files only: a clone may hold a build/ tree, a .venv or models beside them
    paths = [*ROOT.glob("*.py"), *(p for folder in PACKAGE_FOLDERS if folder != "packer"
                                   for p in (ROOT / folder).rglob("*.py"))]
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == "lora_sweep.packer.api":
                names.update(a.name for a in node.names)
    return names


def test_the_face_holds_exactly_the_names_the_floors_above_use() -> None:
    """A name nothing above the packer imports widens the face for nothing; one imported but missing fails there."""
    assert _imported_from_the_face() == set(api.__all__)
