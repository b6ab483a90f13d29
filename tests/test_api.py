"""The public Python API (``lora_sweep.load_study``, ``run``, ``open_results``, ``export``, ``write_report``): a tiny
study run, read, exported and reported from Python alone, as a notebook would."""

from __future__ import annotations

import json
import logging
import os
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


def _policy_and_threads(env: dict[str, str], first: str, study: Path | None = None) -> dict:
    """A fresh interpreter that imports ``first`` (torch or lora_sweep) first: the OpenMP policy torch's runtime
    read, and with ``study`` the torch threads seen at every step of its run and after it."""
    code = ("import json, os, sys\n"
            f"import {first}\n"
            "import lora_sweep, torch\n"
            "torch.set_num_threads(2)\n"
            "seen = []\n"
            "if len(sys.argv) > 1:\n"
            "    lora_sweep.run(sys.argv[1], progress=lambda p: seen.append(torch.get_num_threads()), log=print)\n"
            "print(json.dumps({'policy': os.environ.get('OMP_WAIT_POLICY'), 'seen': sorted(set(seen)),\n"
            "                  'after': torch.get_num_threads()}))")
    out = subprocess.run([sys.executable, "-c", code, *([str(study)] if study else [])], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    return {**json.loads(out.stdout.splitlines()[-1]), "stderr": out.stderr}


def test_importing_lora_sweep_first_gives_torch_the_clis_passive_openmp_policy_unless_one_was_chosen() -> None:
    """Spinning OpenMP threads make a sweep 2x slower than the CLI beside one busy process: ``import lora_sweep``
    sets the CLI's OMP_WAIT_POLICY=PASSIVE before torch loads, and a policy the environment chose wins."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    assert _policy_and_threads(env, "lora_sweep")["policy"] == "PASSIVE"
    assert _policy_and_threads({**env, "OMP_WAIT_POLICY": "ACTIVE"}, "lora_sweep")["policy"] == "ACTIVE"
    assert _policy_and_threads(env, "torch")["policy"] is None  # too late for the runtime: left unset, not faked


def test_a_run_after_torch_was_imported_first_trains_on_one_thread_and_gives_the_threads_back(
        tmp_path: Path, tiny_dirs) -> None:  # noqa: ANN001
    """torch imported first, no policy: its runtime spins for good, so the engine's steps run on one thread (said in
    one warning) and the caller's count comes back after; imported after lora_sweep, the run keeps the caller's."""
    def two_steps(name: str) -> Path:
        return write_study(tmp_path, tiny_dirs("llama"), name=name, budget={"trials": 2}, pruning={"kind": "none"},
                           train={"max_steps": 2, "micro_batch": 2}, pack={"max_slots": 2},
                           evaluators=[{"name": "heldout_loss"}])

    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    spun = _policy_and_threads(env, "torch", two_steps("spun"))
    assert (spun["seen"], spun["after"]) == ([1], 2)
    assert "torch was imported before lora_sweep with no OMP_WAIT_POLICY" in spun["stderr"]
    asleep = _policy_and_threads(env, "lora_sweep", two_steps("asleep"))
    assert (asleep["seen"], asleep["after"]) == ([2], 2) and "spin" not in asleep["stderr"]


def test_a_study_from_python(tmp_path: Path, tiny_dirs, caplog) -> None:  # noqa: ANN001
    path = write_study(tmp_path, tiny_dirs("llama"), budget={"trials": 3}, pruning={"kind": "none"},
                       train={"max_steps": 4, "micro_batch": 2})
    spec = lora_sweep.load_study(path, ["train.max_steps=3"], out=tmp_path / "study")
    assert spec.train.max_steps == 3 and spec.out_dir == tmp_path / "study"
    with caplog.at_level(logging.INFO, logger="lora_sweep"):
        summary = lora_sweep.run(spec)  # no log=: the lines go to the lora_sweep logger
    assert summary.complete == 3 and summary.failed == 0
    said = [r.getMessage() for r in caplog.records if r.name == "lora_sweep" and r.levelno == logging.INFO]
    assert any(line.startswith("loading the base model") for line in said), said
    assert sum(" started in slot " in line for line in said) == 3, said
    assert said[-1] == f"small: {summary.ended}", said

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
    assert again.steps == 0 and again.spent and again.already_spent and not again.over
    assert again.ended.startswith("nothing to run: the budget was already spent (3 trials)"), again.ended


@pytest.mark.parametrize(("kwargs", "said"), [
    ({}, "export: give exactly one of trial=N and best=True"),
    ({"trial": 0, "objective": "eval_loss"}, "export: objective='eval_loss' goes with best=True"),
    ({"best": True, "objective": "accuracy"}, "export: objective='accuracy' is not an objective of this study"),
    ({"best": True}, "or pass objective='eval_loss' or objective='adapter_params'"),
])
def test_export_errors_name_the_functions_arguments_not_the_cli_flags(tmp_path: Path, kwargs, said) -> None:
    from lora_sweep.store.api import ResultsStore, StudyDir

    sdir = StudyDir(tmp_path / "study").create()  # two objectives, two trials on the Pareto front, no training
    sdir.write_study_yaml("name: study\n")
    with ResultsStore(sdir.results_db) as store:
        store.set_meta(name="study", objectives=["eval_loss", "adapter_params"], directions=["minimize", "minimize"])
        for number, values in enumerate([[1.0, 9.0], [2.0, 1.0]]):
            store.upsert_trial(number, state="COMPLETE", objective_values=values)
    with pytest.raises(lora_sweep.UserError) as err:
        lora_sweep.export(sdir.root, tmp_path / "out", **kwargs)
    assert said in str(err.value) and "--" not in str(err.value), str(err.value)


def test_errors_are_user_errors(tmp_path: Path) -> None:
    with pytest.raises(lora_sweep.UserError, match="not a study directory"):
        lora_sweep.open_results(tmp_path)
    with pytest.raises(lora_sweep.ConfigError):
        lora_sweep.load_study(tmp_path / "missing.yaml")


def test_example_copies_a_study_with_its_data(tmp_path: Path) -> None:
    from lora_sweep.cli import main

    assert "demo" in lora_sweep.examples()  # api.md lists both at the package's top
    path = lora_sweep.copy_example("demo", tmp_path / "work")
    text = path.read_text()
    assert "./models/smollm2-135m" in text and "../models" not in text
    from lora_sweep.sweep.config.loader import load_study

    spec = load_study(path, check_paths=False)  # the model is built later, by `sweep model smollm2`
    assert spec.data.train == tmp_path / "work" / "data" / "cards-train.jsonl" and spec.data.train.is_file()
    assert Path(spec.model.path) == tmp_path / "work" / "models" / "smollm2-135m"
    with pytest.raises(SystemExit) as exit_:
        main(["example", "demo", "--out", str(tmp_path / "work")])  # not empty now: one line, exit 2
    assert exit_.value.code == 2
