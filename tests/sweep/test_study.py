"""`sweep run` end to end on CPU: a small study, resume after SIGKILL, determinism, backfill, CLI errors."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import optuna
import pytest
import torch
import yaml
from optuna.trial import TrialState

from lora_sweep.store.api import StudyDir
from lora_sweep.store.storage import open_storage
from lora_sweep.sweep.config.loader import load_study
from lora_sweep.sweep.study import run_study
from tests.conftest import optuna_study, write_study

ROOT = Path(__file__).resolve().parents[2]


def _trials(out: Path, name: str) -> list[optuna.trial.FrozenTrial]:
    return optuna_study(out, name).get_trials()


def _spans(out: Path) -> list[tuple]:
    with sqlite3.connect(out / "results.db") as db:
        return db.execute("select slot, trial, start_step, end_step, end_reason from slot_spans").fetchall()


def test_six_trial_study_end_to_end(tiny_dirs, tmp_path) -> None:
    spec = load_study(write_study(tmp_path, tiny_dirs("llama")))
    summary = run_study(spec, log=lambda m: None)
    trials = _trials(spec.out_dir, "small")
    states = [t.state for t in trials]
    assert len(trials) == 6 and TrialState.RUNNING not in states and TrialState.FAIL not in states
    assert summary.complete + summary.pruned == 6 and summary.pruned >= 1  # cohort SHA acted
    assert trials[0].user_attrs.get("default") is True and trials[0].params["rank"] == 16  # community default first
    for t in trials:
        adapter = spec.out_dir / "adapters" / f"trial-{t.number}"
        assert adapter.is_dir() == (t.state == TrialState.COMPLETE)
        if t.state == TrialState.COMPLETE:
            assert len(t.values) == 2 and (adapter / "adapter_model.safetensors").is_file()
    with sqlite3.connect(spec.out_dir / "results.db") as db:
        assert db.execute("select count(distinct trial) from steps").fetchone()[0] == 6
        assert db.execute("select count(*) from prune_decisions").fetchone()[0] == 6  # every trial met rung 6
        metrics = db.execute("select metrics from trials where state='COMPLETE'").fetchall()
    assert all('"exact_match"' in m[0] and '"device_seconds"' in m[0] for m in metrics)


def test_backfill_keeps_pack_full(tiny_dirs, tmp_path) -> None:
    spec = load_study(write_study(tmp_path, tiny_dirs("llama"), name="backfill", budget={"trials": 7}))
    run_study(spec, log=lambda m: None)
    spans = _spans(spec.out_dir)
    last_start = max(s[2] for s in spans)  # from the last trial's start on the budget is spent: slots may empty
    for step in range(last_start):
        busy = {s[0] for s in spans if s[2] <= step < s[3]}
        assert busy == {0, 1, 2}, f"step {step}: slots {busy} busy"
    assert any(s[2] > 0 for s in spans), "some trial must have been started mid-run in a freed slot"


def test_same_study_twice_decides_the_same(tiny_dirs, tmp_path) -> None:
    runs = []
    for name in ("twin-a", "twin-b"):
        spec = load_study(write_study(tmp_path, tiny_dirs("llama"), name=name))
        run_study(spec, log=lambda m: None)
        with sqlite3.connect(spec.out_dir / "results.db") as db:
            decisions = db.execute("select rung_step, trial, decision, value from prune_decisions order by trial")
            runs.append((decisions.fetchall(), [(t.params, t.state) for t in _trials(spec.out_dir, name)]))
    assert runs[0] == runs[1]


def _run_cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lora_sweep", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)


def test_resume_after_sigkill_loses_and_duplicates_nothing(tiny_dirs, tmp_path) -> None:
    path = write_study(tmp_path, tiny_dirs("llama"), name="killed", budget={"trials": 8},
                       train={"max_steps": 30, "micro_batch": 4}, pruning={"kind": "none"})
    out = tmp_path / "runs-killed"
    proc = subprocess.Popen([sys.executable, "-m", "lora_sweep", "run", str(path), "--quiet"], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.time() + 240
    while time.time() < deadline and proc.poll() is None:  # kill mid-pack: some trial complete, others still training
        time.sleep(0.2)
        try:
            states = [t.state for t in _trials(out, "killed")]
        except Exception:
            continue
        # between one pack's trials completing and the next ones being asked, none is running: wait that out
        if states.count(TrialState.COMPLETE) >= 3 and TrialState.RUNNING in states:
            break
    with contextlib.suppress(ProcessLookupError):  # ended on its own: the assertion below says so
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    before = _trials(out, "killed")
    running = [t for t in before if t.state == TrialState.RUNNING]
    assert running, "the kill must land mid-pack, with trials still training"
    completed_before = {t.number: t.params for t in before if t.state == TrialState.COMPLETE}
    # what a kill between saving an adapter and telling its trial leaves, or one in the middle of the write
    left = [out / "adapters" / f"trial-{running[0].number}", out / "adapters" / f".trial-{running[0].number}.x1"]
    for d in left:
        d.mkdir(parents=True, exist_ok=True)
        (d / "adapter_config.json").write_text("{}")

    result = _run_cli("run", str(path), "--quiet")
    assert result.returncode == 0, result.stderr
    after = _trials(out, "killed")
    complete = [t for t in after if t.state == TrialState.COMPLETE]
    failed = [t for t in after if t.state == TrialState.FAIL]
    assert len(complete) == 8, "exactly the budgeted number of trials"
    assert {t.number for t in failed} == {t.number for t in running}, "only the orphans failed"
    retried = [t for t in after if "retry_of" in t.user_attrs]
    assert sorted(t.user_attrs["retry_of"] for t in retried) == sorted(t.number for t in running)
    for t in retried:  # the parameters the orphan had drawn, the same; any it had not yet drawn, fresh ones
        orphan = next(o for o in running if o.number == t.user_attrs["retry_of"])  # (a kill can land between two)
        assert orphan.params.items() <= t.params.items() and set(t.params) == {"rank", "lr", "targets"}
    for number, params in completed_before.items():  # completed work was kept, not redone
        assert next(t for t in after if t.number == number).params == params
    assert all((out / "adapters" / f"trial-{t.number}" / "adapter_config.json").is_file() for t in complete)
    assert not any(d.exists() for d in left), "a failed trial's leftover adapter is removed"
    with sqlite3.connect(out / "results.db") as db:
        states = dict(db.execute("select number, state from trials").fetchall())
    assert states == {t.number: t.state.name for t in after}


BAD = {
    "unknown key": ({"search": {"rank": [4], "learnig_rate": [1e-3]}}, "did you mean 'learning_rate'"),
    "wrong type": ({"train": {"max_steps": "many"}}, "train.max_steps"),
    "negative rank": ({"search": {"rank": {"low": -4, "high": 8}}}, "search.rank.low"),
    "empty search space": ({"search": {}}, "search"),
    "missing data file": ({"data": {"train": "nope.jsonl"}}, "nope.jsonl"),
    "unknown model path": ({"model": {"path": "./no/such/model"}}, "no/such/model"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_study_file_exits_2_with_one_line(tiny_dirs, tmp_path, case: str) -> None:
    changes, expected = BAD[case]
    path = write_study(tmp_path, tiny_dirs("llama"), name="bad")
    doc = yaml.safe_load(path.read_text())
    for key, value in changes.items():
        doc[key] = {**doc[key], **value} if key != "search" or value else value
    path.write_text(yaml.safe_dump(doc))
    result = _run_cli("run", str(path), "--quiet", timeout=120)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert expected in lines[0], lines[0]


def test_plan_and_status_commands(tiny_dirs, tmp_path) -> None:
    from click.testing import CliRunner

    from lora_sweep.cli import cli

    path = write_study(tmp_path, tiny_dirs("llama"), name="planned", budget={"trials": 3})
    runner = CliRunner()
    planned = runner.invoke(cli, ["plan", str(path)])
    assert planned.exit_code == 0, planned.output
    assert "slots per pack" in planned.output and "predicted peak of a full pack" in planned.output
    assert not (tmp_path / "runs-planned").exists(), "plan must not train or create the study"
    ran = runner.invoke(cli, ["run", str(path), "--quiet"])
    assert ran.exit_code == 0, ran.output
    status = runner.invoke(cli, ["status", str(tmp_path / "runs-planned"), "--json"])
    info = json.loads(status.output)
    assert info["study"] == "planned" and sum(info["counts"].values()) == 3
    assert info["best"] and set(info["best"][0]["params"]) == {"rank", "lr", "targets"}
    assert info["packs"][0]["status"] == "finished" and info["packs"][0]["slots"] == 3
    vs = info["vs_default"]  # trial 0 is the enqueued community default; the best by eval_loss against it
    assert vs["default"] == 0 and vs["best"] == info["best"][0]["number"] != 0, vs
    assert {r["metric"] for r in vs["rows"]} == {"eval_loss", "exact_match"}, vs
    for r in vs["rows"]:
        assert r["items"] == 200 and r["low"] <= r["diff"] <= r["high"]
        assert r["diff"] == pytest.approx(r["best"] - r["default"])
        assert r["excludes_zero"] == (r["low"] > 0 or r["high"] < 0)
    front = info["pareto"]  # eval_loss and adapter_params, both minimized: no listed trial beats another on both
    assert front and {p["number"] for p in front} <= {n for n in range(3)}
    vals = [tuple(p["values"].values()) for p in front]
    assert not any(a != b and all(x <= y for x, y in zip(a, b, strict=True)) for a in vals for b in vals), front
    shown = runner.invoke(cli, ["status", str(tmp_path / "runs-planned")])
    assert shown.exit_code == 0 and "vs default #0" in shown.output, shown.output
    assert f"Pareto front over eval_loss (min), adapter_params (min): {len(front)} trials" in shown.output


def test_memory_options_reach_the_training_loop(tiny_dirs, tmp_path) -> None:
    pack = {"max_slots": 2, "chunked_ce": 16, "activation_checkpointing": True}
    spec = load_study(write_study(tmp_path, tiny_dirs("llama"), name="memory", pack=pack,
                                  budget={"trials": 2}, train={"max_steps": 8, "micro_batch": 2}))
    assert (spec.pack.chunked_ce, spec.pack.activation_checkpointing) == (16, True)
    plain = load_study(write_study(tmp_path, tiny_dirs("llama"), name="plain", pack={"max_slots": 2},
                                   budget={"trials": 2}, train={"max_steps": 8, "micro_batch": 2}))
    for s in (spec, plain):
        run_study(s, log=lambda m: None)
    curves = []
    for s in (spec, plain):
        with sqlite3.connect(s.out_dir / "results.db") as db:
            curves.append(db.execute("select trial, step, loss from steps order by trial, step").fetchall())
    assert len(curves[0]) == 16
    for (t1, s1, l1), (t2, s2, l2) in zip(*curves, strict=True):  # same math, less memory
        assert (t1, s1) == (t2, s2) and abs(l1 - l2) <= 1e-5 * abs(l2)


def test_kernels_options_reach_the_packed_model(tiny_dirs, tmp_path, monkeypatch) -> None:
    import lora_sweep.packer.model.packed as packed
    from lora_sweep.packer.model.packed import PackedModel

    made: list[tuple[str, bool]] = []

    def recording(model, *, impl="auto", fused_base_ops=True):  # type: ignore[no-untyped-def]
        made.append((impl, fused_base_ops))
        return PackedModel(model, impl=impl, fused_base_ops=fused_base_ops)

    monkeypatch.setattr(packed, "PackedModel", recording)  # what open_base builds the pack with, when it runs
    common = dict(budget={"trials": 1}, train={"max_steps": 8, "micro_batch": 2})
    default = load_study(write_study(tmp_path, tiny_dirs("llama"), name="default-kernels", **common))
    chosen = load_study(write_study(tmp_path, tiny_dirs("llama"), name="torch-kernels",
                                    pack={"max_slots": 1, "kernels": "torch", "fused_base_ops": False}, **common))
    assert default.pack.kernels == "auto"  # Triton on a GPU: the sweep must not default to the slow path
    assert default.pack.fused_base_ops is True
    for s in (default, chosen):
        run_study(s, log=lambda m: None)
    assert made == [("auto", True), ("torch", False)]


@pytest.mark.parametrize("command", ["run", "plan"])
def test_cuda_device_without_cuda_exits_2_with_one_line(tiny_dirs, tmp_path, command: str) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is visible")
    path = write_study(tmp_path, tiny_dirs("llama"), name="nocuda")
    doc = yaml.safe_load(path.read_text())
    doc["model"]["device"] = "cuda"
    path.write_text(yaml.safe_dump(doc))
    result = _run_cli(command, str(path), *(["--quiet"] if command == "run" else []), timeout=120)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert "model.device" in lines[0] and "cuda" in lines[0], lines[0]
    assert not (tmp_path / "runs-nocuda").exists(), "nothing is created before the device is known to exist"


@pytest.mark.parametrize("budget", [8, 11])
def test_grid_with_the_default_runs_each_point_once_and_ends_when_exhausted(tiny_dirs, tmp_path, budget) -> None:
    """8 grid points, the community default among them: budget 8 runs the grid, budget 11 stops at its end."""
    search = {"rank": [4, 16], "lr": [1e-3, 2e-4], "targets": {"attn": ["q_proj", "v_proj"], "all": "all-linear"}}
    spec = load_study(write_study(tmp_path, tiny_dirs("llama"), name=f"grid{budget}", search=search,
                                  sampler={"name": "grid"}, budget={"trials": budget},
                                  train={"max_steps": 8, "micro_batch": 2}, pruning={"kind": "none"}))
    summary = run_study(spec, log=lambda m: None)
    trials = _trials(spec.out_dir, spec.name)
    points = [(t.params["rank"], t.params["lr"], t.params["targets"]) for t in trials]
    assert len(trials) == 8 and len(set(points)) == 8, points
    assert all(t.state == TrialState.COMPLETE for t in trials) and summary.complete == 8
    defaults = [t for t in trials if t.user_attrs.get("default")]
    assert [(t.number, t.params["rank"], t.params["lr"]) for t in defaults] == [(0, 16, 2e-4)]
    again = run_study(spec, log=lambda m: None)  # a finished grid stays finished
    assert (again.complete, again.failed, len(_trials(spec.out_dir, spec.name))) == (0, 0, 8)


def test_the_default_is_never_recorded_as_pruned(tiny_dirs, tmp_path) -> None:
    """Cohort SHA ranks the community default but never stops it: its decision must say so, not 'prune'."""
    spec = load_study(write_study(tmp_path, tiny_dirs("llama"), name="spared", budget={"trials": 3},
                                  train={"max_steps": 8, "micro_batch": 2}, pruning={"kind": "cohort_sha",
                                  "rungs": [4], "reduction_factor": 3}))
    run_study(spec, log=lambda m: None)
    trials = {t.number: t for t in _trials(spec.out_dir, spec.name)}
    with sqlite3.connect(spec.out_dir / "results.db") as db:
        rows = db.execute("select trial, decision, rank, cohort_size, reason from prune_decisions").fetchall()
    assert len(rows) == 3
    for number, decision, _, _, _ in rows:  # every recorded prune is a trial that was stopped
        assert (decision == "prune") == (trials[number].state == TrialState.PRUNED), rows
    default = next(r for r in rows if trials[r[0]].user_attrs.get("default"))
    assert default[2] > 1, f"the default must rank below the cut for this test to mean anything: {rows}"
    assert default[1] == "keep" and "default" in default[4] and trials[default[0]].state == TrialState.COMPLETE


def test_second_run_on_a_directory_in_use_exits_2_and_the_first_finishes(tiny_dirs, tmp_path) -> None:
    """One owner per study directory: the second `sweep run` leaves the first's running trials alone."""
    import socket

    path = write_study(tmp_path, tiny_dirs("llama"), name="owned", budget={"trials": 6},
                       train={"max_steps": 30, "micro_batch": 4}, pruning={"kind": "none"})
    out = tmp_path / "runs-owned"
    first = subprocess.Popen([sys.executable, "-m", "lora_sweep", "run", str(path), "--quiet"], cwd=ROOT,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 240
    while time.time() < deadline:  # the second starts while the first has trials training
        time.sleep(0.2)
        try:
            if TrialState.RUNNING in [t.state for t in _trials(out, "owned")]:
                break
        except Exception:
            continue
    # held still while the second runs: on a fast CPU the first can finish its trials before a second process
    # has imported; stopped, it still owns the directory (alive, its lock held) and has trials running
    first.send_signal(signal.SIGSTOP)
    try:
        second = _run_cli("run", str(path), "--quiet", timeout=120)
    finally:
        first.send_signal(signal.SIGCONT)
    _, err = first.communicate(timeout=300)
    assert second.returncode == 2, second.stderr
    lines = second.stderr.strip().splitlines()
    assert len(lines) == 1 and f"pid {first.pid} on host {socket.gethostname()}" in lines[0], lines
    assert first.returncode == 0, err
    trials = _trials(out, "owned")
    assert len(trials) == 6 and all(t.state == TrialState.COMPLETE for t in trials), [t.state for t in trials]


def test_a_dead_runs_lock_is_taken_over(tmp_path) -> None:
    from lora_sweep.store.api import DirectoryInUse

    sdir = StudyDir(tmp_path / "study")
    dead = subprocess.run([sys.executable, "-c", "import sys; from lora_sweep.store.api import StudyDir; "
                           "StudyDir(sys.argv[1]).acquire(); import os; os._exit(9)", str(sdir.root)],
                          cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert dead.returncode == 9 and json.loads(sdir.lock.read_text())["pid"] > 0  # killed holding it
    lock = sdir.acquire()
    assert lock.taken_over is not None and lock.taken_over["pid"] != os.getpid()
    assert json.loads(sdir.lock.read_text())["pid"] == os.getpid()
    with pytest.raises(DirectoryInUse, match=f"in use by pid {os.getpid()}"):
        sdir.acquire()  # a second open file description: flock excludes it even within one process
    lock.release()
    sdir.acquire().release()
    assert sdir.lock.read_text() == "", "a clean release names no owner"


def test_a_directory_an_earlier_version_started_on_sqlite_resumes_from_it(tiny_dirs, tmp_path) -> None:
    path = write_study(tmp_path, tiny_dirs("llama"), name="older", budget={"trials": 2}, pruning={"kind": "none"},
                       train={"max_steps": 4, "micro_batch": 2}, evaluators=[{"name": "heldout_loss"}])
    out = tmp_path / "runs-older"
    sqlite = f"sqlite:///{(out / 'optuna.db').resolve()}"  # the default storage of versions before the journal
    run_study(load_study(str(path), [f"storage={sqlite}"]), log=lambda m: None)
    first = {t.number: t.params for t in optuna.load_study(study_name="older", storage=sqlite).trials}
    run_study(load_study(str(path), ["budget.trials=4"]), log=lambda m: None)  # no storage: the directory's own
    assert not (out / "optuna.log").exists()
    trials = optuna.load_study(study_name="older", storage=sqlite).trials
    assert len(first) == 2 and len(trials) == 4 and all(t.state == TrialState.COMPLETE for t in trials)
    assert {t.number: t.params for t in trials if t.number in first} == first


def test_overrides_are_recorded_and_a_changed_fixed_key_is_refused_on_resume(tiny_dirs, tmp_path) -> None:
    from lora_sweep.errors import UserError
    from lora_sweep.store.api import ResultsStore

    path = write_study(tmp_path, tiny_dirs("llama"), name="recorded", budget={"trials": 1},
                       train={"max_steps": 12, "micro_batch": 2}, pruning={"kind": "none"}, pack={"max_slots": 1})
    run_study(load_study(path, ["train.max_steps=6"]), log=lambda m: None)
    out = tmp_path / "runs-recorded"
    recorded = yaml.safe_load((out / "study.yaml").read_text())
    assert recorded["train"]["max_steps"] == 6, "the directory keeps the spec the run used, overrides applied"
    with ResultsStore(out / "results.db", create=False) as store:
        assert store.meta()["spec"]["train"]["max_steps"] == 6
    with pytest.raises(UserError, match=r"train\.max_steps changed .*6 -> 12.*--allow-changes"):
        run_study(load_study(path, ["budget.trials=2"]), log=lambda m: None)  # the override forgotten
    assert len(_trials(out, "recorded")) == 1, "a refused resume changes nothing"
    run_study(load_study(path, ["train.max_steps=6", "budget.trials=2"]), log=lambda m: None)  # budget may grow
    run_study(load_study(path, ["budget.trials=3"]), log=lambda m: None, allow_changes=True)
    steps = sorted(t.user_attrs.get("planned_tokens", 0) > 0 for t in _trials(out, "recorded"))
    assert len(steps) == 3
    with ResultsStore(out / "results.db", create=False) as store:
        assert store.meta()["spec"]["train"]["max_steps"] == 12, "an allowed change is recorded"


def test_plan_rejects_targets_the_model_lacks_as_run_does(tiny_dirs, tmp_path) -> None:
    path = write_study(tmp_path, tiny_dirs("gpt2"), name="gpt2-qproj")  # targets attn: [q_proj, v_proj]
    for command in (["plan", str(path)], ["run", str(path), "--quiet"]):
        result = _run_cli(*command, timeout=120)
        assert result.returncode == 2, result.stderr
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and "search.targets.attn" in lines[0] and "'q_proj'" in lines[0], lines
        assert "c_attn" in lines[0], "the message lists the projections the model has"
    assert not (tmp_path / "runs-gpt2-qproj" / "results.db").exists(), "no study is created"


def test_plan_reports_the_spread_of_its_time_measurements(tiny_dirs, tmp_path) -> None:
    """``--calibrations 3`` measures three calibrations: the plan predicts with the sized pack's timed step (each
    calibration's line carried through it), and where no pack is timed with the median calibration and their range.
    A second plan reads all of it from the cache."""
    from click.testing import CliRunner

    from lora_sweep.cli import cli
    from lora_sweep.sweep.planning import cached_calibration, plan_report

    path = write_study(tmp_path, tiny_dirs("llama"), name="spread", budget={"trials": 3})
    result = CliRunner().invoke(cli, ["plan", str(path), "--calibrations", "3"])
    assert result.exit_code == 0, result.output
    line = next(x for x in result.output.splitlines() if x.startswith("predicted step"))
    assert "the timed" in line, line
    again = CliRunner().invoke(cli, ["plan", str(path), "--calibrations", "3"])  # the three, from the cache
    assert next(x for x in again.output.splitlines() if x.startswith("predicted step")) == line
    assert any(x.split()[:2] == ["calibration", "cached"] for x in again.output.splitlines()), again.output
    spec = load_study(path)
    models, where, base = cached_calibration(spec, "cpu", 3)
    assert len(models) == 3
    untimed = plan_report(spec, models, where, base, "cpu").table()  # no pack timed: the calibrations' own lines
    line = next(x for x in untimed.splitlines() if x.startswith("predicted step"))
    assert "median of 3 calibrations" in line and "range" in line and "spread" in line, line


def test_progress_final_frame_tokens_per_s_and_eta(tiny_dirs, tmp_path) -> None:
    from lora_sweep.store.api import ResultsStore

    frames = []
    spec = load_study(write_study(tmp_path, tiny_dirs("llama"), name="frames", budget={"trials": 4},
                                  train={"max_steps": 8, "micro_batch": 2}, pruning={"kind": "none"},
                                  pack={"max_slots": 2}))
    run_study(spec, progress=frames.append, log=lambda m: None)
    last = frames[-1]
    assert last.finished == 4, "the last frame shows every trial done, not the count before the last ones ended"
    assert last.eta_s == 0.0 and any(f.eta_s is not None and f.eta_s > 0 for f in frames)
    with ResultsStore(spec.out_dir / "results.db", create=False) as store:
        pack = store.packs()[0]
    # one definition: training tokens per wall second of the pack (evaluation included), as in the packs table
    assert abs(last.tokens_per_s - pack.tokens_per_s) <= 0.1 * pack.tokens_per_s, (last.tokens_per_s, pack)


def _rows(db: Path) -> dict[str, list[tuple]]:
    """Every row of every table of a results.db (sorted: a meta key written again with its value moves)."""
    with sqlite3.connect(db) as con:
        tables = [t for (t,) in con.execute("SELECT name FROM sqlite_master WHERE type = 'table' ORDER BY name")]
        return {t: sorted(con.execute(f"SELECT * FROM {t}").fetchall(), key=repr) for t in tables}


def test_rerunning_a_finished_study_writes_nothing_and_says_its_budget_is_spent(tiny_dirs, tmp_path) -> None:
    import lora_sweep

    path = write_study(tmp_path, tiny_dirs("llama"), name="spent", budget={"trials": 2},
                       train={"max_steps": 4, "micro_batch": 2}, pruning={"kind": "none"}, pack={"max_slots": 2})
    assert _run_cli("run", str(path), "--quiet").returncode == 0
    sdir = StudyDir(tmp_path / "runs-spent")
    before = _rows(sdir.results_db)
    assert len(before["packs"]) == 1 and len(before["trials"]) == 2
    timing, report = (sdir.root / "timing.json").read_bytes(), (sdir.root / "report.html").stat().st_mtime_ns
    again = _run_cli("run", str(path), "--quiet")
    assert again.returncode == 0, again.stderr
    said = again.stderr + again.stdout  # the run's log, then the command's own line
    assert "nothing to run: the budget was already spent (2 trials)" in said, said
    assert f"sweep run {path} budget.trials=<more>" in again.stdout, said
    assert "pack 2" not in said and "0 complete" not in said, said
    lines: list[str] = []
    summary = lora_sweep.run(path, log=lines.append)
    assert summary.already_spent and not summary.over and summary.steps == 0 and summary.complete == 0
    assert summary.ended == ("nothing to run: the budget was already spent (2 trials) before this run: raise "
                             "budget.trials to continue"), summary.ended
    assert lines == [f"spent: {summary.ended}"], lines  # said before the model loads: nothing else ran
    assert _rows(sdir.results_db) == before, "a rerun of a finished study writes no trial, pack or timing row"
    assert (sdir.root / "timing.json").read_bytes() == timing
    assert (sdir.root / "report.html").stat().st_mtime_ns == report


@pytest.mark.parametrize(("sig", "code", "said"), [(signal.SIGINT, 130, "interrupted (Ctrl-C)"),
                                                 (signal.SIGTERM, 143, "terminated (SIGTERM)")], ids=["INT", "TERM"])
def test_ctrl_c_and_sigterm_say_that_running_again_resumes(tiny_dirs, tmp_path, sig, code, said) -> None:
    path = write_study(tmp_path, tiny_dirs("llama"), name="interrupted", budget={"trials": 4},
                       train={"max_steps": 200, "micro_batch": 2}, pruning={"kind": "none"}, pack={"max_slots": 2})
    proc = subprocess.Popen([sys.executable, "-m", "lora_sweep", "run", str(path), "--quiet"], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 240
    while time.time() < deadline:
        time.sleep(0.2)
        try:
            if TrialState.RUNNING in [t.state for t in _trials(tmp_path / "runs-interrupted", "interrupted")]:
                break
        except Exception:
            continue
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == code, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert err.strip().startswith(f"interrupted: stopped: {said} at pack step "), err  # the run's own end line
    assert err.strip().endswith("a study keeps what finished: run the same command again to resume"), err


def test_generated_texts_are_stored_per_item_and_sampled_in_the_report(tiny_dirs, tmp_path) -> None:
    from lora_sweep.reports.html import build_report
    from lora_sweep.store.api import ResultsStore

    spec = load_study(write_study(tmp_path, tiny_dirs("llama"), name="texts", budget={"trials": 2},
                                  train={"max_steps": 4, "micro_batch": 2}, pruning={"kind": "none"},
                                  pack={"max_slots": 2}))
    run_study(spec, log=lambda m: None)
    eval_rows = [json.loads(line) for line in spec.data.eval.read_text().splitlines() if line.strip()]
    with ResultsStore(spec.out_dir / "results.db", create=False) as store:
        done = [t.number for t in store.trials("COMPLETE")]
        rows = store.items(evaluator="exact_match", trial=done[0])
        losses = store.items(evaluator="eval_loss", trial=done[0])
    assert len(rows) == len(eval_rows) and done
    for row in rows:
        d = row.detail
        assert {"prompt", "output", "reference"} <= d.keys() and d["reference"] == eval_rows[row.item]["completion"]
        assert eval_rows[row.item]["prompt"].strip() in d["prompt"] and row.score in (0.0, 1.0)
    assert all(r.detail is None for r in losses), "a loss has no text to keep"
    page = build_report(spec.out_dir)
    assert 'id="samples"' in page and _html_escape(rows[0].detail["reference"]) in page
    assert f"#{done[0]}" in page.split('id="samples"')[1]


def _html_escape(text: str) -> str:
    import html

    return html.escape(text)


def test_device_seconds_are_a_trials_steps_and_its_own_evaluation(tiny_dirs, tmp_path, monkeypatch) -> None:
    """Evaluation made slow (2 s a call): a trial is charged its share of its own evaluation, not its peers'."""
    import lora_sweep.sweep.study
    from lora_sweep.store.api import ResultsStore

    real = lora_sweep.sweep.study.evaluate

    def slow(*args, **kwargs):  # type: ignore[no-untyped-def]
        time.sleep(2.0)
        return real(*args, **kwargs)

    monkeypatch.setattr(lora_sweep.sweep.study, "evaluate", slow)
    spec = load_study(write_study(tmp_path, tiny_dirs("llama"), name="charged", budget={"trials": 3},
                                  train={"max_steps": 6, "micro_batch": 2}, pruning={"kind": "none"},
                                  pack={"max_slots": 2}, evaluators=[{"name": "heldout_loss"}]))
    run_study(spec, log=lambda m: None)
    with ResultsStore(spec.out_dir / "results.db", create=False) as store:
        charged = {t.number: t.device_seconds for t in store.trials()}
        wall = store.packs()[0].wall_s
    # trials 0 and 1 end together (one 2 s evaluation, shared); trial 2 then trains alone (its own 2 s)
    assert 1.0 <= charged[0] < 2.0 and 1.0 <= charged[1] < 2.0, charged
    assert 2.0 <= charged[2] < 3.0, charged
    assert sum(charged.values()) <= wall


def test_a_retried_dropout_trial_reproduces_a_fresh_run_bit_for_bit(tiny_dirs, tmp_path) -> None:
    """A run stopped mid-trial, resumed: the retry (dropout 0.05) ends where the same trial run once ends."""
    from lora_sweep.store.api import ResultsStore

    common = dict(search={"rank": [4], "lr": [2e-4, 1e-2], "dropout": [0.05]}, budget={"trials": 2},
                  train={"max_steps": 8, "micro_batch": 2}, pruning={"kind": "none"}, pack={"max_slots": 2},
                  evaluators=[{"name": "heldout_loss"}], objectives=[{"metric": "eval_loss", "direction": "minimize"}])
    once = load_study(write_study(tmp_path, tiny_dirs("llama"), name="once", **common))
    run_study(once, log=lambda m: None)
    stopped = load_study(write_study(tmp_path, tiny_dirs("llama"), name="stopped", **common))

    def stop(p) -> None:  # type: ignore[no-untyped-def]
        if p.step == 5:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_study(stopped, progress=stop, log=lambda m: None)
    run_study(stopped, log=lambda m: None)

    def finals(spec) -> dict:  # type: ignore[no-untyped-def]
        with ResultsStore(spec.out_dir / "results.db", create=False) as store:
            return {(t.params["lr"], t.params["dropout"]): (t.metrics["eval_loss"], store.curves([t.number])[t.number])
                    for t in store.trials("COMPLETE")}

    a, b = finals(once), finals(stopped)
    assert a.keys() == b.keys() and len(a) == 2
    for key in a:
        assert a[key][0] == b[key][0], (key, a[key][0], b[key][0])
        assert [s.loss for s in a[key][1]] == [s.loss for s in b[key][1]]


def test_an_oom_mid_pack_shrinks_the_pack_and_keeps_the_budget_exact(tiny_dirs, tmp_path, monkeypatch) -> None:
    """A CUDA out-of-memory error, injected on CPU at the first pack's fourth step with 3 slots training."""
    import lora_sweep.packer.step.train
    from lora_sweep.store.api import ResultsStore

    real, calls = lora_sweep.packer.step.train.train, []

    def oom_once(pm, capacity, next_job, *, on_step, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(capacity)

        def step(reports) -> None:  # type: ignore[no-untyped-def]
            on_step(reports)
            if len(calls) == 1 and reports[0].step == 3:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected)")

        return real(pm, capacity, next_job, on_step=step, **kwargs)

    monkeypatch.setattr(lora_sweep.packer.step.train, "train", oom_once)  # what Packer.train runs, when called
    spec = load_study(write_study(tmp_path, tiny_dirs("llama"), name="oom", budget={"trials": 5},
                                  train={"max_steps": 8, "micro_batch": 2}, pruning={"kind": "none"}))
    logs: list[str] = []
    summary = run_study(spec, log=logs.append)
    assert calls == [3, 2], "the pack restarts with one slot fewer than the ones that ran out of memory"
    trials = _trials(spec.out_dir, "oom")
    failed = [t for t in trials if t.state == TrialState.FAIL]
    complete = [t for t in trials if t.state == TrialState.COMPLETE]
    assert len(failed) == 3 and len(complete) == 5 and summary.complete == 5, [t.state for t in trials]
    retried = sorted(t.user_attrs["retry_of"] for t in trials if "retry_of" in t.user_attrs)
    assert retried == sorted(t.number for t in failed), "each trial that was training is retried once"
    for t in failed:
        retry = next(r for r in trials if r.user_attrs.get("retry_of") == t.number)
        assert retry.params == t.params and "out of memory" in t.user_attrs["reason"]
    with ResultsStore(spec.out_dir / "results.db", create=False) as store:
        packs = store.packs()
    assert [(p.status, p.slots) for p in packs] == [("oom", 3), ("finished", 2)]
    assert any("out of memory" in m and "2 slots" in m for m in logs), logs


def test_join_becomes_a_worker_of_a_shared_run_and_refuses_a_single_one(tiny_dirs, tmp_path) -> None:
    def wait_running(out: Path, name: str) -> None:
        deadline = time.time() + 240
        while time.time() < deadline:
            time.sleep(0.2)
            try:
                if TrialState.RUNNING in [t.state for t in optuna.load_study(
                        study_name=name, storage=storage_of(out)).get_trials()]:
                    return
            except Exception:
                continue

    shared = write_study(tmp_path, tiny_dirs("llama"), name="joined", budget={"trials": 6}, pack={"max_slots": 2},
                         train={"max_steps": 30, "micro_batch": 2}, pruning={"kind": "none"},
                         evaluators=[{"name": "heldout_loss"}], objectives=[{"metric": "eval_loss",
                                                                              "direction": "minimize"}])
    log = tmp_path / "joined.log"
    from optuna.storages.journal import JournalFileBackend

    def storage_of(out: Path):  # type: ignore[no-untyped-def]
        return optuna.storages.JournalStorage(JournalFileBackend(str(log))) if out.name == "runs-joined" else \
            open_storage(StudyDir(out).optuna_url)

    owner = subprocess.Popen([sys.executable, "-m", "lora_sweep", "run", str(shared), "--workers", "1", "--storage",
                              str(log), "--quiet"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_running(tmp_path / "runs-joined", "joined")
    joiner = _run_cli("run", str(shared), "--join", "--quiet", "--storage", str(log), timeout=300)
    _, err = owner.communicate(timeout=300)
    assert owner.returncode == 0, err
    assert joiner.returncode == 0 and "joined as a worker" in joiner.stdout, joiner.stderr
    trials = optuna.load_study(study_name="joined", storage=storage_of(tmp_path / "runs-joined")).get_trials()
    assert len(trials) == 6 and all(t.state == TrialState.COMPLETE for t in trials), [t.state for t in trials]

    single = write_study(tmp_path, tiny_dirs("llama"), name="alone", budget={"trials": 3}, pack={"max_slots": 1},
                         train={"max_steps": 60, "micro_batch": 2}, pruning={"kind": "none"})
    proc = subprocess.Popen([sys.executable, "-m", "lora_sweep", "run", str(single), "--quiet"], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_running(tmp_path / "runs-alone", "alone")
    refused = _run_cli("run", str(single), "--join", "--quiet", timeout=120)
    proc.send_signal(signal.SIGINT)  # its own end is another test's
    proc.wait(timeout=120)
    assert refused.returncode == 2 and "runs the study alone" in refused.stderr, refused.stderr


def test_a_pack_store_is_sized_once_by_the_spaces_largest_rank(tiny_dirs, tmp_path, monkeypatch) -> None:
    """The step's store takes the rank bucket of the space's largest rank from its first slot: a bucket
    grown when a larger-rank trial arrives would re-capture every graph and precompile again (on CPU the step runs
    eagerly)."""
    from lora_sweep.packer.model.packed import PackedModel

    buckets: list[int] = []
    real = PackedModel.ensure_store

    def recording(pm, *args, **kwargs):  # type: ignore[no-untyped-def]
        before = pm.store
        store = real(pm, *args, **kwargs)
        if store is not before:
            buckets.append(store.rank_bucket)
        return store

    monkeypatch.setattr(PackedModel, "ensure_store", recording)
    search = {"rank": [2, 4, 16, 24], "lr": {"low": 1e-4, "high": 3e-2, "log": True}, "targets": {"all": "all-linear"}}
    spec = load_study(write_study(tmp_path, tiny_dirs("llama"), name="bucket", search=search))
    summary = run_study(spec, log=lambda m: None)
    ranks = [t.params["rank"] for t in _trials(spec.out_dir, "bucket")]
    assert summary.complete + summary.pruned == 6 and ranks[0] == 16 and 24 in ranks  # the default (r=16) first
    assert buckets == [32], "one store, of the bucket holding rank 24, for the whole pack"


CURVE_EVALUATOR = '''
from lora_sweep.evaluators.heldout_loss import HeldoutOptions, heldout_loss
from lora_sweep.evaluators.registry import EvalResult, Evaluator


def token_loss(model, slots, data, **options):
    result = heldout_loss(model, slots, data, **options)
    return EvalResult(metrics={s: {"token_loss": m["eval_loss"]} for s, m in result.metrics.items()})


TOKEN_LOSS = Evaluator("token_loss", HeldoutOptions, token_loss, metrics=lambda opts: {"token_loss": "minimize"},
                       reports="`token_loss`", curve="token_loss")
'''


def test_eval_every_scores_the_curve_an_evaluator_declares(tiny_dirs, tmp_path) -> None:
    """``train.eval_every``'s curve is scored by the entry whose evaluator declares it serves one (here a user's,
    named by file), not by a built-in the sweep names: its metric is the curve's and the pruner's intermediate
    values."""
    from lora_sweep.store.api import ResultsStore

    (tmp_path / "curve_eval.py").write_text(CURVE_EVALUATOR)
    path = write_study(tmp_path, tiny_dirs("llama"), name="own-curve", train={"max_steps": 4, "micro_batch": 4,
                                                                              "eval_every": 2},
                       search={"rank": [2, 4]}, budget={"trials": 1}, pruning={"kind": "none"},
                       evaluators=[{"name": f"{tmp_path / 'curve_eval.py'}:TOKEN_LOSS"}],
                       objectives=[{"metric": "token_loss", "direction": "minimize"}])
    spec = load_study(path)
    run_study(spec, log=lambda m: None)
    (trial,) = optuna_study(spec.out_dir, "own-curve").get_trials()
    with ResultsStore(spec.out_dir / "results.db", create=False) as store:
        curve = store.evals(trial=trial.number, kind="curve")
    assert [(e.step, e.metric) for e in curve] == [(2, "token_loss"), (4, "token_loss")]
    assert trial.intermediate_values == {e.step: e.value for e in curve}
    assert curve[-1].value == pytest.approx(trial.values[0], rel=1e-5)  # the last point is the final score
