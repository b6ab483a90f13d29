"""Bad inputs and faults that hold, each through the command line on a tiny model, so none regresses: a NaN metric,
``lr_ratio: 1e9``, a corrupt ``mlflow.db``, a PiSSA rank wider than its layer, an unknown storage scheme, exporting a
failed trial, and two runs from two study directories over one journal storage. Each ends in exit 2 and one line,
or in the correct outcome (the run goes on, every trial finished with a reason where it failed)."""

from __future__ import annotations

import math
import subprocess
import time
from pathlib import Path

import pytest

from lora_sweep.store.api import ResultsStore
from tests.conftest import need_module, write_study
from tests.helpers import cli, stored_trials

SMALL = {"budget": {"trials": 2}, "train": {"max_steps": 2, "micro_batch": 4, "dropout": 0.0},
         "pruning": {"kind": "none"}, "search": {"rank": [2, 4], "lr": {"low": 1e-3, "high": 1e-2, "log": True}},
         "evaluators": [{"name": "heldout_loss"}], "objectives": [{"metric": "eval_loss", "direction": "minimize"}],
         "pack": {"max_slots": 2}}


def _study(tmp_path: Path, tiny_dirs, name: str, **changes) -> Path:  # noqa: ANN001, ANN003
    return write_study(tmp_path, tiny_dirs("llama"), name, **{**SMALL, **changes})


def _sweep(*args: str | Path, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(cli(*map(str, args)), capture_output=True, text=True, timeout=timeout)


def _one_error(done: subprocess.CompletedProcess) -> str:
    """The one line of a refused command (exit 2, no traceback)."""
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in done.stderr, done.stderr
    return lines[0]


def _trials(out: Path) -> list:
    with ResultsStore(out / "results.db", create=False) as store:
        return store.trials()


@pytest.fixture(scope="module")
def nan_study(tmp_path_factory, tiny_dirs) -> Path:  # noqa: ANN001
    """A study whose user metric is NaN for every item: its run, and the study directory it leaves."""
    tmp = tmp_path_factory.mktemp("nan")
    (tmp / "metric.py").write_text("def nan_metric(text, row):\n    return float('nan')\n")
    evaluators = [{"name": "heldout_loss"},
                  {"name": "custom", "options": {"function": f"{tmp / 'metric.py'}:nan_metric", "max_new_tokens": 2}}]
    study = _study(tmp, tiny_dirs, "nan", evaluators=evaluators)
    done = _sweep("run", study, "--quiet")
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    return tmp / "runs-nan"


def test_a_nan_metric_fails_its_trials_with_a_reason_and_the_run_ends(nan_study: Path) -> None:
    trials = _trials(nan_study)
    assert len(trials) == 2 and {t.state for t in trials} == {"FAIL"}
    assert all("nan_metric" in t.reason and "must be finite, got nan" in t.reason for t in trials)


def test_exporting_a_failed_trial_is_one_line_naming_why(nan_study: Path, tmp_path: Path) -> None:
    line = _one_error(_sweep("export", nan_study, "--trial", "0", "--out", tmp_path / "adapter"))
    assert line.startswith("error: export: trial 0 is failed (custom metric ") and line.endswith(
        "; only complete trials have an adapter")
    assert list(tmp_path.iterdir()) == []


def test_an_lr_ratio_of_1e9_finishes_every_trial(tiny_dirs, tmp_path: Path) -> None:
    """LoRA+'s B learning rate a billion times A's: each trial ends complete with a finite loss or failed with its
    reason; none is left RUNNING and the run does not crash."""
    study = _study(tmp_path, tiny_dirs, "ratio", train={**SMALL["train"], "lr_ratio": 1e9})
    done = _sweep("run", study, "--quiet")
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    trials = _trials(tmp_path / "runs-ratio")
    assert len(trials) == 2
    for t in trials:
        assert (t.state == "COMPLETE" and all(math.isfinite(v) for v in t.objective_values)) or (
            t.state == "FAIL" and t.reason), t


def test_a_corrupt_mlflow_db_is_one_warning_and_the_run_goes_on(tiny_dirs, tmp_path: Path) -> None:
    need_module("mlflow", "mlflow")
    study = _study(tmp_path, tiny_dirs, "tracked", trackers=["mlflow"])
    out = tmp_path / "runs-tracked"
    out.mkdir()
    (out / "mlflow.db").write_bytes(b"not a database, " * 256)
    done = _sweep("run", study, "--quiet")
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    assert len([line for line in done.stderr.splitlines() if line.startswith("warning") and "mlflow" in line]) <= 1
    assert [t.state for t in _trials(out)] == ["COMPLETE", "COMPLETE"]


def test_a_pissa_rank_wider_than_a_layer_is_refused_before_any_trial(tiny_dirs, tmp_path: Path) -> None:
    study = _study(tmp_path, tiny_dirs, "wide", search={"rank": [4, 128]},
                   train={**SMALL["train"], "init": "pissa"})
    for _ in range(2):  # a rerun is refused the same way: nothing was left behind to resume
        line = _one_error(_sweep("run", study, "--quiet"))
        assert line == ("error: search.rank: rank 128 is larger than layer model.layers.0.self_attn.q_proj (64 -> 64) "
                        "of train.targets, whose largest rank is 64")
        assert not (tmp_path / "runs-wide" / "results.db").exists()
        assert not list((tmp_path / "runs-wide").glob("optuna*"))


def test_an_unknown_storage_scheme_is_refused_before_the_model_loads(tiny_dirs, tmp_path: Path) -> None:
    study = _study(tmp_path, tiny_dirs, "scheme", storage="oracle://alice:SECRETPW@h/db")
    done = _sweep("run", study)  # not --quiet: the load would say "loading the base model"
    assert _one_error(done) == ("error: storage: no storage takes 'oracle://alice:***@h/db' (expected journal://..., "
                                "sqlite://..., postgresql..., mysql..., mariadb... or a path ending in .log)")
    assert "loading the base model" not in done.stdout + done.stderr
    assert not (tmp_path / "runs-scheme" / "results.db").exists()


def test_a_second_study_directory_over_one_journal_storage_is_refused(tiny_dirs, tmp_path: Path) -> None:
    """Without workers, a run takes its study's RUNNING trials for its own killed run's: a run from a second
    directory would fail the first's (which then ended in ``UpdateFinishedTrialError``). It is refused, also
    while the first runs (the check is made under the storage lock: ``store.storage.check_directory``)."""
    journal = tmp_path / "shared.log"
    study = _study(tmp_path, tiny_dirs, "shared", storage=str(journal))
    first, second = tmp_path / "first", tmp_path / "second"
    running = subprocess.Popen(cli("run", str(study), "--out", str(first), "--quiet"), stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    while not (journal.is_file() and b"sweep:directory" in journal.read_bytes()):  # the first run holds the study
        assert running.poll() is None and time.monotonic() < deadline, running.communicate()
        time.sleep(0.05)
    refused = _sweep("run", study, "--out", second, "--quiet")
    _, stderr = running.communicate(timeout=600)
    assert running.returncode == 0 and "Traceback" not in stderr, stderr
    assert _one_error(refused) == (f"error: storage: study 'shared' in journal://{journal} is run from the study "
                                   f"directory {first}, not {second}: give --out {first} to resume it there, or run "
                                   "it with --workers (--join to add processes) to share it")
    assert [t.state.name for t in stored_trials(f"journal://{journal}", "shared")] == ["COMPLETE", "COMPLETE"]
    assert [t.state for t in _trials(first)] == ["COMPLETE", "COMPLETE"]
    again = _sweep("run", study, "--out", first, "--quiet")  # its own directory resumes it (nothing left to run)
    assert again.returncode == 0, again.stderr
