"""Faults a study directory meets: a journal torn mid-append, its lock left by a killed writer, a storage that
does not know the recorded trials, a run that failed before its first trial."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import optuna
import pytest
from optuna.storages import JournalStorage
from optuna.storages.journal import JournalFileBackend
from optuna.trial import TrialState

from lora_sweep.errors import UserError
from lora_sweep.packer.model.checkpoint import read_adapter
from lora_sweep.store.api import ResultsStore, StudyDir
from lora_sweep.store.storage import JournalFlock, open_storage
from lora_sweep.sweep.budget import counted
from lora_sweep.sweep.config.loader import load_study
from lora_sweep.sweep.config.spec import StudySpec
from lora_sweep.sweep.ledger import open_study
from lora_sweep.sweep.study import run_study
from lora_sweep.sweep.worker import study_counts
from tests.conftest import write_study

optuna.logging.set_verbosity(optuna.logging.WARNING)


def _journal(path: Path) -> bytes:
    """A journal of a small study: finished trials of every state, one left RUNNING, written as ``sweep`` does."""
    study = optuna.create_study(study_name="s", storage=open_storage(f"journal://{path}"), directions=["minimize"])
    for i, state in enumerate([TrialState.COMPLETE, TrialState.PRUNED, TrialState.COMPLETE, TrialState.FAIL,
                               TrialState.COMPLETE]):
        trial = study.ask()
        trial.suggest_float("lr", 1e-4, 1e-1, log=True)
        trial.set_user_attr("tokens", 100 * i)
        study.tell(trial, values=[1.0 / (i + 1)] if state == TrialState.COMPLETE else None, state=state)
    study.ask().suggest_int("rank", 1, 16)  # RUNNING: the trial a killed run was training
    return path.read_bytes()


def _states(storage: optuna.storages.BaseStorage) -> Counter[str]:
    return Counter(t.state.name for t in optuna.load_study(study_name="s", storage=storage).get_trials())


def test_a_journal_torn_at_any_byte_of_its_last_two_records_keeps_every_complete_one(tmp_path) -> None:
    whole = _journal(tmp_path / "whole.log")
    lines = whole.splitlines(keepends=True)
    start = len(whole) - len(lines[-1]) - len(lines[-2])
    for cut in range(start, len(whole)):
        path = tmp_path / f"cut-{cut}" / "optuna.log"
        path.parent.mkdir()
        path.write_bytes(whole[:cut])
        complete = whole[: whole.rfind(b"\n", 0, cut) + 1]
        reference = tmp_path / f"cut-{cut}" / "reference.log"
        reference.write_bytes(complete)  # what Optuna itself reads of the complete records
        expected = _states(JournalStorage(JournalFileBackend(str(reference))))
        said: list[str] = []
        storage = open_storage(f"journal://{path}", log=said.append)
        assert _states(storage) == expected, cut
        torn = whole[len(complete):cut]
        asides = list(path.parent.glob("optuna.log.torn-*"))
        if torn:
            assert len(said) == 1 and str(asides[0]) in said[0] and asides[0].read_bytes() == torn, cut
        else:
            assert said == [] and asides == [], cut
        assert path.read_bytes() == complete
        # the resumed study appends a record of its own, and a fresh reader decodes the whole journal
        study = optuna.load_study(study_name="s", storage=storage)
        study.tell(study.ask(), values=[0.5])
        after = _states(open_storage(f"journal://{path}", log=said.append))
        assert after == expected + Counter({"COMPLETE": 1}), cut
        assert len(said) == (1 if torn else 0)  # the second open found the journal whole


def test_a_writer_killed_holding_the_journal_lock_does_not_delay_the_next(tmp_path) -> None:
    path = tmp_path / "optuna.log"
    _journal(path)
    holder = subprocess.Popen([sys.executable, "-c", (
        "import sys, time; from pathlib import Path; from lora_sweep.store.storage import JournalFlock; "
        f"JournalFlock(Path({str(path)!r})).acquire(); print('held', flush=True); time.sleep(600)")],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        holder.kill()
        holder.wait()
        # Optuna's own symlink lock, as a writer killed by an earlier version leaves it: no longer waited on
        (tmp_path / "optuna.log.lock").symlink_to(path)
        started = time.monotonic()
        study = optuna.load_study(study_name="s", storage=open_storage(f"journal://{path}"))
        study.tell(study.ask(), values=[0.5])
        assert time.monotonic() - started < 2.0
    finally:
        holder.kill()


def test_the_journal_lock_orders_threads_of_one_process(tmp_path) -> None:
    lock = JournalFlock(tmp_path / "optuna.log")
    order: list[str] = []

    def other() -> None:
        with lock.held():
            order.append("other")

    with lock.held():
        t = threading.Thread(target=other)
        t.start()
        time.sleep(0.2)
        order.append("first")
    t.join()
    assert order == ["first", "other"]




# ---------------------------------------------------------------- whole runs on a tiny model


def _spec(tmp_path: Path, tiny_dirs, name: str, *overrides: str, **changes) -> StudySpec:  # noqa: ANN001
    """A 3-trial study of 6 steps without pruning (``tests.conftest.write_study``), loaded with ``overrides``."""
    changes = {"budget": {"trials": 3}, "train": {"max_steps": 6, "micro_batch": 4}, "pruning": {"kind": "none"},
               "evaluators": [{"name": "heldout_loss"}], **changes}
    return load_study(write_study(tmp_path, tiny_dirs("llama"), name=name, **changes), list(overrides))


def _files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _refusal(spec: StudySpec) -> str:
    with pytest.raises(UserError) as err:
        run_study(spec, log=lambda m: None)
    assert "\n" not in str(err.value)
    return str(err.value)


def test_a_storage_that_does_not_know_the_recorded_trials_is_refused_and_no_adapter_is_touched(
        tiny_dirs, tmp_path) -> None:
    spec = _spec(tmp_path, tiny_dirs, "agree")
    run_study(spec, log=lambda m: None)
    sdir = StudyDir(spec.out_dir)
    adapters = _files(sdir.adapters)
    assert len({name.split("/")[0] for name in adapters}) == 3
    path = spec.source
    # another study name in the same directory, and a storage pointed elsewhere
    assert "'other'" in _refusal(load_study(path, ["name=other"]))
    assert "elsewhere.log" in _refusal(load_study(path, [f"storage={tmp_path / 'elsewhere.log'}"]))
    sdir.optuna_log.unlink()  # the storage deleted
    line = _refusal(spec)
    assert "optuna.log" in line and "3 trial(s) (#0..#2)" in line
    assert _files(sdir.adapters) == adapters
    assert not sdir.optuna_log.is_file() or b"create_study" not in sdir.optuna_log.read_bytes()


def test_a_study_whose_journal_is_torn_resumes_to_its_budget_exactly(tiny_dirs, tmp_path) -> None:
    spec = _spec(tmp_path, tiny_dirs, "torn")
    run_study(spec, log=lambda m: None)
    journal = StudyDir(spec.out_dir).optuna_log
    whole = journal.read_bytes()
    last = whole.rstrip(b"\n").rfind(b"\n") + 1
    journal.write_bytes(whole[: last + (len(whole) - last) // 2])  # half the last record: a kill mid-append
    said: list[str] = []
    run_study(load_study(spec.source, ["budget.trials=4"]), log=said.append)
    assert any("partial record" in m for m in said)
    assert len(list(journal.parent.glob("optuna.log.torn-*"))) == 1
    trials = optuna.load_study(study_name="torn", storage=open_storage(f"journal://{journal}")).get_trials()
    assert len(counted(trials)) == 4 and not [t for t in trials if t.state == TrialState.RUNNING]
    for t in trials:
        if t.state == TrialState.COMPLETE:
            config, tensors = read_adapter(StudyDir(spec.out_dir).adapter_dir(t.number))
            assert tensors and config["r"] == t.params["rank"]


def test_a_run_that_failed_before_its_first_trial_pins_nothing(tiny_dirs, tmp_path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "1+1=", "completion": "2"}\n{"prompt": \n')
    spec = _spec(tmp_path, tiny_dirs, "restart", f"data.train={bad}", "data.max_length=8")
    with pytest.raises(UserError, match="bad.jsonl:2"):
        run_study(spec, log=lambda m: None)
    fixed = _spec(tmp_path, tiny_dirs, "restart", "search.rank=[2, 4]")  # other data, length and search space
    summary = run_study(fixed, log=lambda m: None)
    assert summary.complete == 3
    with ResultsStore(StudyDir(fixed.out_dir).results_db) as store:
        assert store.meta()["spec"]["data"]["max_length"] == 48


def test_a_run_whose_first_evaluation_failed_on_its_data_pins_nothing(tiny_dirs, tmp_path) -> None:
    # held-out rows the generation evaluator cannot score fail the first evaluation, after the pack's trials
    # were asked and trained: no trial finished, so the fixed data and a longer data.max_length are a new start
    text = tmp_path / "text.jsonl"
    text.write_text("".join(f'{{"text": "{i}+{i}={2 * i}"}}\n' for i in range(6)))
    evaluators = [{"name": "heldout_loss"}, {"name": "generation", "options": {"max_new_tokens": 2}}]
    spec = _spec(tmp_path, tiny_dirs, "eval", f"data.eval={text}", "data.format=auto", "data.max_length=32",
                 evaluators=evaluators)
    with pytest.raises(UserError, match="the generation evaluator needs rows of format"):
        run_study(spec, log=lambda m: None)
    lines: list[str] = []
    summary = run_study(_spec(tmp_path, tiny_dirs, "eval", "data.max_length=512", evaluators=evaluators),
                        log=lines.append)
    assert summary.complete == 3
    assert any(line.startswith("starting afresh with data.max_length changed (32 -> 512)") for line in lines)
    with ResultsStore(StudyDir(spec.out_dir).results_db) as store:
        assert store.meta()["spec"]["data"]["max_length"] == 512
        assert sum(r.state == "COMPLETE" for r in store.trials()) == 3
    # once a trial finished, the spec is pinned
    assert _refusal(_spec(tmp_path, tiny_dirs, "eval", "data.max_length=64", "budget.trials=4",
                          evaluators=evaluators)).startswith("run: data.max_length changed (512 -> 64)")


def test_a_worker_opening_a_torn_shared_journal_repairs_it_too(tmp_path) -> None:
    path = tmp_path / "optuna.log"
    whole = _journal(path)
    url = f"journal://{path}"
    path.write_bytes(whole[:-7])  # the last record (the RUNNING trial's suggested rank), torn
    assert study_counts(url, "s") == Counter({"COMPLETE": 3, "PRUNED": 1, "FAIL": 1, "RUNNING": 1})
    assert path.read_bytes() == whole[: whole.rstrip(b"\n").rfind(b"\n") + 1]
    assert [p.read_bytes() for p in tmp_path.glob("optuna.log.torn-*")] == [whole[len(path.read_bytes()):-7]]
    running = optuna.load_study(study_name="s", storage=open_storage(url)).get_trials(states=(TrialState.RUNNING,))
    assert running[0].params == {}  # the torn record was its parameter; the records before it all kept


def test_a_journal_damaged_before_its_end_is_refused_naming_its_line(tmp_path) -> None:
    path = tmp_path / "optuna.log"
    lines = _journal(path).splitlines(keepends=True)
    path.write_bytes(b"".join([*lines[:4], lines[4][:20] + lines[5], *lines[6:]]))  # a torn record, appended onto
    spec = load_study(write_study(tmp_path, tmp_path, name="s", storage=str(path)), check_paths=False)
    with pytest.raises(UserError, match=rf"storage: {path}:5: not a journal record .*the 4 records before it"):
        open_study(spec, StudyDir(tmp_path / "out"))


def test_a_finished_studys_rerun_over_a_dead_runs_lock_says_both_and_writes_nothing(tiny_dirs, tmp_path) -> None:
    spec = _spec(tmp_path, tiny_dirs, "dead")
    run_study(spec, log=lambda m: None)
    sdir = StudyDir(spec.out_dir)
    dead = subprocess.run([sys.executable, "-c", "import os, sys; from lora_sweep.store.api import StudyDir; "
                           "StudyDir(sys.argv[1]).acquire(); os._exit(9)", str(sdir.root)])
    assert dead.returncode == 9
    before = sdir.results_db.read_bytes(), (sdir.root / "timing.json").read_bytes()
    lines: list[str] = []
    summary = run_study(spec, log=lines.append)
    assert summary.already_spent and lines[0].startswith(f"took over {sdir.lock} from pid ")
    assert lines[1:] == ["dead: nothing to run: the budget was already spent (3 trials) before this run: raise "
                         "budget.trials to continue"], lines
    assert (sdir.results_db.read_bytes(), (sdir.root / "timing.json").read_bytes()) == before
    assert sdir.lock.read_text() == "", "released: the next run finds no owner"
