"""The trackers' process seen from the run (sweep/trackers/process.py): started ahead of the engine's imports (by
``sweep run`` with the loaded study's trackers, through the API with any), it logs the trackers the study names; a
study that does not load starts none, and a run that dies before telling it the study leaves no process behind."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import lora_sweep.cli as cli
from lora_sweep import api
from lora_sweep.errors import ConfigError
from lora_sweep.sweep.trackers import process
from tests.conftest import need_module, write_study
from tests.sweep.trackers.readers import tensorboard_logged


@pytest.fixture(autouse=True)
def _packages(monkeypatch: pytest.MonkeyPatch) -> None:
    for module in ("mlflow", "tensorboard"):
        need_module(module, module)


def test_a_process_started_ahead_logs_the_trackers_the_study_names(tiny_dirs, tmp_path: Path) -> None:
    """Guessed MLflow, told TensorBoard: TensorBoard holds every trial, and MLflow nothing (no store made)."""
    path = write_study(tmp_path, tiny_dirs("llama"), name="told", budget={"trials": 2},
                       train={"max_steps": 4, "micro_batch": 4}, pruning={"kind": "none"}, trackers=["tensorboard"])
    lines: list[str] = []
    started = process.ahead([("mlflow", {})], interval=0.2)
    assert started is not None
    summary = api.run(path, log=lines.append, trackers=started)
    assert summary.complete == 2
    assert sorted(tensorboard_logged(tmp_path / "runs-told").children) == [0, 1]
    assert not (tmp_path / "runs-told" / "mlflow.db").exists()
    assert any(re.match(r"trackers: [1-9]\d* passes; CPU", line) for line in lines), lines
    assert not any("warning" in line for line in lines), lines


def test_a_study_that_does_not_load_starts_no_process_and_one_given_to_the_api_is_stopped(
        tiny_dirs, tmp_path: Path, monkeypatch, capsys) -> None:
    path = write_study(tmp_path, tiny_dirs("llama"), name="unloaded", trackers=["tensorboard"],
                       data={"train": str(tmp_path / "missing.jsonl"), "format": "prompt_completion"})
    started: list[process.Tracking] = []
    real = process.ahead
    monkeypatch.setattr(process, "ahead", lambda *a, **k: started.append(real(*a, **k)) or started[-1])
    with pytest.raises(SystemExit) as err:  # sweep run: the study is refused before the trackers' process starts
        cli.main(["run", str(path), "--quiet"])
    assert err.value.code == 2 and "missing.jsonl" in capsys.readouterr().err
    assert started == []
    mine = real([("tensorboard", {})])
    assert mine is not None
    with pytest.raises(ConfigError, match="missing.jsonl"):  # the API, given a process started ahead
        api.run(path, trackers=mine)
    assert mine.process is not None and mine.process.poll() is not None


def test_a_run_gone_before_telling_the_study_ends_the_process() -> None:
    """EOF on its stdin before the study's line (the run's process killed while it loaded): the process exits."""
    started = process.ahead([("tensorboard", {})])
    assert started is not None and started.process is not None and started.process.stdin is not None
    started.process.stdin.close()
    assert started.process.wait(timeout=60) == 0
