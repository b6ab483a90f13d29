"""Faults a study directory meets: a journal torn mid-append, its lock left by a killed writer."""

from __future__ import annotations

import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import optuna
from optuna.storages import JournalStorage
from optuna.storages.journal import JournalFileBackend
from optuna.trial import TrialState

from lora_sweep.sweep.storage import JournalFlock, open_storage

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
        "import sys, time; from pathlib import Path; from lora_sweep.sweep.storage import JournalFlock; "
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
    import threading

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


