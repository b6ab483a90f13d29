"""The dependency direction of the design card, checked two ways: import-linter's contracts
(pyproject.toml) and, for what it cannot see, what importing a module really loads; and the checkout's root as
a working directory: whatever puts it first on sys.path, the installed packages are the ones imported.

Hugging Face's ``kernels`` (which transformers requires) shares its import name with the folder ``kernels/``.
CI sets LORA_SWEEP_REQUIRE_HUB_KERNELS=1, so there the tests that need it installed cannot skip."""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import PACKAGE_FOLDERS

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = PACKAGE_FOLDERS

try:
    HUB = importlib.metadata.distribution("kernels")
except importlib.metadata.PackageNotFoundError:
    HUB = None
    if os.environ.get("LORA_SWEEP_REQUIRE_HUB_KERNELS"):
        raise
needs_hub = pytest.mark.skipif(HUB is None, reason="Hugging Face's kernels is not installed (pip install kernels)")


def _loaded(module: str) -> set[str]:
    """The top-level names importing ``module`` loads; a project package counts as its own name
    (``lora_sweep.packer.x`` -> ``packer``), a third-party one as its distribution's (``torch``)."""
    code = f"import json, sys; import {module}; print(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    names = json.loads(out.stdout)
    return {n.split(".")[1] if n.startswith("lora_sweep.") else n.split(".")[0] for n in names}


def test_import_contracts_hold() -> None:
    out = subprocess.run([sys.executable, ".ci/lint_imports.py", "--no-cache"], cwd=ROOT, capture_output=True,
                         text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    # a contract over a near-empty graph passes vacuously: the whole project is analysed (414 at the rename)
    files, deps = map(int, re.search(r"Analyzed (\d+) files, (\d+) dependencies", out.stdout).groups())
    assert files > 100 and deps > 350, out.stdout


def test_store_loads_no_heavy_or_project_module() -> None:
    """The store is the floor that sweep/ and reports/ both read: its face loads no other folder of ours and
    nothing heavy; its Optuna storages (storage.py) load Optuna and still no other folder."""
    folders = {"sweep", "packer", "kernels", "evaluators", "reports", "benchmarks", "cli", "api"}
    assert not _loaded("lora_sweep.store.api") & (folders | {"torch", "optuna", "transformers"})
    storages = _loaded("lora_sweep.store.storage")
    assert "optuna" in storages and not storages & (folders | {"torch", "transformers"})


def test_kernels_and_packer_import_without_sweep_deps() -> None:
    """The GPU image has no optuna, sqlite-utils, plotly or lm-eval: packer must not need them."""
    mods = _loaded("lora_sweep.packer.step.train")
    assert not mods & {"optuna", "sqlite_utils", "plotly", "lm_eval", "sweep"}


# Run from the checkout's root by each entry point: prints what `import kernels` and the seven folder names give,
# then loads the tiny model (its directory in TINY_MODEL) with transformers and wraps it with PEFT.
_USER_CODE = f"NAMES = {FOLDERS!r}\n" + """\
import importlib.util, json, os, sys
import kernels
import peft
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained(os.environ["TINY_MODEL"])
lora = peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))
found = {n: importlib.util.find_spec(n) for n in NAMES}
print("RESULT " + json.dumps({
    "path0": sys.path[0], "kernels": kernels.__file__, "version": kernels.__version__,
    "trainable": lora.get_nb_trainable_parameters()[0],
    "origins": {n: s and s.origin for n, s in found.items()},
    "loaded": [n for n in NAMES if n in sys.modules],
}))
"""


def _jupyter(tmp_path: Path) -> list[str]:
    """A Jupyter kernel's start: its own script first on sys.path, then ``''`` inserted before it (ipykernel does)."""
    kernel = tmp_path / "kernel.py"
    kernel.write_text("import sys\nsys.path.insert(0, '')\nexec(sys.stdin.read())\n")
    return [sys.executable, str(kernel)]


def _pytest(tmp_path: Path) -> list[str]:
    """``python -m pytest`` from the root, as this project runs it (importlib mode: the root is sys.path[0])."""
    test = tmp_path / "test_user.py"
    test.write_text("def test_user(capsys):\n    import sys\n    code = open(sys.argv[-1] + '.code').read()\n"
                    "    exec(code, {})\n    print(capsys.readouterr().out)\n")
    (tmp_path / "test_user.py.code").write_text(_USER_CODE)
    return [sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", "--import-mode=importlib",
            "--rootdir", str(tmp_path), "-c", os.devnull, str(test)]


ENTRY_POINTS = {
    "python -c": lambda tmp: [sys.executable, "-c", _USER_CODE],
    "script on stdin": lambda tmp: [sys.executable, "-"],
    "interactive session": lambda tmp: [sys.executable, "-i", "-q"],
    "jupyter kernel": _jupyter,
    "pytest": _pytest,
}


@needs_hub
@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_the_checkout_root_shadows_no_installed_package(entry: str, tmp_path: Path, tiny_dirs) -> None:  # noqa: ANN001
    """From the root, each way of starting Python puts the root (``''`` or its path) first on sys.path; still
    ``import kernels`` is Hugging Face's, transformers loads a model and PEFT wraps it, and no folder of the
    checkout is imported under its own name: a top-level ``sweep``, ``packer`` ... is absent or a namespace
    package (no ``__init__.py`` of ours runs), never one of our modules."""
    args = ENTRY_POINTS[entry](tmp_path)
    stdin = None if entry in ("python -c", "pytest") else _USER_CODE
    run = subprocess.run(args, cwd=ROOT, input=stdin, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "TINY_MODEL": str(tiny_dirs("llama"))})
    assert run.returncode == 0, run.stdout + run.stderr
    result = json.loads(next(line for line in run.stdout.splitlines() if "RESULT " in line).split("RESULT ", 1)[1])
    assert Path(result["path0"] or ".").resolve() == ROOT  # the root is first on sys.path: the case under test
    assert result["kernels"] == str(HUB.locate_file("kernels/__init__.py")) and result["version"] == HUB.version
    assert result["trainable"] > 0
    assert result["origins"]["kernels"] == result["kernels"]
    ours = {n: o for n, o in result["origins"].items() if o and Path(o).resolve().is_relative_to(ROOT)}
    assert not ours, ours
    assert result["loaded"] == ["kernels"]  # transformers and PEFT imported none of the clone's folders


def test_the_package_and_its_folders_import_from_the_root() -> None:
    """The same root still gives our modules under ``lora_sweep`` (the installed package, editable or not)."""
    code = "import lora_sweep.kernels.ops as k, lora_sweep.evaluators.registry as r; print(k.__file__, r.__file__)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.split() == [str(ROOT / "kernels" / "ops.py"), str(ROOT / "evaluators" / "registry.py")]


_STUDIES = """\
import json, sys
from pathlib import Path
import lora_sweep
from lora_sweep.sweep.config.loader import load_study
paths = sorted(Path("studies").rglob("*.yaml"))
for path in paths:  # a local model is built later (the file's header says how): its directory is not required here
    load_study(path, check_paths=False)
lora_sweep.load_study("studies/gpt2-single-objective.yaml")  # the public call, paths checked (a hub id)
heavy = sorted(n for n in sys.modules if n.split(".")[0] in ("torch", "transformers", "triton"))
print("RESULT " + json.dumps({"studies": len(paths), "heavy": heavy}))
"""


def test_loading_every_example_study_imports_no_torch() -> None:
    """Checking a study file (its keys, every evaluator's options and metrics, its data files) loads neither torch
    nor transformers: the evaluators import them where an evaluation runs, and the packer's names a study is
    checked against live in light modules (``packer.plan``, ``packer.data.rows``, ``packer.model``)."""
    run = subprocess.run([sys.executable, "-c", _STUDIES], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    result = json.loads(next(line for line in run.stdout.splitlines() if "RESULT " in line).split("RESULT ", 1)[1])
    assert result["studies"] > 0 and result["heavy"] == []
