"""``store.storage``: every backend keeps the storage contract (``lora_sweep.testing.storage``); SQLite files in
write-ahead-log mode, commits synced as before."""

from __future__ import annotations

import sqlite3

import optuna
import pytest

from lora_sweep.errors import UserError
from lora_sweep.store.storage import BACKENDS, backend_of, normalize_url, open_storage
from lora_sweep.testing.storage import StorageContract
from tests.conftest import need_module
from tests.helpers import server_url


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


def test_a_url_no_backend_takes_is_one_line() -> None:
    with pytest.raises(UserError, match=r"^storage: no storage takes 'oracle://u:\*\*\*@h/db' \(expected journal://"):
        open_storage("oracle://u:secret@h/db")


def test_every_backend_runs_the_contract() -> None:
    classes = (TestJournalStorageContract, TestSqliteStorageContract, TestPostgresStorageContract,
               TestMysqlStorageContract)
    assert {backend_of(cls.EXAMPLE).name for cls in classes} == {b.name for b in BACKENDS}


def _damaged_journal(path) -> str:  # noqa: ANN001
    """A journal whose second record was torn and continued by a later append (not only at its end)."""
    study = optuna.create_study(study_name="s", storage=open_storage(f"journal://{path}"))
    study.optimize(lambda t: t.suggest_float("x", 0, 1), n_trials=2)
    lines = path.read_bytes().splitlines(keepends=True)
    path.write_bytes(b"".join([lines[0], lines[1][:10] + lines[2], *lines[3:]]))
    return str(path)


class TestJournalStorageContract(StorageContract):
    EXAMPLE = "study.log"

    @pytest.fixture
    def url(self, tmp_path) -> str:  # noqa: ANN001
        return str(tmp_path / "optuna.log")  # a plain path: the journal backend's too

    @pytest.fixture
    def unopenable_url(self, tmp_path) -> str:  # noqa: ANN001
        return _damaged_journal(tmp_path / "damaged.log")

    def test_a_damaged_journal_names_its_first_bad_line(self, tmp_path) -> None:  # noqa: ANN001
        path = _damaged_journal(tmp_path / "optuna.log")
        with pytest.raises(UserError, match=rf"^storage: {path}:2: not a journal record .*the 1 records before it"):
            open_storage(normalize_url(path))


class TestSqliteStorageContract(StorageContract):
    EXAMPLE = "sqlite:///x.db"

    @pytest.fixture
    def url(self, tmp_path) -> str:  # noqa: ANN001
        return f"sqlite:///{tmp_path / 'optuna.db'}"

    @pytest.fixture
    def unopenable_url(self, tmp_path) -> str:  # noqa: ANN001
        (tmp_path / "text.db").write_text("not a database\n" * 100)
        return f"sqlite:///{tmp_path / 'text.db'}"


class TestPostgresStorageContract(StorageContract):
    EXAMPLE = "postgresql+psycopg2://h/db"

    @pytest.fixture
    def url(self) -> str:
        return server_url("postgresql")

    @pytest.fixture
    def unopenable_url(self) -> str:
        need_module("psycopg2", "postgres")
        return "postgresql+psycopg2://u:p@127.0.0.1:9/none"  # nothing listens on port 9


class TestMysqlStorageContract(StorageContract):
    EXAMPLE = "mysql+pymysql://h/db"

    @pytest.fixture
    def url(self) -> str:
        return server_url("mysql")

    @pytest.fixture
    def unopenable_url(self) -> str:
        need_module("pymysql", "mysql")
        return "mysql+pymysql://u:p@127.0.0.1:9/none"
