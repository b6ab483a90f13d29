"""``lora_sweep.packer.api``, the packer's face: plain imports of light modules (importing it loads no torch, nor
any heavy packer module), exactly the names the floors above use, and the import contract that keeps sweep and
evaluators on it covers every other module of the packer."""

from __future__ import annotations

import ast
import importlib
import json
import subprocess
import sys
import tomllib
import types
from pathlib import Path

import pytest

import lora_sweep.packer.api as api
from tests.conftest import PACKAGE_FOLDERS

ROOT = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "transformers", "triton", "safetensors", "peft")


def _face_tree() -> ast.Module:
    return ast.parse((ROOT / "packer" / "api.py").read_text())


def test_the_face_is_plain_imports_with_no_module_getattr() -> None:
    """Every name is bound by an import at the face's top level: no ``__getattr__`` (PEP 562) table to keep in step."""
    tree = _face_tree()
    assert not [n for n in tree.body if isinstance(n, ast.FunctionDef)]
    bound = {(a.asname or a.name) for n in tree.body if isinstance(n, ast.ImportFrom) and n.module != "__future__"
             and n.module != "typing" for a in n.names}
    assert set(api.__all__) == bound
    assert all(getattr(api, name, None) is not None for name in api.__all__)


def test_importing_the_face_loads_no_torch_nor_a_heavy_module() -> None:
    code = ("import json, sys; import lora_sweep.packer.api; "
            f"print(json.dumps(sorted(n for n in sys.modules if n.split('.')[0] in {HEAVY!r})))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == []


def test_the_object_loads_what_it_runs_when_a_method_is_called(tmp_path: Path) -> None:
    """``open_base`` is where torch comes in: a method imports the packer modules it runs (here all of the open)."""
    code = ("import json, sys; from lora_sweep.packer.api import open_base, tiny_base; "
            f"before = 'torch' in sys.modules; p = open_base(str(tiny_base('llama', {str(tmp_path / 'm')!r}))); "
            "print(json.dumps([before, type(p.model).__name__, p.pad_id is not None, p.source]))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    before, model, pad, source = json.loads(out.stdout.splitlines()[-1])
    assert (before, model, pad, source) == (False, "PackedModel", True, str(tmp_path / "m"))


def _type_checking_names() -> set[str]:
    """The names the face gives the type checker alone (its ``if TYPE_CHECKING:`` block)."""
    block = next(n for n in _face_tree().body if isinstance(n, ast.If) and getattr(n.test, "id", "") == "TYPE_CHECKING")
    return {a.name for node in block.body if isinstance(node, ast.ImportFrom) for a in node.names}


def test_the_type_checkers_names_are_declared() -> None:
    assert _type_checking_names() == set(api.TYPE_NAMES) and not set(api.TYPE_NAMES) & set(api.__all__)


def test_the_face_contract_forbids_every_other_packer_module() -> None:
    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    (face,) = [c for c in contracts if c["name"].endswith("only through packer.api")]
    children = {p.stem for p in (ROOT / "packer").iterdir() if p.suffix == ".py" or (p / "__init__.py").is_file()}
    assert {m.removeprefix("lora_sweep.packer.") for m in face["forbidden_modules"]} == children - {"api"}


def _imported_from_the_face(folders: tuple[str, ...], root: bool = True) -> set[str]:
    """Names the package's modules in ``folders`` (and with ``root`` the entry points there) import from the face."""
    names: set[str] = set()
    # the package's own files only: a clone may hold a build/ tree, a .venv or models beside them
    paths = [*(ROOT.glob("*.py") if root else ()), *(p for folder in folders for p in (ROOT / folder).rglob("*.py"))]
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == "lora_sweep.packer.api":
                names.update(a.name for a in node.names)
    return names


def test_the_face_holds_exactly_the_names_the_floors_above_use() -> None:
    """A name nothing above the packer imports widens the face for nothing; one imported but missing fails there."""
    above = tuple(f for f in PACKAGE_FOLDERS if f != "packer")
    assert _imported_from_the_face(above) == set(api.__all__) | set(api.TYPE_NAMES)


def test_sweep_asks_the_packer_one_object() -> None:
    """sweep/ opens the base once and asks that object for its work: of the packer's names it imports the object and
    plain values and namespaces only, never a loader, a training loop or a probe by itself."""
    values = {"AdapterSpec", "BaseShape", "MemoryModel", "jobs", "supported", "data", "variants"}
    assert _imported_from_the_face(("sweep",), root=False) - {"Packer", "open_base"} <= values


def test_the_face_stays_narrow() -> None:
    """The object, its two builders, three values and six namespaces: a new value joins the namespace it belongs to
    (``jobs``, ``supported``, ``data`` ...) rather than widening the face."""
    assert len(api.__all__) <= 12, sorted(api.__all__)
    modules = {n for n in api.__all__ if isinstance(getattr(api, n), types.ModuleType)}
    assert modules == {"jobs", "supported", "data", "evaluation", "gguf", "variants"}


@pytest.mark.parametrize("name", ["jobs", "supported"])
def test_a_gathering_namespace_names_its_owners_objects(name: str) -> None:
    """``jobs`` and ``supported`` define nothing: each of their names is its owner's object, bound by a plain import
    (the loop and a study file's check cannot disagree with them)."""
    module = getattr(api, name)
    tree = ast.parse(Path(module.__file__).read_text())
    imported = {(a.asname or a.name): n.module for n in tree.body if isinstance(n, ast.ImportFrom)
                and n.module != "__future__" for a in n.names}
    rest = tree.body[1:]  # after the docstring
    own = [n for n in rest if not isinstance(n, ast.ImportFrom) and not (
        isinstance(n, ast.Assign) and [getattr(t, "id", "") for t in n.targets] == ["__all__"])]
    assert ast.get_docstring(tree) and not own and set(module.__all__) == set(imported)
    for attr, owner in imported.items():
        assert getattr(module, attr) is getattr(importlib.import_module(owner), attr)
