"""Tests of store/ (results.py, schema.py, directory.py): study-directory layout, results tables, atomic
writes, the leaf-import contract."""

import json
import math
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

import lora_sweep.store.api as store_module
from lora_sweep.store.api import (
    EvalRow,
    ItemRow,
    PruneDecision,
    ResultsStore,
    SlotSpan,
    StepRow,
    StudyDir,
    TrialRecord,
    atomic_write_bytes,
    atomic_write_text,
)
from lora_sweep.store.directory import scratch_directory
from lora_sweep.store.schema import TABLES, columns

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def store(tmp_path: Path):
    with ResultsStore(tmp_path / "results.db") as s:
        yield s


def _count(store: ResultsStore, table: str) -> int:
    return store.db.execute(f"SELECT count(*) FROM {table}").fetchone()[0]


# ---------------------------------------------------------------- study directory


def test_study_dir_layout(tmp_path: Path) -> None:
    sd = StudyDir.for_name("demo", runs=tmp_path / "runs")
    assert sd.root == tmp_path / "runs" / "demo"
    assert not sd.exists() and not sd.is_study()
    sd.create()
    assert sd.exists() and sd.adapters.is_dir() and not sd.is_study()
    assert sd.optuna_url == f"journal://{(sd.root / 'optuna.log').resolve()}"  # a new study: a journal file
    assert Path(sd.optuna_url.removeprefix("journal://")).is_absolute()
    sd.optuna_db.touch()  # a directory an earlier version started keeps its SQLite storage
    assert sd.optuna_url == f"sqlite:///{(sd.root / 'optuna.db').resolve()}"
    assert sd.adapter_dir(7) == sd.root / "adapters" / "trial-7"
    assert (sd.results_db.name, sd.report_html.name, sd.study_yaml.name, sd.lock.name) == (
        "results.db",
        "report.html",
        "study.yaml",
        "lock",
    )
    ResultsStore(sd.results_db).close()
    sd.write_study_yaml("name: demo\n")
    assert sd.is_study()
    assert sd.study_yaml.read_text() == "name: demo\n"
    sd.create()  # idempotent on an existing study
    assert sd.is_study()


def test_open_existing_and_missing(tmp_path: Path) -> None:
    path = tmp_path / "results.db"
    with pytest.raises(FileNotFoundError):
        ResultsStore(path, create=False)
    assert not path.exists()
    with ResultsStore(path) as s:
        s.set_meta(name="demo")
        created = s.meta()["created"]
    with ResultsStore(path, create=False) as s:  # reopening keeps data and does not recreate
        meta = s.meta()
    assert meta["name"] == "demo" and meta["created"] == created
    assert meta["updated"] >= created
    assert "lora_sweep_version" in meta
    conn = sqlite3.connect(path)
    assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert conn.execute("PRAGMA user_version").fetchone()[0] == store_module.SCHEMA_VERSION


def test_newer_schema_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "results.db"
    ResultsStore(path).close()
    conn = sqlite3.connect(path)
    conn.execute(f"PRAGMA user_version = {store_module.SCHEMA_VERSION + 1}")
    conn.close()
    with pytest.raises(RuntimeError, match="schema"):
        ResultsStore(path)


def test_every_table_and_column_is_documented(store: ResultsStore) -> None:
    doc = store_module.__doc__ or ""
    for table, (_, pk) in TABLES.items():
        assert f"``{table}`` (PK {', '.join(pk)})" in doc
        cols = columns(table)
        # Plain SQL works without quoting: no column is an SQL keyword.
        store.db.execute(f"SELECT {', '.join(cols)} FROM {table}")
        for col in cols:
            if table != "study":  # study's two columns are described in prose
                assert col in doc, f"{table}.{col} missing from the module docstring"
    assert set(store.db.table_names()) == set(TABLES)


# ---------------------------------------------------------------- round trips


def test_meta_round_trip(store: ResultsStore) -> None:
    store.set_meta(name="s", objectives=["loss", "acc"], directions=["minimize", "maximize"], data={"path": "x"})
    store.set_meta(name="s2")
    meta = store.meta()
    assert meta["name"] == "s2"
    assert meta["objectives"] == ["loss", "acc"]
    assert meta["directions"] == ["minimize", "maximize"]
    assert meta["data"] == {"path": "x"}


def test_trial_round_trip_and_partial_upsert(store: ResultsStore) -> None:
    params = {"lr": 3e-4, "rank": 16, "targets": ["q_proj", "v_proj"], "rslora": True}
    store.upsert_trial(3, state="RUNNING", params=params, pack_id=1, slot=2, started=10.0)
    store.upsert_trial(
        3,
        state="COMPLETE",
        objective_values=(0.5, 12.0),
        metrics={"heldout_loss": 0.5, "acc": 0.75},
        user_attrs={"note": "x"},
        adapter_path="adapters/trial-3",
        steps_done=100,
        tokens=12_800,
        device_seconds=42.5,
        finished=52.0,
    )
    store.upsert_trial(4, state="PRUNED", reason="rank 4/4 at rung 10")
    t = store.trial(3)
    assert t == TrialRecord(
        number=3,
        state="COMPLETE",
        params=params,
        objective_values=[0.5, 12.0],
        metrics={"heldout_loss": 0.5, "acc": 0.75},
        user_attrs={"note": "x"},
        adapter_path="adapters/trial-3",
        pack_id=1,
        slot=2,
        steps_done=100,
        tokens=12_800,
        device_seconds=42.5,
        started=10.0,
        finished=52.0,
        reason=None,
    )
    assert store.trial(99) is None
    assert [t.number for t in store.trials()] == [3, 4]
    assert [t.number for t in store.trials(state="PRUNED")] == [4]
    # Users' SQL sees plain JSON text.
    assert store.db.execute("SELECT json_extract(params, '$.rank') FROM trials WHERE number = 3").fetchone()[0] == 16


def test_trial_upsert_is_idempotent(store: ResultsStore) -> None:
    for _ in range(3):
        store.upsert_trial(0, state="RUNNING", params={"lr": 1e-3})
    assert _count(store, "trials") == 1


def test_non_finite_floats(store: ResultsStore) -> None:
    store.upsert_trial(
        0,
        objective_values=[math.nan, math.inf],
        metrics={"a": -math.inf, "nested": [math.nan, {"b": math.inf}], "ok": 1.5},
    )
    t = store.trial(0)
    assert t is not None and t.objective_values is not None and t.metrics is not None
    assert math.isnan(t.objective_values[0]) and t.objective_values[1] == math.inf
    assert t.metrics["a"] == -math.inf and t.metrics["ok"] == 1.5
    assert math.isnan(t.metrics["nested"][0]) and t.metrics["nested"][1] == {"b": math.inf}
    raw = store.db.execute("SELECT objective_values, metrics FROM trials").fetchone()
    for text in raw:  # strict JSON that SQLite's JSON functions accept
        json.loads(text, parse_constant=lambda c: pytest.fail(f"bare {c} in JSON"))
        assert store.db.execute("SELECT json_valid(?)", [text]).fetchone()[0] == 1
    # REAL columns: infinities are native, NaN is NULL.
    store.add_steps(0, [{"step": 1, "loss": math.nan}, {"step": 2, "loss": math.inf}, {"step": 3, "loss": -math.inf}])
    losses = [r.loss for r in store.curves()[0]]
    assert losses == [None, math.inf, -math.inf]


def test_steps_round_trip_and_resume_rewrite(store: ResultsStore) -> None:
    rows = [
        {"step": s, "loss": 2.0 / s, "tokens": 128 * s, "lr": 1e-4, "grad_norm": 0.5, "time": 100.0 + s}
        for s in (1, 2, 3)
    ]
    store.add_steps(0, rows)
    store.add_steps(1, [{"step": 1, "loss": 9.0}])
    # A resumed run rewrites steps 2-3 and continues: no duplicates, the latest write wins.
    store.add_steps(0, [{"step": 2, "loss": 1.5, "tokens": 256}, {"step": 3, "loss": 1.25}, {"step": 4, "loss": 1.0}])
    assert _count(store, "steps") == 5
    curves = store.curves()
    assert sorted(curves) == [0, 1]
    assert [r.step for r in curves[0]] == [1, 2, 3, 4]
    assert curves[0][0] == StepRow(trial=0, step=1, loss=2.0, tokens=128, lr=1e-4, grad_norm=0.5, time=101.0)
    assert curves[0][1] == StepRow(trial=0, step=2, loss=1.5, tokens=256)
    assert store.curves(trials=[1]) == {1: [StepRow(trial=1, step=1, loss=9.0)]}
    assert store.curves(trials=[]) == {}


def test_curves_of_several_trials_in_one_insert_are_each_trials_steps(store: ResultsStore, tmp_path) -> None:
    curves = {0: [{"step": 1, "loss": 2.0, "tokens": 128, "grad_norm": 0.5}, {"step": 2, "loss": 1.5}],
              3: [{"step": 1, "loss": 9.0, "lr": 1e-3}]}
    store.add_curves(curves)
    one_by_one = ResultsStore(tmp_path / "other.db")
    for trial, rows in curves.items():
        one_by_one.add_steps(trial, rows)
    assert store.curves() == one_by_one.curves()
    assert store.curves()[0][1] == StepRow(trial=0, step=2, loss=1.5)  # a row's missing columns stay empty
    with pytest.raises(ValueError, match="losss"):
        store.add_curves({5: [{"step": 1, "loss": 1.0}], 6: [{"step": 1, "losss": 1.0}]})
    assert sorted(store.curves()) == [0, 3], "nothing of a rejected insert is written"


def test_unknown_column_is_rejected_and_nothing_written(store: ResultsStore) -> None:
    with pytest.raises(ValueError, match="losss"):
        store.add_steps(0, [{"step": 1, "loss": 1.0}, {"step": 2, "losss": 1.0}])
    assert _count(store, "steps") == 0


def test_evals_round_trip(store: ResultsStore) -> None:
    store.add_eval(0, 10, {"heldout_loss": 1.2}, at=5.0)
    store.add_eval(0, 20, {"heldout_loss": 1.1, "acc": 0.4}, kind="final", at=6.0)
    store.add_eval(0, 10, {"heldout_loss": 1.3}, at=7.0)  # re-evaluated on resume: replaced
    store.add_eval(1, 10, {"heldout_loss": 2.0}, at=8.0)
    assert _count(store, "evals") == 4
    assert store.evals(trial=0, kind="rung") == [EvalRow(0, "rung", 10, "heldout_loss", 1.3, 7.0)]
    assert {(e.metric, e.value) for e in store.evals(kind="final")} == {("heldout_loss", 1.1), ("acc", 0.4)}
    assert len(store.evals()) == 4


def test_items_round_trip(store: ResultsStore) -> None:
    store.add_items(0, "generation", [1.0, 0.0, 1.0], details=[{"out": "a"}, {"out": "b"}, None])
    store.add_items(1, "generation", [0.0, 0.0, 1.0])
    store.add_items(0, "heldout_loss", [0.5, math.nan])
    store.add_items(0, "generation", [1.0, 1.0, 1.0])  # rewritten: replaced, details cleared
    assert _count(store, "items") == 8
    gen = store.items(evaluator="generation")
    assert [(i.trial, i.item, i.score) for i in gen] == [(0, 0, 1.0), (0, 1, 1.0), (0, 2, 1.0)] + [
        (1, 0, 0.0),
        (1, 1, 0.0),
        (1, 2, 1.0),
    ]
    assert store.items(evaluator="heldout_loss") == [
        ItemRow(0, "heldout_loss", 0, 0.5, None),
        ItemRow(0, "heldout_loss", 1, None, None),
    ]
    store.add_items(2, "generation", [1.0], details=[{"out": "z", "ref": ["z"]}])
    assert store.items(trial=2)[0].detail == {"out": "z", "ref": ["z"]}
    with pytest.raises(ValueError):
        store.add_items(3, "generation", [1.0, 0.0], details=[None])


def test_packs_round_trip(store: ResultsStore) -> None:
    a = store.start_pack(slots=8, device="NVIDIA H200", started=100.0)
    b = store.start_pack(slots=4, started=150.0)
    assert (a, b) == (1, 2)
    store.finish_pack(a, steps=50, tokens=20_000, peak_mem_bytes=3 * 2**30, finished=200.0)
    store.finish_pack(b, status="oom", tokens_per_s=7.0, finished=160.0)
    p1, p2 = store.packs()
    assert (p1.pack_id, p1.slots, p1.device, p1.status, p1.steps) == (1, 8, "NVIDIA H200", "finished", 50)
    assert p1.wall_s == 100.0 and p1.tokens_per_s == 200.0 and p1.peak_mem_bytes == 3 * 2**30
    assert (p2.status, p2.tokens_per_s, p2.wall_s, p2.tokens) == ("oom", 7.0, 10.0, None)
    with pytest.raises(KeyError):
        store.finish_pack(99)


def test_a_packs_step_written_under_its_older_word_reads_back_in_the_current_one(store: ResultsStore) -> None:
    eager, graph = store.start_pack(slots=2, started=1.0), store.start_pack(slots=2, started=2.0)
    store.finish_pack(graph, finished=3.0, step="cuda-graph")
    with sqlite3.connect(store.path) as db:  # the row as an older version wrote it: the eager step's old name
        db.execute("UPDATE packs SET step = 'static-eager', status = 'finished' WHERE pack_id = ?", [eager])
    assert [p.step for p in store.packs()] == ["eager", "cuda-graph"]


def test_running_pack_is_visible(store: ResultsStore) -> None:
    store.start_pack(slots=2, started=1.0)
    (p,) = store.packs()
    assert p.status == "running" and p.finished is None


def test_spans_round_trip(store: ResultsStore) -> None:
    store.open_span(1, 0, 10, start_step=0, start_time=1.0)
    store.open_span(1, 1, 11, start_step=0, start_time=1.0)
    store.close_span(1, 1, 11, end_step=20, end_reason="pruned", end_time=3.0)
    store.open_span(1, 1, 12, start_step=20, start_time=3.0)  # backfill of the freed slot
    store.close_span(1, 0, 10, end_step=50, end_reason="complete", end_time=6.0)
    store.open_span(2, 0, 13, start_step=0, start_time=9.0)
    store.close_span(1, 0, 10, end_step=50, end_reason="complete", end_time=6.0)  # written again: no duplicate
    assert store.spans(pack_id=1) == [
        SlotSpan(1, 0, 10, 0, 50, 1.0, 6.0, "complete"),
        SlotSpan(1, 1, 11, 0, 20, 1.0, 3.0, "pruned"),
        SlotSpan(1, 1, 12, 20, None, 3.0, None, None),
    ]
    assert len(store.spans()) == 4


def test_prune_decisions_round_trip(store: ResultsStore) -> None:
    store.add_prune_decision(1, 10, 5, "keep", value=1.1, rank=1, cohort_size=3, reason="top 1/3", at=1.0)
    store.add_prune_decision(1, 10, 6, "prune", value=1.9, rank=3, cohort_size=3, reason="rank 3/3", at=1.0)
    store.add_prune_decision(1, 10, 6, "prune", value=1.9, rank=3, cohort_size=3, reason="rank 3/3", at=2.0)
    store.add_prune_decision(2, 10, 7, "keep", value=math.inf, at=3.0)
    assert store.prune_decisions(pack_id=1) == [
        PruneDecision(1, 10, 5, "keep", 1.1, 1, 3, "top 1/3", 1.0),
        PruneDecision(1, 10, 6, "prune", 1.9, 3, 3, "rank 3/3", 2.0),
    ]
    assert store.prune_decisions()[-1].value == math.inf
    with pytest.raises(ValueError):
        store.add_prune_decision(1, 10, 8, "maybe")


def test_transaction_groups_writes_and_rolls_back(store: ResultsStore) -> None:
    with pytest.raises(RuntimeError), store.transaction():
        store.upsert_trial(0, state="RUNNING")
        store.add_steps(0, [{"step": 1, "loss": 1.0}])
        raise RuntimeError("killed mid-transaction")
    assert _count(store, "trials") == 0 and _count(store, "steps") == 0
    with store.transaction():
        store.upsert_trial(0, state="RUNNING")
        store.add_steps(0, [{"step": 1, "loss": 1.0}])
    assert _count(store, "trials") == 1 and _count(store, "steps") == 1


def test_two_connections_wait_for_the_lock(tmp_path: Path) -> None:
    path = tmp_path / "results.db"
    a, b = ResultsStore(path), ResultsStore(path, timeout=0.05)
    with a.transaction():
        a.upsert_trial(0, state="RUNNING")
        with pytest.raises(sqlite3.OperationalError, match="locked"):
            b.upsert_trial(1, state="RUNNING")
        assert b.trials() == []  # WAL: readers are not blocked and see only committed data
    b.upsert_trial(1, state="RUNNING")
    assert [t.number for t in a.trials()] == [0, 1]
    a.close()
    b.close()


# ---------------------------------------------------------------- atomic writes


def _leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))


def test_atomic_write(tmp_path: Path) -> None:
    target = tmp_path / "report.html"
    atomic_write_text(target, "<html>1</html>")
    assert target.read_text() == "<html>1</html>"
    assert target.stat().st_mode & 0o777 == 0o644
    atomic_write_bytes(target, b"\x00\x01")
    assert target.read_bytes() == b"\x00\x01"
    assert _leftovers(tmp_path) == []


def test_a_signal_right_after_the_temporary_file_is_made_leaves_nothing(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A Ctrl-C or SIGTERM can land once the temporary file exists and before anything holds its name (a busy host
    deschedules the writer there): the file is removed all the same, and the old content stays."""
    target = tmp_path / "study.yaml"
    atomic_write_text(target, "old: 1\n")
    made = os.open

    def open_then_signal(file, flags, *args, **kwargs):
        fd = made(file, flags, *args, **kwargs)
        if os.fspath(file).endswith(".tmp"):
            os.close(fd)  # (the test's own hygiene: a process stopped by the signal closes it as it exits)
            raise KeyboardInterrupt  # what the signal handler raises at the next bytecode
        return fd

    monkeypatch.setattr(os, "open", open_then_signal)
    with pytest.raises(KeyboardInterrupt):
        atomic_write_text(target, "new: 2\n")
    assert target.read_text() == "old: 1\n" and _leftovers(tmp_path) == []


def test_a_scratch_directory_never_takes_or_removes_a_name_already_there(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A name already taken (a dead process's leftover with this pid) is passed over and left; the directory drawn
    instead is removed on exit, and one renamed away is not followed."""
    taken = tmp_path / f".out.{os.getpid()}-aaaa"
    taken.mkdir()
    (taken / "kept").write_text("x")
    draws = iter(["aaaa", "bbbb", "cccc"])
    monkeypatch.setattr("secrets.token_hex", lambda n: next(draws))
    with scratch_directory(tmp_path, ".out.") as tmp:
        assert tmp.name == f".out.{os.getpid()}-bbbb" and tmp.is_dir() and (taken / "kept").is_file()
        (tmp / "f").write_text("y")
    assert sorted(p.name for p in tmp_path.iterdir()) == [taken.name]
    with scratch_directory(tmp_path, ".out.") as tmp:
        os.replace(tmp, tmp_path / "out")
    assert (tmp_path / "out").is_dir() and sorted(p.name for p in tmp_path.iterdir()) == [taken.name, "out"]


def test_atomic_write_failure_keeps_old_content(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target = tmp_path / "study.yaml"
    atomic_write_text(target, "old: 1\n")

    def boom(src: str, dst: str) -> None:
        raise OSError("killed before rename")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(OSError, match="killed"):
        atomic_write_text(target, "new: 2\n" * 1000)
    assert target.read_text() == "old: 1\n"
    assert _leftovers(tmp_path) == []
    with pytest.raises(OSError):
        atomic_write_text(tmp_path / "fresh.txt", "x")
    assert not (tmp_path / "fresh.txt").exists() and _leftovers(tmp_path) == []


# ---------------------------------------------------------------- leaf contract


def test_import_is_a_leaf() -> None:
    code = (
        "import sys, lora_sweep.store.api\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in {'torch', 'optuna', 'yaml', 'triton', 'plotly'} "
        "or m.split('.')[:2] in (['lora_sweep', n] for n in ('sweep', 'packer', 'kernels', 'evaluators', 'reports', "
        "'benchmarks', 'cli', 'api')))\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


def test_numpy_scalars_become_numbers(store: ResultsStore) -> None:
    np = pytest.importorskip("numpy")
    store.upsert_trial(0, tokens=np.int64(5), device_seconds=np.float32(0.5), metrics={"a": np.float32(np.nan)})
    store.add_steps(0, [{"step": np.int64(1), "loss": np.float64(np.inf)}])
    t = store.trial(0)
    assert t is not None and t.tokens == 5 and t.device_seconds == 0.5 and math.isnan(t.metrics["a"])
    assert store.curves()[0][0].loss == math.inf
    assert store.db.execute("SELECT typeof(tokens) FROM trials").fetchone()[0] == "integer"


def test_pareto_front_reads_each_objective_in_its_direction() -> None:
    from lora_sweep.store.api import pareto_front

    points = [(0, [1.0, 5.0]), (1, [2.0, 9.0]), (2, [1.0, 5.0]), (3, [3.0, 2.0]), (4, [0.5, 1.0])]
    assert pareto_front(points, ["minimize", "maximize"]) == [0, 1, 2, 4]  # 3 loses to 1 on both
    assert pareto_front(points, ["minimize", "minimize"]) == [4]
    assert pareto_front(points[:3], ["minimize", "minimize"]) == [0, 2]  # equal points dominate neither
    assert pareto_front([], ["minimize"]) == []


def test_a_schema_1_file_gains_the_pack_step_column(tmp_path: Path) -> None:
    """A store written before ``packs.step`` existed opens, gains the column, and records a pack's step."""
    path = tmp_path / "results.db"
    with ResultsStore(path) as s:
        pack = s.start_pack(slots=2, device="cpu")
    conn = sqlite3.connect(path)
    conn.execute("ALTER TABLE packs DROP COLUMN step")
    conn.execute("PRAGMA user_version = 1")
    conn.close()
    with ResultsStore(path) as s:
        assert s.packs()[0].step is None
        s.finish_pack(pack, steps=3, step="eager")
        assert s.packs()[0].step == "eager"
    assert sqlite3.connect(path).execute("PRAGMA user_version").fetchone()[0] == store_module.SCHEMA_VERSION
