"""sweep/session.py: one owner per study directory, and the resolved spec recorded and compared on resume."""

from __future__ import annotations

import dataclasses
import os
import socket

import pytest
import yaml

from lora_sweep.errors import UserError
from lora_sweep.store.api import ResultsStore, StudyDir
from lora_sweep.sweep.config.loader import load_study
from lora_sweep.sweep.config.spec import Budget
from lora_sweep.sweep.session import own_directory, record_spec, spec_changes, spec_record
from tests.conftest import write_study


@pytest.fixture
def spec(tiny_dirs, tmp_path):
    return load_study(write_study(tmp_path, tiny_dirs("llama"), storage="postgresql://u:secret@db/x"))


def test_a_second_owner_is_refused_in_one_line(tmp_path) -> None:
    sdir = StudyDir(tmp_path / "runs")
    lines: list[str] = []
    with own_directory(sdir, lines.append):
        with pytest.raises(UserError, match=f"pid {os.getpid()} on host {socket.gethostname()}") as err:
            own_directory(sdir, lines.append)
        assert "\n" not in str(err.value) and "--join" not in str(err.value)
    with own_directory(sdir, lines.append, storage="postgresql://u:secret@db/x"):  # released: taken again
        assert "secret" not in sdir.lock.read_text()  # the shared storage is recorded for --join, no password
        with pytest.raises(UserError, match="join it with --join"):
            own_directory(sdir, lines.append)
    assert lines == []  # released cleanly each time: nothing taken over


def test_spec_record_is_plain_data_without_the_password(spec) -> None:
    record = spec_record(spec)
    assert record["storage"] == "postgresql://u@db/x"
    assert record["train"]["max_steps"] == 12 and record["budget"]["trials"] == 6
    assert set(record["search"]) >= {"rank", "lr", "target_sets"}
    assert yaml.safe_load(yaml.safe_dump(record)) == record


def test_only_fixed_settings_count_as_changes(spec) -> None:
    before = spec_record(spec)
    resumable = spec_record(dataclasses.replace(spec, budget=Budget(trials=60)))
    assert spec_changes(before, resumable) == []  # budget, output, pack, ... may change on resume
    fixed = spec_record(dataclasses.replace(spec, train=dataclasses.replace(spec.train, max_steps=30)))
    assert spec_changes(before, fixed) == ["train.max_steps changed (12 -> 30)"]
    named_packing = {("packing" if k == "pack" else k): v for k, v in before.items()}  # the section's other name
    assert spec_changes(named_packing, before) == []


def test_record_spec_writes_store_and_directory_and_refuses_a_changed_key(spec, tmp_path) -> None:
    sdir = StudyDir(tmp_path / "study").create()
    lines: list[str] = []
    with ResultsStore(sdir.results_db) as store:
        record_spec(spec, sdir, store, lines.append)
        assert store.meta()["spec"] == spec_record(spec)
        assert yaml.safe_load(sdir.study_yaml.read_text()) == spec_record(spec)
        changed = dataclasses.replace(spec, train=dataclasses.replace(spec.train, max_steps=30), seed=5)
        first = r"^run: train.max_steps changed \(12 -> 30\) since the study started \(and 1 more\)"
        with pytest.raises(UserError, match=first):
            record_spec(changed, sdir, store, lines.append)
        assert store.meta()["spec"] == spec_record(spec)  # refused: nothing rewritten
        record_spec(changed, sdir, store, lines.append, allow_changes=True)
        assert store.meta()["spec"]["train"]["max_steps"] == 30
    assert sorted(lines) == ["resuming with seed changed (0 -> 5) (--allow-changes)",
                             "resuming with train.max_steps changed (12 -> 30) (--allow-changes)"]
