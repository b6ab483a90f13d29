"""`sweep run` end to end on CPU: a small study, resume after SIGKILL, determinism, backfill, CLI errors."""

from __future__ import annotations

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
import yaml
from optuna.trial import TrialState

from sweep.spec import load_study
from sweep.study import run_study
from tests.conftest import write_study

ROOT = Path(__file__).resolve().parents[2]


def _trials(out: Path, name: str) -> list[optuna.trial.FrozenTrial]:
    return optuna.load_study(study_name=name, storage=f"sqlite:///{out / 'optuna.db'}").get_trials()


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
    return subprocess.run([sys.executable, "-m", "sweep.cli", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)


def test_resume_after_sigkill_loses_and_duplicates_nothing(tiny_dirs, tmp_path) -> None:
    path = write_study(tmp_path, tiny_dirs("llama"), name="killed", budget={"trials": 8},
                       train={"max_steps": 30, "micro_batch": 4}, pruning={"kind": "none"})
    out = tmp_path / "runs-killed"
    proc = subprocess.Popen([sys.executable, "-m", "sweep.cli", "run", str(path), "--quiet"], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.time() + 240
    while time.time() < deadline:  # kill mid-pack: some trial complete, others still training
        time.sleep(0.2)
        try:
            states = [t.state for t in _trials(out, "killed")]
        except Exception:
            continue
        # between one pack's trials completing and the next ones being asked, none is running: wait that out
        if states.count(TrialState.COMPLETE) >= 3 and TrialState.RUNNING in states:
            break
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

    from sweep.cli import cli

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
    shown = runner.invoke(cli, ["status", str(tmp_path / "runs-planned")])
    assert shown.exit_code == 0 and "vs default #0" in shown.output, shown.output


def test_memory_options_reach_the_training_loop(tiny_dirs, tmp_path) -> None:
    packing = {"max_slots": 2, "chunked_ce": 16, "activation_checkpointing": True}
    spec = load_study(write_study(tmp_path, tiny_dirs("llama"), name="memory", packing=packing,
                                  budget={"trials": 2}, train={"max_steps": 8, "micro_batch": 2}))
    assert (spec.packing.chunked_ce, spec.packing.activation_checkpointing) == (16, True)
    plain = load_study(write_study(tmp_path, tiny_dirs("llama"), name="plain", packing={"max_slots": 2},
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
    import sweep.resume
    from packer.model import PackedModel

    made: list[tuple[str, bool]] = []

    def recording(model, *, impl="auto", fused_base_ops=True):  # type: ignore[no-untyped-def]
        made.append((impl, fused_base_ops))
        return PackedModel(model, impl=impl, fused_base_ops=fused_base_ops)

    monkeypatch.setattr(sweep.resume, "PackedModel", recording)
    common = dict(budget={"trials": 1}, train={"max_steps": 8, "micro_batch": 2})
    default = load_study(write_study(tmp_path, tiny_dirs("llama"), name="default-kernels", **common))
    chosen = load_study(write_study(tmp_path, tiny_dirs("llama"), name="torch-kernels",
                                    packing={"max_slots": 1, "kernels": "torch", "fused_base_ops": False}, **common))
    assert default.packing.kernels == "auto"  # Triton on a GPU: the sweep must not default to the slow path
    assert default.packing.fused_base_ops is True
    for s in (default, chosen):
        run_study(s, log=lambda m: None)
    assert made == [("auto", True), ("torch", False)]
