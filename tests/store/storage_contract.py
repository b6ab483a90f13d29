"""What every storage backend promises, as a suite a backend's tests subclass (Optuna's ``StorageTestCase`` style).

A subclass provides two fixtures and inherits every test::

    class TestMyStorageContract(StorageContract):
        @pytest.fixture
        def url(self, tmp_path) -> str: return f"my://{tmp_path}/x"          # a fresh storage of the backend
        @pytest.fixture
        def unopenable_url(self, tmp_path) -> str: return ...               # one that cannot be opened

Servers (PostgreSQL, MariaDB) come from CI (``tests.helpers.server_url``): without one, or without its driver, the
test is skipped naming what is missing (``tests.conftest.missing``; ``LORA_SWEEP_REQUIRE_EXTRAS=1`` makes it fail).
"""

from __future__ import annotations

import subprocess
import sys
import time
import uuid
from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState

from lora_sweep.errors import UserError
from lora_sweep.store import storage
from lora_sweep.store.storage import backend_of, normalize_url, open_storage, storage_lock

ROOT = Path(__file__).resolve().parents[2]
class StorageContract:
    """The contract: the URL's backend opens a new storage and opens it again with the study and its trials as
    they were, its one-owner lock makes a second owner wait, and a storage that cannot be opened is one line."""

    @pytest.fixture
    def url(self) -> str:
        raise NotImplementedError("a subclass provides a fresh storage URL of its backend")

    @pytest.fixture
    def unopenable_url(self) -> str:
        raise NotImplementedError("a subclass provides a URL of its backend that cannot be opened")

    @pytest.fixture
    def holder_setup(self) -> str:
        """Python statements a second process runs before it takes the lock (a backend of one's own appends itself
        to ``store.storage.BACKENDS`` there, as in the process under test)."""
        return ""

    @pytest.fixture
    def name(self) -> str:
        """A study name of its own: a server's database outlives the test."""
        return f"contract-{uuid.uuid4().hex[:8]}"

    def test_one_backend_takes_the_url_and_keeps_it_as_normalised(self, url: str) -> None:
        assert [b for b in storage.BACKENDS if b.takes(url)] == [backend_of(url)]
        assert normalize_url(normalize_url(url)) == normalize_url(url)

    def test_a_new_storage_opens_again_with_its_trials(self, url: str, name: str) -> None:
        study = optuna.create_study(study_name=name, storage=open_storage(normalize_url(url)),
                                    directions=["minimize", "maximize"])
        study.set_user_attr("clock", {"start": 1.5, "banked": 0.0})
        for i, state in enumerate([TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL]):
            trial = study.ask()
            trial.suggest_float("lr", 1e-4, 1e-2, log=True)
            trial.suggest_categorical("rank", [4, 8, 16])
            trial.set_user_attr("slot", i)
            study.tell(trial, [0.5 + i, 2.0 * i] if state == TrialState.COMPLETE else None, state=state)
        again = optuna.load_study(study_name=name, storage=open_storage(normalize_url(url)))

        def seen(s: optuna.Study) -> list[tuple]:
            return [(t.number, t.state, t.values, t.params, t.user_attrs) for t in s.get_trials()]

        assert seen(again) == seen(study) and len(again.trials) == 3
        assert again.directions == study.directions and again.user_attrs == {"clock": {"start": 1.5, "banked": 0.0}}

    def test_the_one_owner_lock_makes_a_second_owner_wait(self, url: str, name: str, holder_setup: str) -> None:
        """Another process holds the study's lock for 2 s: this one gets it only after."""
        holder = subprocess.Popen([sys.executable, "-c", holder_setup + "\nimport sys, time\n"
                                   "from lora_sweep.store.storage import storage_lock\n"
                                   "with storage_lock(sys.argv[1], sys.argv[2]):\n    print('held', flush=True)\n"
                                   "    time.sleep(2)\n", normalize_url(url), name], cwd=ROOT,
                                  stdout=subprocess.PIPE, text=True)
        try:
            assert holder.stdout is not None and holder.stdout.readline() == "held\n"
            started = time.time()
            with storage_lock(normalize_url(url), name):
                waited = time.time() - started
            assert waited > 1.0, f"took a lock another process holds after {waited:.2f} s"
        finally:
            holder.wait(timeout=30)
        assert holder.returncode == 0

    def test_an_unopenable_storage_is_one_line(self, unopenable_url: str) -> None:
        with pytest.raises(UserError) as err:
            open_storage(normalize_url(unopenable_url))
        assert "\n" not in str(err.value) and str(err.value).startswith("storage: "), str(err.value)
