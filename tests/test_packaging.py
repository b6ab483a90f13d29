"""One import name: the wheel installs ``lora_sweep`` alone (its root modules, among them the entry points cli.py
and api.py, and its folders below it, every module of them), with the
example studies, their data and both console scripts; pyproject.toml lists every folder that holds modules."""

from __future__ import annotations

import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

from tests.conftest import PACKAGE_FOLDERS

ROOT = Path(__file__).resolve().parents[1]
SETUPTOOLS = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
FOLDERS = PACKAGE_FOLDERS
MODULES = sorted(p.relative_to(ROOT).as_posix() for f in FOLDERS for p in (ROOT / f).rglob("*.py"))


def test_every_folder_holding_modules_is_listed() -> None:
    folders = {"lora_sweep." + ".".join(Path(m).parent.parts) for m in MODULES}
    assert SETUPTOOLS["package-dir"] == {"lora_sweep": "."}
    assert set(SETUPTOOLS["packages"]) == folders | {"lora_sweep"}


def test_the_top_level_folders_are_namespace_packages() -> None:
    """A folder without __init__.py is imported as a top-level name only when no sys.path entry holds a regular
    package or module of that name (PEP 420), so the checkout's root on sys.path shadows nothing installed."""
    assert not [f for f in FOLDERS if (ROOT / f / "__init__.py").exists()]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> zipfile.ZipFile:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(out), str(ROOT)],
                   check=True, capture_output=True, text=True, timeout=300)
    (path,) = out.glob("lora_sweep-*.whl")
    return zipfile.ZipFile(path)


def test_the_wheel_holds_lora_sweep_alone(wheel: zipfile.ZipFile) -> None:
    names = wheel.namelist()
    assert {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")} == {"lora_sweep"}
    top_level = next(n for n in names if n.endswith(".dist-info/top_level.txt"))
    assert wheel.read(top_level).decode().split() == ["lora_sweep"]
    assert {f"lora_sweep/{m}" for m in MODULES} <= set(names) and len(MODULES) > 100
    assert not [f for f in FOLDERS if f"lora_sweep/{f}/__init__.py" in names]
    # the root's modules: the public API's names, python -m lora_sweep, the entry points on top, the user errors
    assert {f"lora_sweep/{m}.py" for m in ("__init__", "__main__", "cli", "api", "errors")} <= set(names)
    assert not [n for n in names if n.startswith(("lora_sweep/tests/", "lora_sweep/.ci/"))]


def test_the_wheel_ships_the_examples_and_both_commands(wheel: zipfile.ZipFile) -> None:
    names = set(wheel.namelist())
    for study in (ROOT / "studies").glob("*.yaml"):
        assert f"lora_sweep/studies/{study.name}" in names
    for data in (ROOT / "studies" / "data").glob("*.jsonl"):
        assert f"lora_sweep/studies/data/{data.name}" in names
    assert "lora_sweep/benchmarks/sweep_split.sh" in names
    for table in (ROOT / "sweep" / "config").glob("*.yaml"):  # read at import by sweep.config
        assert f"lora_sweep/sweep/config/{table.name}" in names
    entry_points = wheel.read(next(n for n in names if n.endswith(".dist-info/entry_points.txt"))).decode()
    assert "sweep = lora_sweep.cli:main" in entry_points
    assert "lora-sweep = lora_sweep.cli:main" in entry_points
