"""sweep/ledger.py: asking, telling, retrying, reaping and heartbeats, through the key table and public Optuna API."""

from __future__ import annotations

import time
from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState

from lora_sweep.store.api import ResultsStore, attrs
from lora_sweep.sweep.ledger import ORPHAN_REASON, Ledger, is_default, orphans


@pytest.fixture
def ledger(tmp_path: Path):
    storage = optuna.storages.RDBStorage(f"sqlite:///{tmp_path / 'optuna.db'}")
    study = optuna.create_study(study_name="s", storage=storage, directions=["minimize"])
    store = ResultsStore(tmp_path / "results.db")
    lines: list[str] = []
    led = Ledger(study, storage, store, lambda n: tmp_path / "adapters" / f"trial-{n}", lines.append)
    led.lines = lines  # type: ignore[attr-defined]
    yield led
    store.close()


def test_ask_with_a_worker_stamps_heartbeat_and_worker(ledger: Ledger) -> None:
    before = time.time()
    trial = ledger.ask(worker=3)
    frozen = ledger.running()[0]
    assert frozen.number == trial.number
    assert frozen.system_attrs[attrs.WORKER] == 3 and frozen.system_attrs[attrs.HEARTBEAT] >= before
    assert ledger.trial_id(trial.number) == ledger.storage.get_trial_id_from_study_id_trial_number(
        ledger.storage.get_study_id_from_name("s"), trial.number)
    alone = ledger.ask()  # a single run: no heartbeat
    assert attrs.HEARTBEAT not in ledger.study.trials[alone.number].system_attrs


def test_tell_records_reason_tokens_and_values_under_the_table_keys(ledger: Ledger) -> None:
    done, pruned = ledger.ask(), ledger.ask()
    Ledger.plan(done, 120)
    Ledger.set_adapter(done, Path("adapters/trial-0"))
    ledger.tell(done, TrialState.COMPLETE, [0.5], tokens=100)
    ledger.tell(pruned, TrialState.PRUNED, [9.0], reason="pruned by cohort SHA at step 6", tokens=40)
    t0, t1 = ledger.study.trials
    assert t0.state == TrialState.COMPLETE and t0.values == [0.5]
    assert t0.user_attrs == {attrs.PLANNED_TOKENS: 120, attrs.TOKENS: 100,
                             attrs.ADAPTER_PATH: str(Path("adapters/trial-0").absolute())}
    assert t1.state == TrialState.PRUNED and t1.values is None  # values only for COMPLETE
    assert t1.user_attrs == {attrs.REASON: "pruned by cohort SHA at step 6", attrs.TOKENS: 40}


def test_requeue_fails_retries_with_the_parameters_and_keeps_the_default_mark(ledger: Ledger, tmp_path) -> None:
    ledger.study.enqueue_trial({"x": 0.25}, user_attrs={attrs.DEFAULT: True})
    trial = ledger.ask()
    trial.suggest_float("x", 0, 1)
    adapter = tmp_path / "adapters" / "trial-0"
    adapter.mkdir(parents=True)
    (adapter / "adapter_model.safetensors").write_bytes(b"half")
    ledger.recover()  # a single run's start: the RUNNING trial is an orphan
    failed, retry = ledger.study.get_trials(deepcopy=False)
    assert failed.state == TrialState.FAIL and not adapter.exists()
    assert retry.state == TrialState.WAITING and retry.params == {} and is_default(retry)
    assert retry.user_attrs[attrs.RETRY_OF] == 0 and orphans(ledger.trials()) == {0}
    assert ledger.store.trial(0).state == "FAIL" and ledger.store.trial(0).reason == ORPHAN_REASON
    assert ledger.lines == ["trial 0 was left RUNNING by a stopped run: failed and enqueued again"]
    again = ledger.ask()
    assert again.suggest_float("x", 0, 1) == 0.25  # the retry draws its enqueued value


def test_requeue_of_a_live_trial_records_its_reason(ledger: Ledger) -> None:
    trial = ledger.ask()
    ledger.requeue([trial], "out of memory at pack step 3", log=lambda m: None)
    assert ledger.study.trials[0].user_attrs[attrs.REASON] == "out of memory at pack step 3"
    assert ledger.store.trial(0).reason == "out of memory at pack step 3"


def test_reap_retries_only_trials_without_a_recent_heartbeat(ledger: Ledger) -> None:
    stale, live = ledger.ask(worker=0), ledger.ask(worker=1)
    ledger.storage.set_trial_system_attr(ledger.trial_id(stale.number), attrs.HEARTBEAT, time.time() - 100)
    assert ledger.reap(grace=10) == [stale.number]
    states = {t.number: t.state for t in ledger.trials()}
    assert states[stale.number] == TrialState.FAIL and states[live.number] == TrialState.RUNNING
    assert ledger.trials()[-1].user_attrs[attrs.RETRY_OF] == stale.number


def test_sync_copies_trials_told_elsewhere(ledger: Ledger) -> None:
    trial = ledger.study.ask()  # another host's worker asks and tells; this store never saw it
    trial.set_user_attr(attrs.ADAPTER_PATH, "/elsewhere/trial-0")
    ledger.study.tell(trial, [1.5])
    ledger.sync()
    row = ledger.store.trial(0)
    assert row.state == "COMPLETE" and row.objective_values == [1.5] and row.adapter_path == "/elsewhere/trial-0"


def test_heartbeat_thread_beats_the_live_trials(ledger: Ledger) -> None:
    trial = ledger.ask()
    with ledger.heartbeat(lambda: [trial.number], interval=0.05):
        deadline = time.time() + 5
        while attrs.HEARTBEAT not in ledger.running()[0].system_attrs and time.time() < deadline:
            time.sleep(0.05)
    assert attrs.HEARTBEAT in ledger.running()[0].system_attrs


def test_storage_url_is_the_shared_one_the_studys_or_the_directorys(tmp_path: Path) -> None:
    from types import SimpleNamespace

    from lora_sweep.store.api import StudyDir
    from lora_sweep.store.storage import Sharing
    from lora_sweep.sweep.ledger import storage_url

    sdir = StudyDir(tmp_path / "run")
    assert storage_url(SimpleNamespace(storage=None), sdir) == sdir.optuna_url  # type: ignore[arg-type]
    plain = SimpleNamespace(storage="studies.log")  # a plain journal path in study.yaml, as workers take it
    assert storage_url(plain, sdir) == f"journal://{Path('studies.log').absolute()}"  # type: ignore[arg-type]
    shared = Sharing(url="sqlite:///shared.db")
    assert storage_url(plain, sdir, shared) == "sqlite:///shared.db"  # type: ignore[arg-type]
