"""``sweep plan`` counts the run's storage (``sweep.bookkeeping``): each trial asked of the study's own sampler, its
rows written and told, timed on a scratch study, cached, and said on the plan's own line."""

from __future__ import annotations

import json
import time

import pytest

import lora_sweep.sweep.bookkeeping as bookkeeping
from lora_sweep.packer.plan import BaseShape, MemoryModel
from lora_sweep.packer.probe import PackTiming
from lora_sweep.sweep.config.loader import load_study
from lora_sweep.sweep.pack_step import PackTimer
from lora_sweep.sweep.planning import plan_report
from tests.conftest import write_study

MM = MemoryModel(base_bytes=1000, bytes_per_token=10, bytes_per_token_rank=1, bytes_per_param=16,
                 seconds_per_token=1e-5, seconds_per_step=0.02)
BASE = BaseShape((("q_proj", 64, 64), ("v_proj", 64, 64)), 1000, forward_s=0.002, load_s=2.0, imports_s=3.0)


def _spec(tmp_path, tiny_dirs, trials=6, name="kept"):  # noqa: ANN001, ANN202
    return load_study(write_study(tmp_path, tiny_dirs("llama"), name, budget={"trials": trials},
                                  train={"max_steps": 20, "micro_batch": 2}))


def test_a_trial_budgets_storage_is_measured_on_a_scratch_study_and_cached(tiny_dirs, tmp_path, monkeypatch) -> None:
    """Every trial of the budget asked of the study's sampler and told, on a scratch study (nothing in the study's
    own directory), the seconds per trial kept in the cache; a second plan reads them back without measuring."""
    monkeypatch.setenv("LORA_SWEEP_CACHE", str(tmp_path / "cache"))
    spec = _spec(tmp_path, tiny_dirs)
    asked: list[int] = []
    real = bookkeeping._asked

    def counted(*args):  # noqa: ANN002, ANN202
        trial = real(*args)
        asked.append(trial.number)
        return trial

    monkeypatch.setattr(bookkeeping, "_asked", counted)
    kept = bookkeeping.bookkeeping_seconds(spec, 6, 2)
    assert asked == list(range(6)) and kept.trials_s > 0 and kept.report_s is None  # no report writer
    (entry,) = (tmp_path / "cache" / "bookkeeping").iterdir()
    record = json.loads(entry.read_text())
    assert len(record["each"]) == 6 and sum(record["each"]) == pytest.approx(kept.trials_s)
    assert not spec.out_dir.exists()  # the scratch study is not the study's

    def refused(*args):  # noqa: ANN002, ANN202
        raise AssertionError("a cached measurement asks nothing")

    monkeypatch.setattr(bookkeeping, "_measure", refused)
    assert bookkeeping.bookkeeping_seconds(spec, 6, 2) == kept and kept.where == str(entry)


def test_the_runs_curves_and_its_report_are_timed_on_the_scratch_study(tiny_dirs, tmp_path, monkeypatch) -> None:
    """A run writes its live trials' curves every 10 pack steps (its split's storage) and its HTML report at the end
    (its report phase): the plan writes as many curve rows on the scratch study, and has the writer it is handed
    (the command's ``reports.html.write_report``) write that study's report twice, timing the second; a writer that
    fails leaves the report uncounted."""
    monkeypatch.setenv("LORA_SWEEP_CACHE", str(tmp_path / "cache"))
    spec = _spec(tmp_path, tiny_dirs, trials=6, name="reported")
    seen: list[tuple[int, int, set[int]]] = []

    def writer(root):  # noqa: ANN001, ANN202
        from lora_sweep.store.api import ResultsStore, StudyDir

        store = ResultsStore(StudyDir(root).results_db)
        steps = store.db.execute("SELECT count(*), count(DISTINCT trial) FROM steps").fetchone()
        packs = {row[0] for row in store.db.execute("SELECT steps FROM packs")}
        store.close()
        seen.append((*steps, packs))
        return root / "report.html"

    kept = bookkeeping.bookkeeping_seconds(spec, 6, 2, steps=45, report=writer)
    # 5 writes of 2 slots' rows since the last (45 pack steps: 10, 10, 10, 10, 5 each), the trials in turn
    assert seen == [(2 * 45, 6, {45})] * 2 and kept.curves_s > 0 and kept.report_s is not None
    seconds, line = bookkeeping.storage_seconds(spec, 6, 2, steps=45, report=writer)
    assert seconds == pytest.approx(kept.trials_s + kept.curves_s + kept.report_s + kept.imports_s) and len(seen) == 2
    assert f"their curves every 10 of 45 pack steps {kept.curves_s:.1f} s, its HTML report {kept.report_s:.1f} s" \
        in line

    def importing(root):  # noqa: ANN001, ANN202  (its first call loads what it imports: 0.3 s more)
        if not importing.loaded:
            importing.loaded = True
            time.sleep(0.3)
        return writer(root)

    importing.loaded = False
    first = bookkeeping.bookkeeping_seconds(spec, 6, 4, steps=45, report=importing)
    assert first.imports_s >= 0.25  # a run loads them on a thread while its pack trains: on a CPU, beside it
    cpu, _ = bookkeeping.storage_seconds(spec, 6, 4, steps=45, report=importing)
    cuda, line = bookkeeping.storage_seconds(spec, 6, 4, steps=45, report=importing, device="cuda")
    assert cpu - cuda == pytest.approx(first.imports_s) and "imports" not in line

    def broken(root):  # noqa: ANN001, ANN202
        raise RuntimeError("no plotly")

    from lora_sweep.reports.html import write_report

    real = bookkeeping.bookkeeping_seconds(spec, 6, 2, steps=40, report=write_report)  # the command's writer
    assert real.report_s is not None and real.report_s > 0  # the scratch study is a study the report reads
    failed = bookkeeping.bookkeeping_seconds(spec, 6, 3, steps=45, report=broken)
    assert failed.report_s is None
    assert "its HTML report not counted (it failed on the scratch study)" in \
        bookkeeping.storage_seconds(spec, 6, 3, steps=45, report=broken)[1]


def test_a_large_budget_is_timed_on_its_first_trials(tiny_dirs, tmp_path, monkeypatch) -> None:
    """Above ``BOOKKEEPING_TRIALS`` the rest of the budget costs the mean of the last half of those timed."""
    monkeypatch.setenv("LORA_SWEEP_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(bookkeeping, "BOOKKEEPING_TRIALS", 4)
    monkeypatch.setattr(bookkeeping, "_measure", lambda spec, trials, slots, steps, report: {
        "each": [0.5, 0.1, 0.2, 0.4][:trials], "curves_s": 0.0, "report_s": None, "imports_s": 0.0})
    spec = _spec(tmp_path, tiny_dirs, trials=10, name="large")
    assert bookkeeping.bookkeeping_seconds(spec, 10, 3).trials_s == pytest.approx(1.2 + 6 * 0.3)


class FakeStep:
    """A loaded base whose timed pack takes 50 ms a step."""

    def time_pack(self, specs, rows, length, **kwargs) -> PackTiming:  # noqa: ANN001, ANN003
        return PackTiming(0.05, kwargs["steps"], 1.0, "eager")


def test_the_plan_says_the_storage_and_adds_it_to_the_total(tiny_dirs, tmp_path, monkeypatch) -> None:
    """``sweep plan`` (which times its pack) measures the storage and prints it on its own line, in the total; a
    ``pack: auto`` run's own sizing (no timer) does not pay for it."""
    monkeypatch.setenv("LORA_SWEEP_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(bookkeeping, "_measure", lambda spec, trials, slots, steps, report: {
        "each": [0.75] * trials, "curves_s": 0.5, "report_s": 0.25, "imports_s": 1.0})
    spec = _spec(tmp_path, tiny_dirs, trials=8, name="told")
    timer = PackTimer(spec, "cpu", [20] * 40, lambda: FakeStep(), report=lambda root: root)
    report = plan_report(spec, [MM], "test", BASE, "cpu", timer=timer)
    assert report.storage_s == pytest.approx(7.75)  # the trials', the curves', the report's and its imports'
    table = report.table()
    assert (f"predicted storage                    7.8 s: 8 trials asked of the study's sampler, their rows written "
            f"and told ({report.slots} in flight) on a scratch study 6.0 s, their curves every 10 of "
            f"{report.pack_steps} pack steps 0.5 s, its HTML report 0.2 s and its imports 1.0 s (loaded while the "
            f"pack trains, beside it on a CPU); cached in ") in table
    total = report.predicted_total_s + report.predicted_eval_s + report.startup_s + report.turnover_s + 7.75
    assert f"predicted time for the trial budget  {total:.0f} s (" in table and "storage 8 s" in table
    sizing = plan_report(spec, [MM], "test", BASE, "cpu")
    assert sizing.storage_s == 0 and "not counted: measured only where the plan times its pack" in sizing.table()
