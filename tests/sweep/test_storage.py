"""``sweep.storage.open_storage`` on SQLite: the file in write-ahead-log mode, commits synced as before."""

from __future__ import annotations

import sqlite3

import optuna
import pytest

from lora_sweep.sweep.storage import open_storage


def _journal_mode(db) -> str:
    conn = sqlite3.connect(db)
    try:
        return conn.execute("PRAGMA journal_mode").fetchone()[0]
    finally:
        conn.close()


def test_a_new_sqlite_storage_is_a_wal_file_optuna_reads_back(tmp_path) -> None:
    db = tmp_path / "optuna.db"
    storage = open_storage(f"sqlite:///{db}")
    study = optuna.create_study(study_name="s", storage=storage, directions=["minimize", "minimize"])
    trial = study.ask()
    trial.suggest_float("lr", 1e-4, 1e-2, log=True)
    study.tell(trial, [1.0, 2.0])
    assert _journal_mode(db) == "wal"
    assert storage.engine.connect().exec_driver_sql("PRAGMA synchronous").scalar() == 2  # FULL: durable commits
    # a second process-like reader (another storage object) sees every commit
    again = optuna.load_study(study_name="s", storage=open_storage(f"sqlite:///{db}"))
    assert [(t.state, t.values, t.params) for t in again.trials] == [(t.state, t.values, t.params)
                                                                      for t in study.trials]


def test_an_existing_rollback_journal_file_is_switched_and_keeps_its_studies(tmp_path) -> None:
    db = tmp_path / "old.db"
    old = optuna.storages.RDBStorage(f"sqlite:///{db}")  # what earlier versions wrote: journal_mode=delete
    optuna.create_study(study_name="old", storage=old).optimize(lambda t: t.suggest_float("x", 0, 1), n_trials=1)
    old.engine.dispose()
    assert _journal_mode(db) == "delete"
    study = optuna.load_study(study_name="old", storage=open_storage(f"sqlite:///{db}"))
    assert _journal_mode(db) == "wal" and list(study.trials[0].params) == ["x"] and study.trials[0].value is not None


def test_a_missing_folder_is_left_to_optuna_and_creates_nothing(tmp_path) -> None:
    with pytest.raises(Exception, match="unable to open database file"):
        open_storage(f"sqlite:///{tmp_path / 'nowhere' / 'x.db'}")
    assert not (tmp_path / "nowhere").exists()
