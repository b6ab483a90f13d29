"""lora-sweep beside Hugging Face's ``kernels`` (the hub-kernels package transformers >= 5.25 requires): its import
name is also one of this checkout's folders. Installed together, ``import kernels`` is Hugging Face's, from the
checkout's root and from elsewhere, and a study runs through ``sweep run`` and through the Python API.

CI installs ``kernels`` and sets LORA_SWEEP_REQUIRE_HUB_KERNELS=1, so there these tests cannot skip."""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

try:
    HUB = importlib.metadata.distribution("kernels")
except importlib.metadata.PackageNotFoundError:
    HUB = None
    if os.environ.get("LORA_SWEEP_REQUIRE_HUB_KERNELS"):
        raise
pytestmark = pytest.mark.skipif(HUB is None, reason="Hugging Face's kernels is not installed (pip install kernels)")


def _kernels_file(cwd: Path, *flags: str, first: str = "") -> str:
    code = f"{first}import kernels; print(kernels.__file__)"
    return subprocess.run([sys.executable, *flags, "-c", code], cwd=cwd, capture_output=True, text=True,
                          check=True).stdout.strip()


def test_import_kernels_is_hugging_faces_everywhere(tmp_path: Path) -> None:
    hub = str(HUB.locate_file("kernels/__init__.py"))
    assert _kernels_file(tmp_path) == hub                              # elsewhere
    assert _kernels_file(ROOT, "-P") == hub                            # the root, safe path (as a console script)
    assert _kernels_file(ROOT, first="import lora_sweep; ") == hub     # the root on sys.path, as python -m does
    import kernels  # this process: python -m pytest from the root

    assert kernels.__file__ == hub and not hasattr(kernels, "PackLayout")
    from lora_sweep.kernels import PackLayout  # noqa: F401  (ours, under its own name)


def test_transformers_finds_hub_kernels_and_loads_a_model(tiny_dirs) -> None:  # noqa: ANN001
    """What transformers probes for hub kernels (find_spec and the distribution's version) is Hugging Face's
    package; whether it then uses them depends on its version window (5.24 takes 0.18.2-0.19, the index has
    0.17.2 today), and a model loads either way."""
    import importlib.util

    from transformers import AutoModelForCausalLM

    assert importlib.util.find_spec("kernels").origin == str(HUB.locate_file("kernels/__init__.py"))
    assert importlib.metadata.version("kernels") == HUB.version
    model = AutoModelForCausalLM.from_pretrained(tiny_dirs("llama"))
    assert model.config.model_type == "llama"


def test_a_study_runs_through_the_cli_and_the_api(tmp_path: Path, tiny_dirs) -> None:  # noqa: ANN001
    import lora_sweep
    from tests.conftest import write_study

    path = write_study(tmp_path, tiny_dirs("llama"), budget={"trials": 2}, pruning={"kind": "none"},
                       train={"max_steps": 2, "micro_batch": 2})
    exe = shutil.which("sweep") or pytest.fail("the sweep console script is not installed")
    for cwd in (ROOT, tmp_path):
        out = tmp_path / f"cli-{cwd.name}"
        run = subprocess.run([exe, "run", str(path), "--quiet", "--out", str(out)], cwd=cwd, capture_output=True,
                             text=True, timeout=300)
        assert run.returncode == 0, run.stdout + run.stderr
        assert "2 complete" in run.stdout
    summary = lora_sweep.run(path, out=tmp_path / "api")
    assert summary.complete == 2
