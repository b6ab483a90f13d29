"""The head-to-head benchmark against Optuna + PEFT, smoke-run on the CPU: a tiny Llama, 4 trials, the sweep, eager
PEFT and 2 PEFT processes; the compiled PEFT way (``torch.compile`` on a CPU: a compile per trial) on the first
trial. Its rows must be plausible, its trial logs complete, and the ways honest: the same sampler and seed propose
the same trials, and the same trial trains to the same held-out loss in the sweep's pack and in PEFT, eager or
compiled (CPU fp32)."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import pytest

from lora_sweep.api import load_study
from lora_sweep.benchmarks.timing import check_row
from lora_sweep.benchmarks.vs_peft import GAP, Way, gap_target, main, prepare, rows, table, time_to_target, vs_peft
from lora_sweep.errors import UserError
from lora_sweep.packer.tiny.models import build_tiny_model
from tests.conftest import DEMO_DATA, write_study

N = 4
STEPS = 6
WAYS = ("sweep", "peft", "peft-procs")


def _study(tmp: Path, **changes: object) -> Path:
    """A 4-trial study of 6 steps (rung at 3) on a one-layer tiny Llama and 48 / 16 rows of the demo's data."""
    model = tmp / "tiny" if (tmp / "tiny").exists() else build_tiny_model("llama", tmp / "tiny", seed=0, num_layers=1)
    for name, rows_kept in (("train", 48), ("eval", 16)):
        lines = (DEMO_DATA / f"arith-{name}.jsonl").read_text().splitlines()[:rows_kept]
        (tmp / f"{name}.jsonl").write_text("\n".join(lines) + "\n")
    doc = dict(data={"train": str(tmp / "train.jsonl"), "eval": str(tmp / "eval.jsonl"),
                     "format": "prompt_completion", "max_length": 48},
               search={"rank": [2, 4, 16], "lr": {"low": 1e-4, "high": 3e-2, "log": True},
                       "targets": {"attn": ["q_proj", "v_proj"], "all": "all-linear"}},
               train={"max_steps": STEPS, "micro_batch": 4, "warmup_steps": 1, "schedule": "cosine"},
               budget={"trials": N}, pruning={"kind": "cohort_sha", "rungs": [3], "reduction_factor": 2},
               pack={"max_slots": N}, evaluators=[{"name": "heldout_loss"}])
    return write_study(tmp, model, name="vs", **{**doc, **changes})


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, dict]]:
    """The smoke run's output folder and rows by way."""
    tmp = tmp_path_factory.mktemp("vs-peft")
    result = vs_peft(str(_study(tmp)), ways=WAYS, procs=(2,), out=tmp / "out")
    return tmp / "out", {r["way"]: r for r in result}


def _logs(out: Path) -> dict[str, dict[int, dict]]:
    """Each way's logged trials by number (``peft-procs-2``: the processes way at 2 processes)."""
    logs = json.loads((out / "vs_peft.json").read_text())["trial_logs"]
    return {name: {t["trial"]: t for t in log} for name, log in logs.items()}


def test_every_way_gives_a_plausible_row(run: tuple[Path, dict[str, dict]]) -> None:
    _, by_way = run
    assert list(by_way) == list(WAYS)
    overall = min(r["best_eval_loss"] for r in by_way.values())
    default = [t["eval_loss"] for log in _logs(run[0]).values() for n, t in log.items() if n == 0]
    assert len(default) == len(WAYS)  # the default completes in every way
    target = overall + (1 - GAP) * (sum(default) / len(default) - overall)
    for way, r in by_way.items():
        check_row(r, way)
        assert r["trials"] == N and r["complete"] + r["pruned"] == N and r["failed"] == 0, r
        assert r["complete"] >= 1 and math.isfinite(r["best_eval_loss"]), r  # the default is never pruned
        assert r["device_s_per_trial"] == pytest.approx(r["makespan_s"] / N, abs=1e-3)  # both rounded
        assert r["target_eval_loss"] == pytest.approx(target) and "time_to_user_target_s" not in r
        if r["best_eval_loss"] <= r["target_eval_loss"]:
            assert 0 < r["time_to_target_s"] <= r["makespan_s"], r
        for other in by_way.values():
            assert r["makespan_speedup"][other["way"]] == pytest.approx(other["makespan_s"] / r["makespan_s"],
                                                                         rel=1e-2, abs=1e-2)
    assert by_way["peft-procs"]["procs"] == 2


def test_every_trial_is_logged_with_its_time(run: tuple[Path, dict[str, dict]]) -> None:
    out, by_way = run
    record = json.loads((out / "vs_peft.json").read_text())
    assert [r["way"] for r in record["rows"]] == list(WAYS) and record["trials"] == N
    logs = record["trial_logs"]
    assert set(logs) == {"sweep", "peft", "peft-procs-2"}
    for name, log in logs.items():
        span = by_way[name.removesuffix("-2")]["makespan_s"]
        assert sorted(t["trial"] for t in log) == list(range(N)), name
        times = [t["t"] for t in log]
        assert times == sorted(times) and 0 < times[0] and times[-1] <= span + 1e-3, (name, times, span)
    with open(out / "trials.csv", newline="") as f:
        table = list(csv.DictReader(f))
    assert len(table) == N * len(logs) and {r["way"] for r in table} == set(logs)


def test_the_same_trial_trains_to_the_same_loss_every_way(run: tuple[Path, dict[str, dict]]) -> None:
    """The honesty check: one process's Optuna study asks what the sweep asks (the same sampler and seed; the first
    trials are the enqueued default and TPE's seeded random start-up), and a trial complete in two ways has the same
    held-out loss in both (the same rows, init, schedule, clipping and loss: fp32 on the CPU)."""
    by = _logs(run[0])
    assert {n: t["params"] for n, t in by["peft"].items()} == {n: t["params"] for n, t in by["sweep"].items()}
    assert by["peft-procs-2"][0]["params"] == by["sweep"][0]["params"]  # the default, enqueued once
    compared = 0
    for name in ("peft", "peft-procs-2"):
        for number, trial in by[name].items():
            theirs = by["sweep"][number]
            if trial["state"] == theirs["state"] == "COMPLETE" and trial["params"] == theirs["params"]:
                assert trial["eval_loss"] == pytest.approx(theirs["eval_loss"], rel=1e-5), (name, number)
                compared += 1
    assert compared >= 2  # at least the community default, which no way prunes, in each


def test_a_rerun_keeps_the_recorded_ways(run: tuple[Path, dict[str, dict]]) -> None:
    """Ways run by separate commands share one table: a way recorded in --out is not run again (the GPU's commands
    have a time limit); other settings in the same --out are refused."""
    out, by_way = run
    again = vs_peft(str(out.parent / "vs.yaml"), ways=WAYS, procs=(2,), out=out)
    assert again == list(by_way.values())
    worst = max(r["best_eval_loss"] for r in by_way.values())
    mine = vs_peft(str(out.parent / "vs.yaml"), ways=WAYS, procs=(2,), out=out, target=worst)  # not a setting
    for r in mine:
        assert r["user_target_eval_loss"] == worst and 0 < r["time_to_user_target_s"] <= r["makespan_s"], r
        assert r["time_to_target_s"] == by_way[r["way"]]["time_to_target_s"]
    with pytest.raises(UserError, match="other settings"):
        vs_peft(str(out.parent / "vs.yaml"), ways=("peft",), trials=3, out=out)


def test_the_compiled_way_trains_the_default_to_the_sweeps_loss(run: tuple[Path, dict[str, dict]],
                                                               tmp_path: Path) -> None:
    """``peft-graph`` on the CPU: rows padded to fixed shapes, the step under ``torch.compile``; one trial (a
    compile per trial is its cost), the enqueued default, compared with the sweep's."""
    (result,) = vs_peft(str(_study(tmp_path)), ways=("peft-graph",), trials=1, out=tmp_path / "out")
    check_row(result, "peft-graph")
    assert result["way"] == "peft-graph" and result["complete"] == 1
    mine, sweep = _logs(tmp_path / "out")["peft-graph"][0], _logs(run[0])["sweep"][0]
    assert mine["params"] == sweep["params"] and sweep["state"] == "COMPLETE"
    assert mine["eval_loss"] == pytest.approx(sweep["eval_loss"], rel=1e-5)


def _synthetic() -> tuple[Way, Way]:
    """Two ways' trial logs as trials.csv holds them: the default (trial 0) at loss 2.0 in both, the best 1.0."""
    fast = Way("a", 10.0, [dict(t=1.0, trial=0, state="COMPLETE", eval_loss=2.0),
                           dict(t=2.0, trial=1, state="PRUNED", eval_loss=None),
                           dict(t=5.0, trial=2, state="COMPLETE", eval_loss=1.04),
                           dict(t=9.0, trial=3, state="COMPLETE", eval_loss=1.0)])
    slow = Way("b", 40.0, [dict(t=10.0, trial=0, state="COMPLETE", eval_loss=2.0),
                           dict(t=20.0, trial=1, state="COMPLETE", eval_loss=1.5),
                           dict(t=30.0, trial=2, state="COMPLETE", eval_loss=1.06),
                           dict(t=40.0, trial=3, state="FAIL", eval_loss=None)])
    return fast, slow


def test_the_default_target_closes_95_percent_of_the_gap_from_the_default_trial() -> None:
    """Default 2.0, best 1.0: the target is 1.05, met by a's 1.04 at 5 s and never by b (1.06 is 94% of the gap);
    1% of the best (1.01), the old target, would have needed a's best trial at 9 s."""
    fast, slow = _synthetic()
    assert gap_target([fast, slow]) == pytest.approx(1.05)
    assert time_to_target(fast, 1.05) == 5.0 and time_to_target(slow, 1.05) is None
    a, b = rows([fast, slow], 4)
    assert a["target_eval_loss"] == pytest.approx(1.05) and a["time_to_target_s"] == 5.0
    assert b["time_to_target_s"] is None and b["failed"] == 1 and "time_to_user_target_s" not in a
    assert a["makespan_speedup"] == {"a": 1.0, "b": 4.0} and a["time_to_target_speedup"] == {"a": 1.0, "b": None}
    text = table([a, b])
    assert "to target s" in text and "--target" not in text and "held-out loss <= 1.05" in text


def test_the_default_trials_loss_is_the_mean_over_the_ways_that_completed_it() -> None:
    """Ways train the same default, equal up to the device's rounding: their mean is the gap's start; a way whose
    default failed counts nowhere, and without any completed default there is no target."""
    fast, slow = _synthetic()
    slow.trials[0]["eval_loss"] = 2.2
    assert gap_target([fast, slow]) == pytest.approx(1.0 + 0.05 * 1.1)
    slow.trials[0].update(state="FAIL", eval_loss=None)
    assert gap_target([fast, slow]) == pytest.approx(1.05)
    fast.trials[0].update(state="FAIL", eval_loss=None)
    assert gap_target([fast, slow]) is None
    a, _ = rows([fast, slow], 4)
    assert a["time_to_target_s"] is None and "no way completed the default trial" in table(rows([fast, slow], 4))


def test_a_users_target_is_a_column_beside_the_default() -> None:
    """--target 1.5: a gets there at 5 s, b at 20 s (4x); the default target's column stays."""
    a, b = rows(list(_synthetic()), 4, target=1.5)
    assert a["user_target_eval_loss"] == 1.5
    assert a["time_to_user_target_s"] == 5.0 and b["time_to_user_target_s"] == 20.0
    assert a["time_to_user_target_speedup"] == {"a": 1.0, "b": 4.0} and b["time_to_user_target_speedup"]["a"] == 0.25
    assert a["time_to_target_s"] == 5.0 and b["time_to_target_s"] is None
    head, row_a, row_b, *notes = table([a, b]).splitlines()
    assert "to target s" in head and "to --target s" in head
    assert row_a.split()[5:7] == ["5.0", "5.0"] and row_b.split()[5:7] == ["-", "20.0"]
    assert "1.00x / 1.00x / 1.00x" in row_a and "4.00x / - / 4.00x" in row_a
    assert notes[-1] == "--target: held-out loss <= 1.5"


def test_a_study_the_peft_ways_cannot_score_is_refused(tmp_path: Path) -> None:
    spec = load_study(_study(tmp_path, objectives=[{"metric": "exact_match", "direction": "maximize"}],
                             evaluators=[{"name": "heldout_loss"}, {"name": "generation"}]))
    with pytest.raises(UserError, match="exact_match"):
        prepare(spec, None, tmp_path)
    assert [e.name for e in prepare(load_study(_study(tmp_path)), 2, tmp_path).evaluators] == ["heldout_loss"]


def test_the_command_refuses_an_output_folder_in_use(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "old").write_text("")
    with pytest.raises(SystemExit) as stop:
        main(["--study", str(_study(tmp_path)), "--out", str(tmp_path / "out")])
    assert stop.value.code == 2 and "is not empty" in capsys.readouterr().err
