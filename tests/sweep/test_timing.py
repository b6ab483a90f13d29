"""The wall-time split of a run (``sweep.timing``): exclusive nested phases, and what ``sweep run`` records."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

import lora_sweep
from lora_sweep.sweep.config.loader import load_study
from lora_sweep.sweep.status import study_status
from lora_sweep.sweep.study import run_study
from lora_sweep.sweep.timing import (
    EXEC_GAP_S,
    PHASES,
    TIMING_FILE,
    WallSplit,
    append_run,
    command_split,
    last_run,
    process_started,
    run_split,
)
from tests.conftest import write_study

ROOT = Path(__file__).resolve().parents[2]


def _busy(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


class _Clock:
    """A clock that moves only when told: the split's arithmetic checked exactly, whatever the host's load."""

    def __init__(self) -> None:
        self.now = 100.0

    def perf_counter(self) -> float:
        return self.now

    def process_time(self) -> float:
        return 0.0

    def time(self) -> float:
        return 1.7e9 + self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def test_a_nested_phase_stops_the_outer_clock(monkeypatch) -> None:
    clock = _Clock()
    monkeypatch.setattr("lora_sweep.sweep.timing.time", clock)
    split = WallSplit()
    with split.phase("train"):
        clock.advance(0.05)
        with split.phase("storage"):
            clock.advance(0.02)
            with split.phase("evaluate"):
                clock.advance(0.04)
        clock.advance(0.01)
    s = split.seconds
    assert s["train"] == pytest.approx(0.06) and s["storage"] == pytest.approx(0.02)
    assert s["evaluate"] == pytest.approx(0.04)
    rec = split.record()
    assert abs(sum(rec["phases"].values()) - rec["wall_s"]) < 1e-2  # the phases (and other) add up to the wall
    assert rec["calls"] == {"evaluate": 1, "storage": 1, "train": 1}


def _burn_cpu(seconds: float) -> None:
    """Spin until this process has used ``seconds`` more CPU, however busy the host (its wall may be longer)."""
    end = time.process_time() + seconds
    while time.process_time() < end:
        pass


def test_each_phase_keeps_the_process_cpu_seconds_it_used_exclusively() -> None:
    """The CPU beside the wall: a phase that waits uses none, one that computes uses its own, a nested phase's CPU
    is not its parent's, and the record's CPU seconds add up to what the process used since the split's start."""
    split = WallSplit()
    cpu0 = time.process_time()
    with split.phase("load"):
        time.sleep(0.15)  # waits: wall, no CPU
    with split.phase("train"):
        _burn_cpu(0.1)
        with split.phase("evaluate"):
            _burn_cpu(0.2)
    rec = split.record()
    used = time.process_time() - cpu0
    cpu = rec["cpu"]
    assert set(cpu) == set(rec["phases"]) == {*PHASES, "other"}
    assert rec["phases"]["load"] >= 0.15 and cpu["load"] < 0.05
    assert 0.1 <= cpu["train"] < 0.15 and 0.2 <= cpu["evaluate"] < 0.25  # the evaluation's not the training's
    assert sum(cpu.values()) == pytest.approx(used, abs=0.02)
    table = split.table(rec)
    assert re.search(r"train\s+[\d.]+ s\s+[\d.]+%\s+cpu\s+0\.1 s", table), table
    old = {k: v for k, v in rec.items() if k != "cpu"}  # a record from before the CPU was kept still prints
    assert "cpu" not in split.table(old) and "train" in split.table(old)


def test_move_recharges_and_never_goes_negative() -> None:
    split = WallSplit()
    split.add("train", 1.0)
    split.move(0.25, "train", "compile")
    split.move(5.0, "train", "compile", detail="compile:capture")
    assert split.seconds == {"train": 0.0, "compile": 1.0, "compile:capture": 0.75}


def test_timed_wraps_a_callback_and_the_table_lists_every_phase() -> None:
    split = WallSplit()
    assert split.timed("storage", lambda x: x + 1)(1) == 2
    split.add("evaluate:generation", 0.5)
    table = split.table()
    assert all(p in table for p in PHASES) and "generation" in table


def test_a_part_adds_to_its_sub_phase_only_and_the_record_says_what_came_before() -> None:
    split = WallSplit()
    with split.phase("load"):
        with split.part("load:model"):
            _busy(0.03)
        _busy(0.01)
    assert 0.03 <= split.seconds["load:model"] < split.seconds["load"]
    rec = split.record()
    assert rec["detail"] == {"load:model": round(split.seconds["load:model"], 3)}
    assert rec["process_before_s"] > 0  # this process imported sweep before the split started
    assert "model" in split.table(rec)


def test_timing_file_keeps_every_run_and_ignores_garbage(tmp_path) -> None:
    assert last_run(tmp_path) is None
    (tmp_path / TIMING_FILE).write_text("not json")
    assert last_run(tmp_path) is None
    append_run(tmp_path, {"wall_s": 1.0, "phases": {"train": 1.0}})
    append_run(tmp_path, {"wall_s": 2.0, "phases": {"train": 2.0}})
    assert last_run(tmp_path)["wall_s"] == 2.0
    assert len(json.loads((tmp_path / TIMING_FILE).read_text())["runs"]) == 2


def test_a_run_records_its_split_and_status_shows_it(tiny_dirs, tmp_path) -> None:
    spec = load_study(write_study(tmp_path, tiny_dirs("llama"), name="split"))
    summary = run_study(spec, log=lambda m: None)
    rec = summary.split
    assert set(rec["phases"]) == {*PHASES, "other"}
    for phase in ("load", "train", "evaluate", "save", "storage"):
        assert rec["phases"][phase] > 0, phase
    assert rec["detail"]["evaluate:heldout_loss"] > 0 and rec["detail"]["evaluate:generation"] > 0
    # the load's parts: model, study, data, together within the load phase
    parts = [rec["detail"][f"load:{p}"] for p in ("model", "study", "data")]
    assert all(v > 0 for v in parts) and sum(parts) <= rec["phases"]["load"] + 1e-2
    # the evaluators' own times are inside evaluate; the phases add up to the run's wall time
    assert sum(v for k, v in rec["detail"].items() if k.startswith("evaluate:")) <= rec["phases"]["evaluate"] + 1e-2
    assert abs(sum(rec["phases"].values()) - rec["wall_s"]) < 0.05
    assert rec["wall_s"] >= summary.wall_s
    assert study_status(spec.out_dir)["split"] == rec


def test_the_process_start_is_the_interpreters_and_a_command_split_charges_it_to_import() -> None:
    code = ("import json, time, lora_sweep; from lora_sweep.sweep import timing as t; start, source = "
            "t.process_started(); rec = t.command_split().record(); "
            "print(json.dumps([start, source, lora_sweep.IMPORTED_AT, time.time(), rec]))")
    t0 = time.time()
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    start, source, imported, now, rec = json.loads(out.stdout)
    assert source == "process" and t0 - 0.02 <= start <= imported <= start + EXEC_GAP_S  # /proc: a tick is 10 ms
    assert rec["source"] == "process" and rec["process_before_s"] == 0.0
    assert rec["wall_s"] == pytest.approx(now - start, abs=0.05)
    assert rec["phases"]["import"] == pytest.approx(rec["detail"]["import:python"] + rec["detail"]["import:cli"],
                                                    abs=2e-3)
    assert rec["detail"]["import:python"] == pytest.approx(imported - start, abs=2e-3)
    assert rec["cpu"]["import"] > 0  # the interpreter's and the imports' CPU before the split was made


def test_a_process_that_ran_something_before_python_counts_from_the_import(monkeypatch) -> None:
    """A shell that exec's its last command in place (``(pip install ... && sweep run ...)``) keeps its process and
    its start: the command's split then starts at ``lora_sweep``'s import."""
    monkeypatch.setattr(lora_sweep, "IMPORTED_AT", time.time())  # long after this pytest process started
    assert process_started() == (lora_sweep.IMPORTED_AT, "import")
    split = command_split()
    assert split.source == "import" and run_split() is split and run_split() is not split  # one run takes it


def _quick_study(tmp_path: Path, tiny_dirs, name: str) -> Path:
    return write_study(tmp_path, tiny_dirs("llama"), name=name, budget={"trials": 2}, pack={"max_slots": 2},
                       train={"max_steps": 8, "micro_batch": 2}, pruning={"kind": "none"},
                       evaluators=[{"name": "heldout_loss"}])


def test_a_run_commands_split_is_its_whole_wall_and_profile_writes_a_trace_and_the_table(tiny_dirs, tmp_path) -> None:
    """Measured from outside: the split's parts add up to the command's wall time, from the process's start to its
    exit, within what the process spends outside Python's reach (exec, the interpreter's exit)."""
    path = _quick_study(tmp_path, tiny_dirs, "whole")
    prof = tmp_path / "prof"
    t0 = time.time()
    done = subprocess.run([sys.executable, "-m", "lora_sweep", "run", str(path), "--quiet", "--profile", str(prof)],
                          capture_output=True, text=True, cwd=ROOT, timeout=600)
    outside = time.time() - t0
    assert done.returncode == 0, done.stderr
    rec = last_run(tmp_path / "runs-whole")
    assert rec["source"] == "process" and set(rec["phases"]) == {*PHASES, "other"}
    assert abs(sum(rec["phases"].values()) - rec["wall_s"]) < 0.01
    assert rec["cpu"]["train"] > 0 and rec["cpu"]["import"] > 0 and set(rec["cpu"]) == set(rec["phases"])
    # what no split sees: the fork and exec before the process's start tick, the exit's atexit handlers after the
    # record (a second at most on 2 busy cores)
    assert outside - max(1.0, 0.02 * outside) < rec["wall_s"] <= outside, (outside, rec)
    assert rec["phases"]["other"] < 0.05 * rec["wall_s"], rec  # every second named but a sliver
    for phase in ("import", "read", "load", "train", "evaluate", "save", "storage", "report", "profile"):
        assert rec["phases"][phase] > 0, phase
    imports = [k for k in rec["detail"] if k.startswith("import:")]
    assert imports == [f"import:{m}" for m in ("python", "cli", "torch", "transformers", "optuna", "engine")]
    assert rec["detail"]["save:writer"] > 0 and rec["end"]["reason"] == "budget.trials"
    # --profile: a Chrome trace holding the window's operators and the phases as named ranges; the tables
    trace = json.loads((prof / "trace.json").read_text())
    names = {e.get("name", "") for e in trace["traceEvents"]}
    assert "aten::mm" in names and any(n.startswith("phase:") for n in names)
    assert "Self CPU" in (prof / "ops.txt").read_text()
    table = (prof / "phases.txt").read_text()
    assert table in done.stdout and "from the process's start" in table and "torch" in table


def test_the_first_line_comes_before_torch_is_imported(tiny_dirs, tmp_path) -> None:
    """`sweep run`'s first line is out before any heavy import: -X importtime writes a line to stderr as each module's
    import ends, in order with the command's own lines (stdout and stderr, one pipe; click flushes each line)."""
    path = _quick_study(tmp_path, tiny_dirs, "first")
    proc = subprocess.Popen([sys.executable, "-X", "importtime", "-m", "lora_sweep", "run", str(path)], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    before: list[str] = []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            if not line.startswith("import time:"):
                first = line
                break
            before.append(line.rsplit("|", 1)[1].strip())
        else:
            raise AssertionError("no line before the process ended")
    finally:
        os.killpg(proc.pid, 9)
        proc.wait()
    assert first.startswith(f"{path}: reading the study file"), first
    heavy = {"torch", "transformers", "optuna", "numpy", "sqlite_utils", "yaml", "rich"}
    assert not heavy & set(before), sorted(heavy & set(before))


@pytest.mark.parametrize("module", ["lora_sweep.cli", "lora_sweep.sweep.timing", "lora_sweep.sweep.config._yaml"])
def test_the_modules_before_the_first_line_import_nothing_heavy(module: str) -> None:
    out = subprocess.run([sys.executable, "-X", "importtime", "-c", f"import {module}"], capture_output=True,
                         text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    imported = {m.group(1) for m in re.finditer(r"\|\s+(\S+)$", out.stderr, re.M)}
    assert module in imported
    assert not {"torch", "transformers", "optuna", "numpy", "sqlite_utils"} & imported, module
