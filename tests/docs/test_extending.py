"""docs/guides/extending.md's examples: both scripts run (each runs a 4-trial study on the tiny model with its new
evaluator or storage backend and asserts the outcome), and both new implementations keep their contract."""

from __future__ import annotations

import os
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

from lora_sweep.evaluators.registry import Evaluator, find
from lora_sweep.store import storage
from lora_sweep.testing.evaluator import EvaluatorContract
from lora_sweep.testing.storage import StorageContract
from tests.evaluators.conftest import YESNO

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "docs" / "examples"


@pytest.mark.parametrize("script", ["extending_evaluator.py", "extending_storage.py"])
def test_the_example_runs_its_study(script: str) -> None:
    result = subprocess.run([sys.executable, str(EXAMPLES / script)], capture_output=True, text=True, timeout=600,
                            cwd=ROOT, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert result.returncode == 0, result.stderr[-3000:]


# --8<-- [start:evaluator_contract]
class TestNumberRateContract(EvaluatorContract):
    @pytest.fixture
    def evaluator(self) -> Evaluator:
        return find(f"{EXAMPLES / 'extending_evaluator.py'}:NUMBER_RATE")  # as a study file names it

    @pytest.fixture
    def data_file(self) -> Path:
        return YESNO  # rows with a prompt and a completion

    @pytest.fixture
    def bad_option(self) -> tuple:
        return ("max_new_tokens", 0)
# --8<-- [end:evaluator_contract]


def test_the_contract_as_one_call() -> None:
    # --8<-- [start:check_call]
    from lora_sweep.testing.evaluator import check_evaluator

    check_evaluator(find(f"{EXAMPLES / 'extending_evaluator.py'}:NUMBER_RATE"), data_file=YESNO,
                    bad_option=("max_new_tokens", 0))  # and options=..., model_dir=... (default: the tiny Llama)
    # --8<-- [end:check_call]


# --8<-- [start:storage_contract]
FOLDER_EXAMPLE = EXAMPLES / "extending_storage.py"


class TestFolderStorageContract(StorageContract):
    @pytest.fixture(autouse=True)
    def backend(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """The backend in ``BACKENDS`` for this test only."""
        monkeypatch.setattr(storage, "BACKENDS", [*storage.BACKENDS, runpy.run_path(str(FOLDER_EXAMPLE))["FOLDER"]])

    @pytest.fixture
    def holder_setup(self) -> str:  # the lock holder's process adds it as well
        return ("import runpy; from lora_sweep.store import storage\n"
                f"storage.BACKENDS.append(runpy.run_path({str(FOLDER_EXAMPLE)!r})['FOLDER'])")

    @pytest.fixture
    def url(self, tmp_path: Path) -> str:
        return f"folder://{tmp_path / 'study'}"

    @pytest.fixture
    def unopenable_url(self, tmp_path: Path) -> str:
        (tmp_path / "study" / "optuna.log").mkdir(parents=True)  # a folder where the journal file should be
        return f"folder://{tmp_path / 'study'}"
# --8<-- [end:storage_contract]
