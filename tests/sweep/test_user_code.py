"""A study's user code (``file.py:OBJECT`` evaluators): taken from the study file's folder, imported once per process,
never by ``sweep plan`` or ``sweep status``, and contained when it runs: what it raises or returns wrongly fails its
trials with a one-line reason and the run goes on; one that hangs is stopped by its timeout or the wall-time budget."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from lora_sweep.cli import cli
from lora_sweep.errors import ConfigError
from lora_sweep.evaluators.registry import (
    EvalResult,
    EvaluatorHung,
    Limits,
    abandoned,
    evaluate,
    find,
)
from lora_sweep.store.api import ResultsStore, StudyDir
from lora_sweep.sweep.config.loader import load_study
from lora_sweep.sweep.study import run_study
from tests.conftest import write_study

USER_EVALUATOR = Path(__file__).with_name("user_evaluator.py")


def _study(tmp_path: Path, model: Path, mode: str = "ok", **changes: object) -> Path:
    """A 2-slot study in ``tmp_path/study/`` naming ``ev.py:EV`` (a path relative to the study file)."""
    folder = tmp_path / "study"
    folder.mkdir()
    shutil.copy(USER_EVALUATOR, folder / "ev.py")
    fields = {"train": {"max_steps": 3, "micro_batch": 2}, "budget": {"trials": 4}, "pruning": {"kind": "none"},
              "pack": {"max_slots": 2}, "objectives": [{"metric": "eval_loss", "direction": "minimize"}],
              "evaluators": ["heldout_loss", {"name": "ev.py:EV", "options": {"mode": mode}}], **changes}
    return write_study(folder, model, name="user", **fields)


def _imports(study: Path) -> int:
    log = study.parent / "imports.log"
    return len(log.read_text().splitlines()) if log.exists() else 0


def _trials(spec_out: Path) -> list:
    return ResultsStore(StudyDir(spec_out).results_db).trials()


@pytest.fixture
def elsewhere(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A working directory that is not the study file's: its paths must not resolve from here."""
    cwd = tmp_path / "elsewhere"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    return cwd


def test_the_file_resolves_from_the_study_folder_and_is_imported_once(tiny_dirs, tmp_path, elsewhere) -> None:
    study = _study(tmp_path, tiny_dirs("llama"), pruning={"kind": "cohort_sha", "rungs": [2], "reduction_factor": 2},
                   objectives=[{"metric": "ev_score", "direction": "maximize"}])
    spec = load_study(study)
    assert spec.evaluators[1].name == f"{study.parent / 'ev.py'}:EV"
    summary = run_study(spec, log=lambda m: None)
    assert summary.complete + summary.pruned == 4
    assert _imports(study) == 1  # the load, the objective's direction, every rung and final evaluation: one import
    runner = CliRunner()
    assert runner.invoke(cli, ["status", str(spec.out_dir)]).exit_code == 0
    assert _imports(study) == 1  # status reads the store, never the study's code


def test_plan_does_not_import_user_code_and_says_so(tiny_dirs, tmp_path, elsewhere, monkeypatch) -> None:
    import lora_sweep.sweep.device as device

    def stop(*a: object) -> None:
        raise ConfigError("stop here: the study was loaded")

    monkeypatch.setattr(device, "resolve_device", stop)
    study = _study(tmp_path, tiny_dirs("llama"))
    result = CliRunner().invoke(cli, ["plan", str(study)])
    assert "stop here" in str(result.exception)
    assert "note: evaluators.1: " in result.output and "ev.py:EV is user code: not imported by sweep plan" in \
        result.output
    assert _imports(study) == 0
    (study.parent / "ev.py").unlink()  # a file that is not there is still refused, by its resolved path
    missing = CliRunner().invoke(cli, ["plan", str(study)])
    assert isinstance(missing.exception, ConfigError) and "file not found" in str(missing.exception)
    assert str(study.parent / "ev.py") in str(missing.exception)


def test_an_evaluator_that_raises_fails_its_trials_and_the_run_goes_on(tiny_dirs, tmp_path, elsewhere) -> None:
    spec = load_study(_study(tmp_path, tiny_dirs("llama"), mode="raise"))
    summary = run_study(spec, log=lambda m: None)
    assert summary.failed == 4 and summary.end_reason == "budget.trials"
    trials = _trials(spec.out_dir)
    assert {t.state for t in trials} == {"FAIL"}
    for t in trials:
        assert t.reason == "evaluator ev.py:EV raised RuntimeError: the judge is down (second line)"


def test_an_evaluator_that_raises_at_a_rung_fails_those_trials(tiny_dirs, tmp_path, elsewhere) -> None:
    spec = load_study(_study(tmp_path, tiny_dirs("llama"), mode="raise", objectives=[
        {"metric": "ev_score", "direction": "maximize"}], pruning={"kind": "cohort_sha", "rungs": [2],
                                                                   "reduction_factor": 2}))
    summary = run_study(spec, log=lambda m: None)
    assert summary.failed == 4 and summary.pruned == 0
    for t in _trials(spec.out_dir):
        assert t.state == "FAIL" and t.reason == ("at the rung of step 2: evaluator ev.py:EV raised RuntimeError: "
                                                  "the judge is down (second line)")


def test_a_run_stops_at_an_evaluators_timeout_with_its_trials_failed(tiny_dirs, tmp_path, elsewhere) -> None:
    study = _study(tmp_path, tiny_dirs("llama"), mode="hang", evaluators=[
        "heldout_loss", {"name": "ev.py:EV", "options": {"mode": "hang"}, "timeout": "1s"}])
    spec = load_study(study)
    try:
        with pytest.raises(EvaluatorHung, match=r"^evaluator ev.py:EV did not return within 1 s "
                                                r"\(evaluators.1.timeout\); its trials failed and the run stops"):
            run_study(spec, log=lambda m: None)
    finally:
        find(spec.evaluators[1].name).score.__globals__["RELEASE"].set()
    trials = _trials(spec.out_dir)
    assert trials and {t.state for t in trials} == {"FAIL"}
    assert all(t.reason.startswith("evaluator ev.py:EV did not return within 1 s") for t in trials)


class _Model:
    device = torch.device("cpu")


@pytest.mark.parametrize(("mode", "reason"), [
    ("dict", "evaluator ev.py:EV returned a dict, not an EvalResult"),
    ("string", "evaluator ev.py:EV: metric 'ev_score' is a str ('0.5'), not a number"),
    ("nan", "evaluator ev.py:EV: metric 'ev_score' is not finite (nan)"),
    ("raise", "evaluator ev.py:EV raised RuntimeError: the judge is down (second line)"),
])
def test_a_wrong_result_fails_each_slot_with_one_line(tmp_path, mode: str, reason: str) -> None:
    shutil.copy(USER_EVALUATOR, tmp_path / "ev.py")
    result = evaluate(_Model(), [0, 3], None, [(f"{tmp_path / 'ev.py'}:EV", {"mode": mode})])  # type: ignore[arg-type]
    assert result.metrics == {} and {s: e.reason for s, e in result.errors.items()} == {0: reason, 3: reason}
    good = evaluate(_Model(), [0, 3], None, [(f"{tmp_path / 'ev.py'}:EV", {})])  # type: ignore[arg-type]
    assert good.errors == {} and good.metrics == {0: {"ev_score": 0.5}, 3: {"ev_score": 0.5}}


def test_a_hung_evaluator_is_abandoned_at_its_timeout(tmp_path) -> None:
    shutil.copy(USER_EVALUATOR, tmp_path / "ev.py")
    name = f"{tmp_path / 'ev.py'}:EV"
    module = find(name).score.__globals__
    t0 = time.monotonic()
    try:
        with pytest.raises(EvaluatorHung) as hung:
            evaluate(_Model(), [1], None, [(name, {"mode": "hang"})],  # type: ignore[arg-type]
                     limits=Limits({name: 0.5}, None, {name: "evaluators.1.timeout"}))
        assert time.monotonic() - t0 < 5
        assert str(hung.value).startswith("evaluator ev.py:EV did not return within 0.5 s (evaluators.1.timeout)")
        assert isinstance(hung.value.result, EvalResult) and set(hung.value.result.errors) == {1}
        assert len(abandoned()) >= 1
        with pytest.raises(EvaluatorHung, match=r"^budget.wall_time was reached while evaluator ev.py:EV ran"):
            evaluate(_Model(), [1], None, [(name, {"mode": "hang"})],  # type: ignore[arg-type]
                     limits=Limits({name: 600.0}, time.monotonic() + 0.5, grace=0.2))
        t0 = time.monotonic()
        with pytest.raises(EvaluatorHung):  # started after the budget's end: it still has the grace
            evaluate(_Model(), [1], None, [(name, {"mode": "hang"})],  # type: ignore[arg-type]
                     limits=Limits({name: 600.0}, time.monotonic() - 5, grace=1.0))
        assert time.monotonic() - t0 >= 1.0
        module["RELEASE"].set()
        late = evaluate(_Model(), [1], None, [(name, {})], limits=Limits({}, time.monotonic() - 5))  # type: ignore[arg-type]
        assert late.errors == {} and late.metrics == {1: {"ev_score": 0.5}}  # a quick one after the end is scored
    finally:
        module["RELEASE"].set()


def test_the_timeout_key_is_validated(tiny_dirs, tmp_path) -> None:
    study = _study(tmp_path, tiny_dirs("llama"), evaluators=[{"name": "ev.py:EV", "timeout": "90s"}, "heldout_loss"])
    spec = load_study(study)
    assert spec.evaluators[0].timeout == 90.0 and spec.evaluators[1].timeout == 600.0
    for bad in ("0", "soon"):
        with pytest.raises(ConfigError, match=r"evaluators\.0\.timeout: must be"):
            load_study(study, [f"evaluators.0.timeout={bad}"])


def test_a_run_with_a_hanging_evaluator_ends_within_the_wall_time(tiny_dirs, tmp_path) -> None:
    """``sweep run`` ends within 60 s of its start with ``budget.wall_time: 15s`` and an evaluator that never returns:
    the trials it scored failed with the reason, none left RUNNING. Counted from the run's first line (the
    interpreter's and torch's import before it take from 2 s on an idle machine to 30 s on a loaded one)."""
    study = _study(tmp_path, tiny_dirs("llama"), mode="hang", budget={"wall_time": "15s"})
    proc = subprocess.Popen([sys.executable, "-m", "lora_sweep.cli", "run", str(study)], cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert proc.stdout is not None
    lines, started = [], None
    for line in proc.stdout:
        started = started or time.monotonic()
        lines.append(line)
    code = proc.wait(timeout=120)
    output = "".join(lines)
    assert started is not None and time.monotonic() - started < 60, output[-2000:]
    assert code == 2, output[-2000:]
    assert "error: budget.wall_time was reached while evaluator ev.py:EV ran" in output
    assert "Traceback" not in output
    trials = _trials(study.parent / "runs-user")
    failed = [t for t in trials if t.state == "FAIL" and "budget.wall_time was reached" in (t.reason or "")]
    assert len(failed) >= 1 and not [t for t in trials if t.state == "RUNNING"]


def test_a_custom_function_file_resolves_from_the_study_folder(tiny_dirs, tmp_path, elsewhere) -> None:
    study = _study(tmp_path, tiny_dirs("llama"), evaluators=[
        {"name": "custom", "options": {"function": "metrics.py:score", "metric": "m"}}, "heldout_loss"])
    (study.parent / "metrics.py").write_text("def score(generation, row):\n    return 1.0\n")
    spec = load_study(study)
    assert spec.evaluators[0].options["function"] == f"{study.parent / 'metrics.py'}:score"
    assert load_study(study, ["evaluators.0.options.function=math:sqrt"]).evaluators[0].options["function"] == \
        "math:sqrt"  # a module name stays one
