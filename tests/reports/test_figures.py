"""The report's pure parts on hand-made stores: each ``_x_info`` and the edge cases of a whole report
(no complete trial, single objective, failed trials, NaN values, a study still running, no Optuna storage)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from lora_sweep.reports import figures, summary, timeline
from lora_sweep.reports._fmt import table
from lora_sweep.reports._load import load_study_data, pareto_numbers
from lora_sweep.reports.html import build_report, write_report
from lora_sweep.store.api import ResultsStore, StudyDir

NAN = math.nan


def _study(tmp_path: Path, trials: list[dict], *, objectives=("loss", "size"), directions=("minimize", "minimize"),
           storage: str | None = None) -> Path:
    """A study directory written through the store's own API, as ``sweep run`` writes it."""
    sdir = StudyDir(tmp_path / "study").create()
    sdir.write_study_yaml("name: hand\nbudget: {trials: 99}\n")  # a copy for people: the report reads the store
    with ResultsStore(sdir.results_db) as store:
        store.set_meta(name="hand", model="/m", data="/d.jsonl", objectives=list(objectives),
                       spec={"name": "hand", "budget": {"trials": 10, "tokens": None, "wall_time": 3600.0}},
                       directions=list(directions), storage=storage or f"sqlite:///{tmp_path / 'missing.db'}")
        for t in trials:
            t = dict(t)
            steps, items = t.pop("steps", None), t.pop("items", None)
            store.upsert_trial(**t)
            if steps:
                store.add_steps(t["number"], [{"step": i + 1, "loss": v} for i, v in enumerate(steps)])
            for metric, scores in (items or {}).items():
                store.add_items(t["number"], metric, scores)
    return sdir.root


def _t(number: int, state: str = "COMPLETE", values=None, **kw) -> dict:
    return {"number": number, "state": state, "params": {"rank": 4 * (number + 1), "lr": 1e-3},
            "objective_values": values, "metrics": {"loss": (values or [None])[0]} if values else None, **kw}


def test_pareto_info_respects_directions(tmp_path) -> None:
    trials = [_t(0, values=[1.0, 5.0]), _t(1, values=[2.0, 6.0]), _t(2, values=[3.0, 4.0]),
              _t(3, values=[NAN, 1.0]), _t(4, "PRUNED"), _t(5, values=[0.5, 9.0], user_attrs={"default": True})]
    data = load_study_data(_study(tmp_path, trials, directions=("minimize", "maximize")))
    # minimise the first, maximise the second: 1 (2, 6) dominates 0 and 2; 5 (0.5, 9) dominates everything
    assert pareto_numbers(data.trials, data.directions) == [5]
    info = figures._pareto_info(data)
    assert [p.number for p in info.points] == [0, 1, 2, 5] and info.skipped == 1  # NaN left out, counted
    assert [p.number for p in info.points if p.default] == [5]
    assert "rank: 24" in info.points[-1].hover and "loss: 0.5" in info.points[-1].hover
    fig = figures.plot_pareto(info)
    assert {tr.name for tr in fig.data if tr.name} == {"dominated", "default trial"}  # the front is the default


def test_pareto_scatter_matrix_for_three_objectives(tmp_path) -> None:
    trials = [_t(i, values=[float(i), float(3 - i), float(i % 2)]) for i in range(4)]
    data = load_study_data(_study(tmp_path, trials, objectives=("a", "b", "c"), directions=("minimize",) * 3))
    fig = figures.plot_pareto(figures._pareto_info(data))
    assert fig.data and all(tr.type == "splom" for tr in fig.data)
    assert len(fig.data[0].dimensions) == 3


def test_gain_over_default_uses_paired_items(tmp_path) -> None:
    rng = np.random.default_rng(0)
    base = rng.normal(2.0, 0.3, size=40)
    trials = [_t(0, values=[2.0, 10.0], user_attrs={"default": True}, items={"loss": base.tolist()}),
              _t(1, values=[1.5, 20.0], items={"loss": (base - 0.5 + rng.normal(0, 0.01, 40)).tolist()}),
              _t(2, values=[1.9, 5.0])]
    info = summary._gain_info(load_study_data(_study(tmp_path, trials)))
    assert info.default == 0
    loss, size = info.rows
    assert loss.best == 1 and loss.diff == pytest.approx(-0.5) and loss.n_items == 40
    assert -0.6 < loss.low < loss.high < -0.4 and loss.verdict.startswith("better")  # per-item shift of -0.5
    assert size.best == 2 and size.low is None and size.n_items == 0  # no per-item scores for adapter size


def test_gain_without_or_with_unfinished_default(tmp_path) -> None:
    info = summary._gain_info(load_study_data(_study(tmp_path / "a", [_t(0, values=[1.0, 1.0])])))
    assert info.default is None and not info.rows and "no default trial" in info.note
    trials = [_t(0, "PRUNED", user_attrs={"default": True}, reason="pruned at step 6"), _t(1, values=[1.0, 1.0])]
    info = summary._gain_info(load_study_data(_study(tmp_path / "b", trials)))
    assert info.default == 0 and not info.rows and "PRUNED" in info.note


def test_budget_comes_from_the_stored_spec_not_the_yaml_copy(tmp_path) -> None:
    root = _study(tmp_path, [_t(0, values=[1.0, 2.0])])
    data = load_study_data(root)
    assert data.budget == {"trials": 10, "tokens": None, "wall_time": 3600.0}  # study.yaml says trials: 99
    budget = {name: limit for name, _, limit in summary._summary_info(data).budget}
    assert budget["trials finished"] == "10"
    (root / "study.yaml").unlink()  # the report needs only results.db
    assert load_study_data(root).budget["trials"] == 10
    with ResultsStore(StudyDir(root).results_db) as store:  # a store without a recorded spec: no budget, no guess
        store.db.execute("DELETE FROM study WHERE key = 'spec'")
    assert load_study_data(root).budget == {}


def test_curves_and_prune_markers(tmp_path) -> None:
    root = _study(tmp_path, [_t(0, values=[1.0, 1.0], steps=[3.0, 2.0, 1.0, 0.5]),
                             _t(1, "PRUNED", steps=[3.0, NAN, 2.5], reason="pruned by cohort SHA at step 2")])
    with ResultsStore(root / "results.db") as store:
        store.add_prune_decision(1, 2, 1, "prune", value=2.9, rank=2, cohort_size=2, reason="pruned at step 2")
        store.add_prune_decision(1, 2, 0, "keep", value=2.1, rank=1, cohort_size=2, reason="kept at step 2")
    data = load_study_data(root)
    info = figures._curves_info(data)
    c0, c1 = info.curves
    assert c0.steps == [1, 2, 3, 4] and c0.prune_step is None
    assert c1.losses == [3.0, None, 2.5] and c1.prune_step == 2 and c1.prune_loss is None  # NaN loss -> gap
    assert [tr.name for tr in figures.plot_curves(info).data] == ["complete", "pruned", "pruned here"]
    prunes = figures._prune_info(data)
    assert prunes.decisions == ["keep", "prune"] and "pruned at step 2" in prunes.texts[1]


def test_held_out_curves_from_the_store(tmp_path) -> None:
    root = _study(tmp_path, [_t(0, values=[1.0, 1.0], steps=[3.0, 2.0, 1.0, 0.5]), _t(1, "PRUNED", steps=[3.0]),
                             _t(2, steps=[2.0])])
    with ResultsStore(root / "results.db") as store:
        for step, value in ((4, 1.5), (2, 2.5)):  # out of order: the curve is sorted by step
            store.add_eval(0, step, {"eval_loss": value}, kind="curve")
        store.add_eval(1, 2, {"eval_loss": NAN, "other": 1.0}, kind="curve")
        store.add_eval(0, 4, {"eval_loss": 9.0}, kind="rung")  # a rung evaluation is not part of the curve
    data = load_study_data(root)
    info = figures._eval_curves_info(data)
    assert [(c.number, c.steps, c.losses) for c in info.curves] == [(0, [2, 4], [2.5, 1.5]), (1, [2], [None])]
    fig = figures.plot_curves(info, title="Held-out loss per trial", y="held-out loss", mode="lines+markers")
    assert fig.layout.yaxis.title.text == "held-out loss" and [t.name for t in fig.data] == ["complete", "pruned"]
    html = build_report(root)
    assert "fig-eval-curves" in html and "Held-out loss per trial" in html
    assert "fig-eval-curves" not in build_report(_study(tmp_path / "plain", [_t(0, values=[1.0, 1.0], steps=[1.0])]))


def test_timeline_marks_backfills_and_open_spans(tmp_path) -> None:
    root = _study(tmp_path, [_t(0, values=[1.0, 1.0]), _t(1, "PRUNED"), _t(2, "RUNNING")])
    with ResultsStore(root / "results.db") as store:
        pack = store.start_pack(slots=2, device="cpu")
        store.open_span(pack, 0, 0, start_step=0)
        store.close_span(pack, 0, 0, end_step=10, end_reason="finished")
        store.open_span(pack, 1, 1, start_step=0)
        store.close_span(pack, 1, 1, end_step=4, end_reason="stopped")
        store.open_span(pack, 1, 2, start_step=4)  # backfill, still training
    data = load_study_data(root)
    info = timeline._timeline_info(data)
    assert [(s.trial, s.start, s.end, s.reason, s.backfill) for s in info.spans] == [
        (0, 0, 10, "finished", False), (1, 0, 4, "stopped", False), (2, 4, 4, "training", True)]
    assert info.rows == ["pack 1 · slot 0", "pack 1 · slot 1"]
    assert data.running  # a RUNNING trial and a 'running' pack
    packs = timeline._packs_info(data)
    assert packs.tokens_per_s == [None] and packs.peak_mib == [None]
    timeline.plot_packs(packs)
    timeline.plot_timeline(info)


@pytest.mark.parametrize("case", ["no_complete", "single_objective", "failed_and_nan", "running"])
def test_report_edge_cases_render_without_errors(tmp_path, case: str) -> None:
    objectives, directions = ("loss", "size"), ("minimize", "minimize")
    trials = {
        "no_complete": [_t(0, "RUNNING"), _t(1, "FAIL", reason="CUDA out of memory\nTraceback ...")],
        "single_objective": [_t(0, values=[1.0], user_attrs={"default": True}), _t(1, values=[0.8]),
                             _t(2, "PRUNED")],
        "failed_and_nan": [_t(0, values=[NAN, 3.0]), _t(1, "FAIL", reason="objective loss is not finite"),
                           _t(2, values=[1.0, math.inf])],
        "running": [_t(0, values=[1.0, 2.0], steps=[2.0, 1.0]), _t(1, "RUNNING", steps=[2.0])],
    }[case]
    if case == "single_objective":
        objectives, directions = ("loss",), ("maximize",)
    root = _study(tmp_path, trials, objectives=objectives, directions=directions)
    if case == "running":
        with ResultsStore(root / "results.db") as store:
            store.open_span(store.start_pack(slots=2), 0, 1, start_step=0)
    text = build_report(root)
    assert "Could not draw" not in text
    assert text.count("<script type=\"text/javascript\">/**\n* plotly.js") <= 1
    assert not (tmp_path / "missing.db").exists(), "the report must not create an Optuna storage"
    expect = {"no_complete": ["No complete trial with finite objective values yet", "still running",
                              "CUDA out of memory"],
              "single_objective": ["Single-objective study", "best 2 by loss (maximize)"],
              "failed_and_nan": ["2 complete trial(s) left out", "objective loss is not finite"],
              "running": ["still running", "Optuna figures unavailable"]}[case]
    for snippet in expect:
        assert snippet in text, snippet
    assert write_report(root).name == "report.html"


def test_table_sort_keys() -> None:
    html = table(["a", "b"], [[("x", 2.5), ("y", NAN)], [("z", math.inf), "plain"]], table_id="t")
    assert 'data-v="2.5"' in html and 'data-v=""' in html and 'data-v="Infinity"' in html
    assert html.startswith('<table id="t" class="sortable">')
