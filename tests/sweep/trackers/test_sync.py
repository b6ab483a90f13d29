"""The tiny study with each tracker, read back through the tracker's own reader (MLflow's client on the study's
store, TensorBoard's EventAccumulator, the W&B offline run files): one parent, one child per trial, params equal to
results.db's, the loss curve as long as the steps trained, pruned trials marked, the default tagged; a killed and
resumed run keeps its run ids; a failing tracker costs one warning line, not the sweep."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lora_sweep import api
from lora_sweep.store.api import ResultsStore, StudyDir
from tests.conftest import need_module, write_study
from tests.sweep.trackers.readers import Logged, mlflow_logged, tensorboard_logged, wandb_logged

ROOT = Path(__file__).resolve().parents[3]
TRACKERS = {"mlflow": "mlflow", "wandb": "wandb", "tensorboard": "tensorboard"}


@pytest.fixture(autouse=True)
def _packages(monkeypatch: pytest.MonkeyPatch) -> None:
    for module, extra in TRACKERS.items():
        need_module(module, extra)
    monkeypatch.setenv("WANDB_SILENT", "true")


def _read(out: Path, name: str) -> dict[str, Logged]:
    return {"mlflow": mlflow_logged(out, name), "tensorboard": tensorboard_logged(out), "wandb": wandb_logged(out)}


def _check_against_results(out: Path, logged: dict[str, Logged]) -> None:
    """Every tracker holds one parent and, per trial of results.db, one child with its params, its steps and its
    end state; the community default is tagged."""
    with ResultsStore(StudyDir(out).results_db, create=False) as store:
        trials = store.trials()
        curves = store.curves()
    for name, got in logged.items():
        assert len(got.parents) == 1, (name, got.parents)
        assert sorted(got.children) == [t.number for t in trials], name
        for t in trials:
            (child,) = got.children[t.number]
            assert child.params == t.params, (name, t.number)
            assert child.loss_steps == [r.step for r in curves[t.number]], (name, t.number)
            assert child.state == t.state, (name, t.number)
            role = child.tags.get("lora_sweep.role", child.tags.get("role"))
            assert (role == "default") == t.is_default, (name, t.number)


def test_each_tracker_holds_the_study_as_results_db_does(tiny_dirs, tmp_path) -> None:
    path = write_study(tmp_path, tiny_dirs("llama"), name="tracked")
    lines: list[str] = []
    summary = api.run(path, ["trackers=[mlflow, wandb, tensorboard]"], log=lines.append)
    out = tmp_path / "runs-tracked"
    assert summary.pruned >= 1 and not [m for m in lines if "warning" in m], lines
    cost = [m for m in lines if m.startswith("trackers: ")]  # what they cost, said once at the end
    said = (r"trackers: [1-9]\d* passes; CPU \d+\.\d\d s in their process \(\d+\.\d\d s preparing, \d+\.\d\d s after "
            r"the run\), \d+\.\d\d s in its child processes")
    assert len(cost) == 1 and re.fullmatch(said, cost[0]), cost
    assert summary.report == out / "report.html" and summary.report.is_file()  # written once, for the trackers
    logged = _read(out, "tracked")
    _check_against_results(out, logged)
    pruned = [c for cs in logged["mlflow"].children.values() for c in cs if c.state == "PRUNED"]
    assert pruned and all(c.tags["lora_sweep.reason"].startswith("pruned by cohort SHA") for c in pruned)
    assert all("rung/eval_loss" in c.metrics and "device_seconds" in c.metrics for c in pruned)
    for c in pruned:  # stopped at a rung as the study asked: FINISHED, not a red KILLED; the state in name and note
        assert c.status == "FINISHED" and c.name.endswith("(pruned)"), (c.status, c.name)
        assert c.tags["mlflow.note.content"] == f"PRUNED: {c.tags['lora_sweep.reason']}"
    complete = [c for cs in logged["tensorboard"].children.values() for c in cs if c.state == "COMPLETE"]
    assert complete and all({"final/eval_loss", "final/exact_match", "device_seconds"} <= c.metrics for c in complete)
    for c in complete:  # the HParams tab: every param against the final metrics
        assert c.hparams.pop("metrics:") == {m for m in c.metrics if m.startswith("final/")} | {"device_seconds"}
        want = {k: v if isinstance(v, str | bool) else json.dumps(v) if isinstance(v, list | dict) else float(v)
                for k, v in c.params.items()}
        assert c.hparams == want, c.hparams
    assert {"report.html", "pareto.csv"} <= logged["mlflow"].parent_files
    assert {"spec", "pareto"} <= logged["tensorboard"].parent_files
    front = api.open_results(out).best_trials()
    assert front
    pareto = (out / "mlruns").rglob("pareto.csv")
    assert {int(line.split(",")[0]) for line in next(pareto).read_text().splitlines()[1:]} == {t.number for t in front}


def _states(out: Path) -> dict[str, str]:
    """Trial number (as the trackers' state file writes it) -> its state in results.db."""
    try:
        with ResultsStore(StudyDir(out).results_db, create=False) as store:
            return {str(t.number): t.state or "" for t in store.trials()}
    except Exception:  # noqa: BLE001  (not created yet, or caught mid-write)
        return {}


def _ended_and_training(out: Path, state_file: Path) -> tuple[set[str], dict] | None:
    """(the store's RUNNING trials, trackers.json) when each tracker has ended a trial and logged steps of one that is
    still training (a tracker lags the store: a cursor not ended may belong to a trial that completed since); None
    before that, or when a file is caught mid-write."""
    running = {n for n, state in _states(out).items() if state == "RUNNING"}
    if not running or not state_file.is_file():
        return None
    try:
        ids = json.loads(state_file.read_text())
    except (OSError, ValueError):
        return None
    cursors = [ids.get(t, {}).get("trials", {}) for t in TRACKERS]
    if all(any(c["ended"] for c in cs.values())
           and any(not c["ended"] and c["step"] > 0 and n in running for n, c in cs.items()) for cs in cursors):
        return running, ids
    return None


def test_a_killed_and_resumed_run_continues_the_same_runs(tiny_dirs, tmp_path) -> None:
    # 1 slot for 6 trials: six waves of training, so the kill can land after the trackers logged an ended trial
    # and while the next wave trains, however far behind the trackers' thread runs on a busy machine; a wave of 400
    # steps (about 10 s here) gives the trackers' process time to log its steps, and the rerun trains what is left
    path = write_study(tmp_path, tiny_dirs("llama"), name="killed", budget={"trials": 6},
                       train={"max_steps": 400, "micro_batch": 4}, pruning={"kind": "none"}, pack={"max_slots": 1})
    out = tmp_path / "runs-killed"
    cmd = [sys.executable, "-m", "lora_sweep", "run", str(path), "--quiet", "trackers=[mlflow, wandb, tensorboard]"]
    # as from a user's shell: not through the W&B service this test process started for the tests before it (wandb
    # exports WANDB_SERVICE to children; a killed child's runs would stay open in that service, their ids in use)
    env = {k: v for k, v in os.environ.items() if k != "WANDB_SERVICE"}
    # The run at the lowest nice: its trackers' process runs under SCHED_IDLE, which a busy host (another test's
    # process on each CPU) starves to the end of the run, before any trial ended in the trackers; below a nice-19 run
    # it still gets about a sixth of a CPU, and the kill can land while the trackers hold an ended trial.
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True, env=env, preexec_fn=lambda: os.nice(19))
    state_file = out / "trackers.json"
    held = None
    deadline = time.time() + 900  # a bound for a hung run only: the wait below is on the condition, however slow
    while held is None and proc.poll() is None and time.time() < deadline:
        time.sleep(0.3)
        if _ended_and_training(out, state_file) is None:
            continue
        # Freeze the run and its trackers' process (one process group) and look again: nothing moves between this
        # look and the kill, so the kill lands exactly where the look says (no trial ending, no cursor written, in
        # between, however busy the host). Not held any more: let it go on and wait for the next chance.
        os.killpg(proc.pid, signal.SIGSTOP)
        held = _ended_and_training(out, state_file)
        if held is None:
            os.killpg(proc.pid, signal.SIGCONT)
    assert held is not None, "the first run ended (or hung) before the trackers held an ended and a training trial"
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    killed, before = held
    assert killed, "the kill must land with trials still training"
    assert json.loads(state_file.read_text()) == before, "a stopped run wrote nothing before its kill"

    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1800, env=env)  # a hang's bound
    assert done.returncode == 0, done.stderr
    assert "warning" not in done.stdout + done.stderr
    after = json.loads(state_file.read_text())
    for tracker in TRACKERS:  # the same parent, and the same child run for every trial the killed run had opened
        assert after[tracker]["parent"] == before[tracker]["parent"], tracker
        for number, cursor in before[tracker]["trials"].items():
            assert after[tracker]["trials"][number]["run"] == cursor["run"], (tracker, number)
    logged = _read(out, "killed")
    _check_against_results(out, logged)  # one child per trial (no duplicate), every stored step once (none lost)
    assert logged["mlflow"].parents == [before["mlflow"]["parent"]]
    reopened = [n for n, c in before["mlflow"]["trials"].items() if not c["ended"] and n in killed]
    assert reopened and all(logged["mlflow"].children[int(n)][0].state == "FAIL" for n in reopened)


def test_ctrl_c_ends_the_run_and_then_its_trackers(tiny_dirs, tmp_path) -> None:
    """Ctrl-C reaches the terminal's whole process group, the trackers' process too: it leaves the stop to the run,
    which ends its trials and then tells the trackers, who close their runs and say their cost; no traceback."""
    path = write_study(tmp_path, tiny_dirs("llama"), name="stopped", budget={"trials": 4},
                       train={"max_steps": 800, "micro_batch": 4}, pruning={"kind": "none"}, pack={"max_slots": 1})
    out = tmp_path / "runs-stopped"
    cmd = [sys.executable, "-m", "lora_sweep", "run", str(path), "--quiet", "trackers=[mlflow, tensorboard]"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:  # once a trial trains and the trackers have logged it
        time.sleep(0.3)
        if "RUNNING" in _states(out).values() and (out / "trackers.json").is_file():
            break
    assert proc.poll() is None, "the run ended before a trial trained"
    os.killpg(proc.pid, signal.SIGINT)
    said, _ = proc.communicate(timeout=300)
    assert "Traceback" not in said, said
    assert re.search(r"trackers: [1-9]\d* passes; CPU", said), said
    ids = json.loads((out / "trackers.json").read_text())
    assert all(ids[t]["trials"] for t in ("mlflow", "tensorboard")), ids


def test_a_failing_tracker_is_one_warning_and_the_sweep_goes_on(tiny_dirs, tmp_path) -> None:
    path = write_study(tmp_path, tiny_dirs("llama"), name="broken", budget={"trials": 3},
                       train={"max_steps": 6, "micro_batch": 4}, pruning={"kind": "none"})
    lines: list[str] = []
    (tmp_path / "a-file").write_text("")
    unwritable = f"sqlite:///{tmp_path / 'a-file' / 'mlflow.db'}"  # its folder is a file: as a full disk, it fails
    summary = api.run(path, [f"trackers=[{{name: mlflow, tracking_uri: '{unwritable}'}}, tensorboard]"],
                      log=lines.append)
    assert summary.complete == 3
    warnings = [m for m in lines if "warning" in m]
    assert len(warnings) == 1 and "tracker mlflow stopped" in warnings[0], lines
    logged = tensorboard_logged(tmp_path / "runs-broken")
    assert sorted(logged.children) == [0, 1, 2]


def test_a_new_mlflow_store_is_a_copy_of_the_cached_empty_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``seed_store``: the first study makes the cache's empty store once (MLflow's migrations), every study's store is
    its own copy of it, which MLflow opens as current and writes to, holding its own paths only (the Default
    experiment's artifacts in its own folder, not in the one the cache was made from)."""
    from mlflow import MlflowClient

    from lora_sweep.sweep.trackers._mlflow import seed_store

    monkeypatch.setenv("LORA_SWEEP_CACHE", str(tmp_path / "cache"))
    first, second = tmp_path / "a" / "mlflow.db", tmp_path / "b" / "mlflow.db"
    first.parent.mkdir()
    second.parent.mkdir()
    seed_store(first)
    (template,) = (tmp_path / "cache" / "mlflow").iterdir()
    made = template.stat().st_mtime_ns
    seed_store(second)
    assert template.stat().st_mtime_ns == made
    for store, other in ((first, second), (second, first)):
        default = MlflowClient(tracking_uri=f"sqlite:///{store}").get_experiment("0")
        assert Path(default.artifact_location) == store.parent.resolve() / "mlruns" / "0"
        assert str(other.parent).encode() not in store.read_bytes() and str(tmp_path).encode() in store.read_bytes()
        assert str(Path.cwd()).encode() not in store.read_bytes()  # where the cache's own store was made
    client = MlflowClient(tracking_uri=f"sqlite:///{first}")
    run = client.create_run(client.create_experiment("x"))
    client.log_metric(run.info.run_id, "loss", 1.5, step=3)
    assert [m.step for m in client.get_metric_history(run.info.run_id, "loss")] == [3]
    assert not MlflowClient(tracking_uri=f"sqlite:///{second}").get_experiment_by_name("x")  # its own file
    seed_store(first)  # a store that exists is left as it is
    assert MlflowClient(tracking_uri=f"sqlite:///{first}").get_experiment_by_name("x")
    assert sorted(p.name for p in first.parent.iterdir()) == ["mlflow.db"]  # no file left aside


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="Linux's SCHED_IDLE")
def test_the_trackers_process_runs_on_idle_cycles(tmp_path: Path) -> None:
    """The trackers' process (and what it starts) runs under ``SCHED_IDLE``: only on cycles training leaves idle."""
    config = {"prepare": [], "interval": 0.2}
    proc = subprocess.Popen([sys.executable, "-m", "lora_sweep.sweep.trackers.sync", json.dumps(config)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        deadline, policy = time.monotonic() + 60, None
        while policy != os.SCHED_IDLE and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
            policy = os.sched_getscheduler(proc.pid)
        assert policy == os.SCHED_IDLE, policy
    finally:
        assert proc.stdin is not None
        proc.stdin.close()  # EOF: the process ends where it is
        proc.wait(timeout=30)
