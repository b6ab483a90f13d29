"""The trackers under faults (sweep/trackers): a torn or malformed trackers.json, a deleted MLflow store, a run
refused the study directory or with nothing to do, the trackers' process killed, a tracking server that does not
answer, SIGTERM while the trackers' process starts. Each is at most one warning line, and no run is made twice."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from lora_sweep import api
from lora_sweep.store.api import ResultsStore, StudyDir
from lora_sweep.sweep.config.tracking import TrackerSpec
from lora_sweep.sweep.trackers import process
from lora_sweep.sweep.trackers.sync import Syncer
from tests.conftest import need_module, write_study
from tests.sweep.trackers.readers import Logged, mlflow_logged, tensorboard_logged, wandb_logged
from tests.sweep.trackers.servers import free_port, silent_port

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(autouse=True)
def _packages(monkeypatch: pytest.MonkeyPatch) -> None:
    for module in ("mlflow", "wandb", "tensorboard"):
        need_module(module, module)
    monkeypatch.setenv("WANDB_SILENT", "true")


def _study(tmp_path: Path, tiny_dirs, name: str, **changes) -> Path:
    """2 trials of 4 steps, one pack, no pruning: the quickest study that logs trials."""
    return write_study(tmp_path, tiny_dirs("llama"), name=name, **{
        "budget": {"trials": 2}, "train": {"max_steps": 4, "micro_batch": 4}, "pruning": {"kind": "none"},
        "pack": {"max_slots": 2}, **changes})


def _numbers(out: Path) -> list[int]:
    with ResultsStore(StudyDir(out).results_db, create=False) as store:
        return [t.number for t in store.trials()]


def _one_run_each(out: Path, logged: dict[str, Logged]) -> None:
    """Every tracker holds one study run and exactly one run per trial of results.db, each with its end."""
    numbers = _numbers(out)
    for name, got in logged.items():
        assert len(got.parents) == 1, (name, got.parents)
        assert sorted(got.children) == numbers, (name, sorted(got.children), numbers)
        for number, runs in got.children.items():
            assert len(runs) == 1 and runs[0].state == "COMPLETE", (name, number, runs)


def _warnings(lines: list[str]) -> list[str]:
    return [line for line in lines if "warning" in line]


def test_a_torn_or_malformed_trackers_json_is_one_warning_and_no_run_is_made_twice(tiny_dirs, tmp_path) -> None:
    path = _study(tmp_path, tiny_dirs, "torn")
    out, trackers = tmp_path / "runs-torn", "trackers=[mlflow, wandb, tensorboard]"
    lines: list[str] = []
    api.run(path, [trackers], log=lines.append)
    assert not _warnings(lines), lines
    state = out / "trackers.json"
    for trials, broken in ((3, state.read_text()[: len(state.read_text()) // 2]),  # torn mid-write
                           (4, json.dumps({"mlflow": {"trials": {"0": 5}}, "wandb": []}))):  # the wrong shape
        state.write_text(broken)
        lines.clear()
        api.run(path, [trackers, f"budget.trials={trials}"], log=lines.append)
        warnings = _warnings(lines)
        assert len(warnings) == 1 and str(state) in warnings[0], lines
        assert "Traceback" not in "\n".join(lines)
        _one_run_each(out, {"mlflow": mlflow_logged(out, "torn"), "wandb": wandb_logged(out),
                            "tensorboard": tensorboard_logged(out)})
        assert len(_numbers(out)) == trials
        json.loads(state.read_text())  # written whole again


def _parent(out: Path, name: str) -> tuple[str, int]:
    """The MLflow study run's (status, end time)."""
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{out / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name(name).experiment_id],
                                "tags.`lora_sweep.kind` = 'study'")
    return run.info.status, run.info.end_time


def test_nothing_to_do_and_refused_runs_touch_no_run_and_a_deleted_store_is_rebuilt(tiny_dirs, tmp_path) -> None:
    path = _study(tmp_path, tiny_dirs, "again", trackers=["mlflow"])
    out = tmp_path / "runs-again"
    api.run(path)
    (out / "mlflow.db").unlink()
    lines: list[str] = []
    summary = api.run(path, log=lines.append)  # nothing to train: the store is made again from results.db
    assert summary.already_spent and not _warnings(lines), lines
    _one_run_each(out, {"mlflow": mlflow_logged(out, "again")})
    finished = _parent(out, "again")
    assert finished[0] == "FINISHED"
    state = (out / "trackers.json").read_text()

    summary = api.run(path, log=lines.append)  # a finished study run again: nothing is touched
    assert summary.already_spent and _parent(out, "again") == finished
    assert (out / "trackers.json").read_text() == state

    lock = StudyDir(out).acquire()  # a live process holds the directory: `sweep run` is refused it
    try:
        refused = subprocess.run([sys.executable, "-m", "lora_sweep", "run", str(path), "--quiet",
                                  "budget.trials=3"], capture_output=True, text=True, timeout=600, cwd=ROOT)
    finally:
        lock.release()
    assert refused.returncode == 2 and "in use" in refused.stderr, refused.stderr
    assert _parent(out, "again") == finished and (out / "trackers.json").read_text() == state
    _one_run_each(out, {"mlflow": mlflow_logged(out, "again")})

    api.run(path, ["budget.trials=3"])  # the rebuilt store goes on
    _one_run_each(out, {"mlflow": mlflow_logged(out, "again")})
    assert _parent(out, "again")[0] == "FINISHED" and len(_numbers(out)) == 3


def test_a_killed_trackers_process_is_one_warning_and_started_again(tiny_dirs, tmp_path) -> None:
    path = _study(tmp_path, tiny_dirs, "dead", budget={"trials": 4}, pack={"max_slots": 1},
                  train={"max_steps": 40, "micro_batch": 4}, trackers=["mlflow", "tensorboard"])
    out = tmp_path / "runs-dead"
    started = process.ahead([("mlflow", {}), ("tensorboard", {})], interval=0.2)
    assert started is not None and started.process is not None
    first = started.process
    killed = threading.Event()

    def kill_once_logging() -> None:  # once each tracker has logged a trial's steps
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline and first.poll() is None:
            time.sleep(0.2)
            try:
                state = json.loads((out / "trackers.json").read_text())
            except (OSError, ValueError):
                continue
            if all(any(c["step"] >= 0 for c in state.get(t, {}).get("trials", {}).values())
                   for t in ("mlflow", "tensorboard")):
                first.kill()
                killed.set()
                return

    watcher = threading.Thread(target=kill_once_logging, daemon=True)
    watcher.start()
    lines: list[str] = []

    def log(line: str) -> None:
        lines.append(line)
        if " complete: " in line:  # the run waits at its first trial's end until the kill: the trackers' process
            killed.wait(timeout=120)  # runs under SCHED_IDLE, and on a loaded host it logs nothing while the run trains

    summary = api.run(path, log=log, trackers=started)
    watcher.join(timeout=5)
    assert killed.is_set() and summary.complete == 4, "the trackers' process was not killed while the run trained"
    warnings = _warnings(lines)
    assert len(warnings) == 1 and "trackers' process ended (killed by signal 9)" in warnings[0], lines
    assert any(line.startswith("trackers: ") for line in lines), lines  # the new process ended the runs
    _one_run_each(out, {"mlflow": mlflow_logged(out, "dead"), "tensorboard": tensorboard_logged(out)})
    assert _parent(out, "dead")[0] == "FINISHED"


def test_a_server_that_is_down_is_given_up_within_seconds(tiny_dirs, tmp_path, monkeypatch) -> None:
    """A port where nothing listens: one warning line (no password in it), given during the run or at most 10 s
    after its end, and the other trackers go on."""
    server = "refused"
    secret = "s3cr3t-pw"
    ended: list[float] = []  # when the run told the trackers its end (after the report written for them)
    finish = process.Tracking.finish

    def timed(self, finished, report=None):
        def write():
            try:
                return report()
            finally:
                ended.append(time.monotonic())

        if report is None:
            ended.append(time.monotonic())
        return finish(self, finished, report=write if report is not None else None)

    monkeypatch.setattr(process.Tracking, "finish", timed)
    said: list[tuple[float, str]] = []
    with silent_port() as port:
        uri = f"http://alice:{secret}@127.0.0.1:{port if server == 'silent' else free_port()}"
        path = _study(tmp_path, tiny_dirs, server, trackers=[{"name": "mlflow", "tracking_uri": uri}, "tensorboard"])
        summary = api.run(path, log=lambda line: said.append((time.monotonic(), line)))
    lines = [line for _, line in said]
    assert summary.complete == 2
    warnings = _warnings(lines)
    assert len(warnings) == 1 and "tracker mlflow stopped" in warnings[0], lines
    assert secret not in "\n".join(lines)
    assert sorted(tensorboard_logged(tmp_path / f"runs-{server}").children) == [0, 1]
    (given_up,) = [when for when, line in said if "tracker mlflow stopped" in line]
    assert ended and given_up - ended[0] <= 10.0, (given_up - ended[0], lines)


@pytest.mark.parametrize("server", ["refused", "silent"])
def test_at_the_run_s_end_a_server_that_does_not_answer_costs_at_most_10_s(tmp_path, server) -> None:
    """The trackers' last pass and end (``Syncer``, as the run's end drives it), a trial to log: a port where nothing
    listens, or a listener that never replies, costs one warning line and at most 10 s; TensorBoard logs the trial."""
    out = tmp_path / "study"
    out.mkdir()
    with ResultsStore(StudyDir(out).results_db) as store:
        store.set_meta(name="ended", spec={"name": "ended"})
        store.upsert_trial(0, state="COMPLETE", params={"rank": 4}, steps_done=2)
        store.add_steps(0, [{"step": 1, "loss": 1.0}, {"step": 2, "loss": 0.5}])
    lines: list[str] = []
    with silent_port() as port:
        uri = f"http://alice:s3cr3t@127.0.0.1:{port if server == 'silent' else free_port()}"
        syncer = Syncer(out, "ended", [TrackerSpec("mlflow", {"tracking_uri": uri}), TrackerSpec("tensorboard")],
                        lines.append)
        start = time.monotonic()
        syncer.ending()
        syncer.sync()
        syncer.end(True, None)
        took = time.monotonic() - start
    assert took <= 10.0, took
    assert len(lines) == 1 and "tracker mlflow stopped" in lines[0] and "s3cr3t" not in lines[0], lines
    assert tensorboard_logged(out).children[0][0].loss_steps == [1, 2]


def test_sigterm_while_the_trackers_process_starts_is_a_clean_exit(tiny_dirs, tmp_path) -> None:
    psutil = pytest.importorskip("psutil")
    path = _study(tmp_path, tiny_dirs, "early", trackers=["mlflow", "tensorboard"])
    run = subprocess.Popen([sys.executable, "-m", "lora_sweep", "run", str(path), "--quiet"], cwd=ROOT,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    children: set[int] = set()
    start = time.monotonic()
    while time.monotonic() - start < 0.5:
        time.sleep(0.02)
        children |= {c.pid for c in psutil.Process(run.pid).children(recursive=True)}
    os.kill(run.pid, signal.SIGTERM)
    said, err = run.communicate(timeout=120)
    assert run.returncode == 143, (run.returncode, said, err)
    assert "Traceback" not in said + err and "terminated (SIGTERM)" in err, err
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any(psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie"
                                              for pid in children):
        time.sleep(0.2)
    assert not [pid for pid in children if psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie"]
