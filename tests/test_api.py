"""The public Python API (``lora_sweep.load_study``, ``run``, ``open_results``, ``export``, ``write_report``): a tiny
study run, read, exported and reported from Python alone, as a notebook would."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import lora_sweep
from tests.conftest import write_study

ROOT = Path(__file__).resolve().parents[1]


def test_import_is_light_and_names_load_on_use() -> None:
    code = ("import json, sys, lora_sweep; before = 'optuna' in sys.modules or 'torch' in sys.modules; "
            "lora_sweep.load_study; print(json.dumps([before, sorted(n for n in lora_sweep.__all__)]))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    before, names = json.loads(out.stdout)
    assert before is False
    assert {"load_study", "run", "open_results", "export", "write_report", "Results"} <= set(names)


def test_a_study_from_python(tmp_path: Path, tiny_dirs) -> None:  # noqa: ANN001
    path = write_study(tmp_path, tiny_dirs("llama"), budget={"trials": 3}, pruning={"kind": "none"},
                       train={"max_steps": 4, "micro_batch": 2})
    spec = lora_sweep.load_study(path, ["train.max_steps=3"], out=tmp_path / "study")
    assert spec.train.max_steps == 3 and spec.out_dir == tmp_path / "study"
    summary = lora_sweep.run(spec)
    assert summary.complete == 3 and summary.failed == 0

    results = lora_sweep.open_results(tmp_path / "study")
    trials = results.trials()
    assert [t.number for t in trials] == [0, 1, 2] and all(t.state == "COMPLETE" for t in trials)
    front = results.best_trials()
    values = {t.number: t.objective_values for t in trials}
    # the front: no complete trial dominates a member; every non-member is dominated by one
    dominated = {b for b in values for a in values if values[a] != values[b]
                 and all(x <= y for x, y in zip(values[a], values[b], strict=True))}
    assert {t.number for t in front} == set(values) - dominated and front
    assert results.status()["counts"] == {"COMPLETE": 3}

    done = lora_sweep.export(tmp_path / "study", tmp_path / "adapter", trial=front[0].number, vllm=False)
    assert done.trial == front[0].number and (tmp_path / "adapter" / "adapter_config.json").is_file()
    report = lora_sweep.write_report(tmp_path / "study", tmp_path / "r" / "report.html")
    assert report.is_file() and "<html" in report.read_text()[:2000].lower()

    again = lora_sweep.run(path, ["train.max_steps=3"], out=tmp_path / "study")  # a file and overrides: resumes
    assert again.steps == 0 and again.spent


def test_errors_are_user_errors(tmp_path: Path) -> None:
    with pytest.raises(lora_sweep.UserError, match="not a study directory"):
        lora_sweep.open_results(tmp_path)
    with pytest.raises(lora_sweep.ConfigError):
        lora_sweep.load_study(tmp_path / "missing.yaml")


def test_example_copies_a_study_with_its_data(tmp_path: Path) -> None:
    from lora_sweep.sweep.cli import main

    assert "demo" in lora_sweep.sweep.api.examples()
    path = lora_sweep.sweep.api.copy_example("demo", tmp_path / "work")
    text = path.read_text()
    assert "./models/smollm2-135m" in text and "../models" not in text
    from lora_sweep.sweep.loader import load_study

    spec = load_study(path, check_paths=False)  # the model is built later, by `sweep model smollm2`
    assert spec.data.train == tmp_path / "work" / "data" / "cards-train.jsonl" and spec.data.train.is_file()
    assert Path(spec.model.path) == tmp_path / "work" / "models" / "smollm2-135m"
    with pytest.raises(SystemExit) as exit_:
        main(["example", "demo", "--out", str(tmp_path / "work")])  # not empty now: one line, exit 2
    assert exit_.value.code == 2
