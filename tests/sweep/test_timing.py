"""The wall-time split of a run (``sweep.timing``): exclusive nested phases, and what ``sweep run`` records."""

from __future__ import annotations

import json
import time

from lora_sweep.sweep.config.loader import load_study
from lora_sweep.sweep.status import study_status
from lora_sweep.sweep.study import run_study
from lora_sweep.sweep.timing import PHASES, TIMING_FILE, WallSplit, append_run, last_run
from tests.conftest import write_study


def _busy(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def test_a_nested_phase_stops_the_outer_clock() -> None:
    split = WallSplit()
    with split.phase("train"):
        _busy(0.05)
        with split.phase("storage"):
            _busy(0.02)
            with split.phase("evaluate"):
                _busy(0.04)
        _busy(0.01)
    s = split.seconds
    assert 0.06 <= s["train"] < 0.09 and 0.02 <= s["storage"] < 0.04 and 0.04 <= s["evaluate"] < 0.06
    rec = split.record()
    assert abs(sum(rec["phases"].values()) - rec["wall_s"]) < 1e-2  # the phases (and other) add up to the wall
    assert rec["calls"] == {"evaluate": 1, "storage": 1, "train": 1}


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
