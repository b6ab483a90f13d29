"""What every storage backend promises, as checks a user's own backend can run from another repository.

Two ways in, the same checks::

    from lora_sweep.testing.storage import check_storage
    check_storage("my:///tmp/x", unopenable_url="my:///dev/null/x")   # raises AssertionError naming the promise

or, under pytest, a class that subclasses the suite (Optuna's ``StorageTestCase`` style)::

    from lora_sweep.testing.storage import StorageContract

    class TestMyStorageContract(StorageContract):
        @pytest.fixture
        def url(self, tmp_path) -> str: return f"my://{tmp_path}/x"          # a fresh storage of the backend
        @pytest.fixture
        def unopenable_url(self, tmp_path) -> str: return ...               # one that cannot be opened

A backend added at run time (``store.storage.BACKENDS.append``) is added in the lock holder's process too:
``holder_setup``, Python statements that process runs first. Nothing in the library imports this module (an import
contract).
"""

from __future__ import annotations

import subprocess
import sys
import time
import uuid

import optuna
import pytest
from optuna.trial import TrialState

from lora_sweep.errors import UserError
from lora_sweep.store import storage
from lora_sweep.store.storage import backend_of, normalize_url, open_storage, storage_lock

__all__ = ["check_storage", "check_url", "check_reopens", "check_lock_waits", "check_unopenable", "StorageContract"]


def check_url(url: str) -> None:
    """Exactly one backend takes the URL, and its normal form is stable."""
    takers = [b.name for b in storage.BACKENDS if b.takes(url)]
    assert takers == [backend_of(url).name], f"backends taking {url}: {takers}"
    assert normalize_url(normalize_url(url)) == normalize_url(url), "normalising the URL again changes it"


def check_reopens(url: str, name: str) -> None:
    """A new storage opens again with its study, trials (states, values, parameters) and attributes as they were."""
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

    assert seen(again) == seen(study) and len(again.trials) == 3, "the trials read back differ"
    assert again.directions == study.directions, "the directions read back differ"
    assert again.user_attrs == {"clock": {"start": 1.5, "banked": 0.0}}, "the study's attributes read back differ"


def check_lock_waits(url: str, name: str, holder_setup: str = "") -> None:
    """Another process holds the study's one-owner lock for 2 s: this one gets it only after."""
    holder = subprocess.Popen([sys.executable, "-c", holder_setup + "\nimport sys, time\n"
                               "from lora_sweep.store.storage import storage_lock\n"
                               "with storage_lock(sys.argv[1], sys.argv[2]):\n    print('held', flush=True)\n"
                               "    time.sleep(2)\n", normalize_url(url), name], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n", "the holder did not take the lock"
        started = time.time()
        with storage_lock(normalize_url(url), name):
            waited = time.time() - started
        assert waited > 1.0, f"took a lock another process holds after {waited:.2f} s"
    finally:
        holder.wait(timeout=30)
    assert holder.returncode == 0, "the lock holder failed"


def check_unopenable(url: str) -> None:
    """A storage that cannot be opened is a one-line ``UserError`` starting ``storage: ``."""
    try:
        open_storage(normalize_url(url))
    except UserError as err:
        assert "\n" not in str(err) and str(err).startswith("storage: "), str(err)
    else:
        raise AssertionError(f"{url} opened; expected a one-line UserError")


def check_storage(url: str, *, unopenable_url: str, holder_setup: str = "", name: str | None = None) -> None:
    """Every promise of the contract, in turn, on a fresh storage ``url``; raises ``AssertionError`` naming the
    first one broken. ``name``: the study's (default: a new one, as a server's database outlives the check)."""
    name = name or f"contract-{uuid.uuid4().hex[:8]}"
    check_url(url)
    check_reopens(url, name)
    check_lock_waits(url, name, holder_setup)
    check_unopenable(unopenable_url)


class StorageContract:
    """The contract as a pytest suite: a subclass provides ``url`` and ``unopenable_url`` (and ``holder_setup``
    for a backend added at run time); each promise is one test."""

    @pytest.fixture
    def url(self) -> str:
        raise NotImplementedError("a subclass provides a fresh storage URL of its backend")

    @pytest.fixture
    def unopenable_url(self) -> str:
        raise NotImplementedError("a subclass provides a URL of its backend that cannot be opened")

    @pytest.fixture
    def holder_setup(self) -> str:
        """Python statements the lock holder's process runs before it takes the lock."""
        return ""

    @pytest.fixture
    def name(self) -> str:
        """A study name of its own: a server's database outlives the test."""
        return f"contract-{uuid.uuid4().hex[:8]}"

    def test_one_backend_takes_the_url_and_keeps_it_as_normalised(self, url: str) -> None:
        check_url(url)

    def test_a_new_storage_opens_again_with_its_trials(self, url: str, name: str) -> None:
        check_reopens(url, name)

    def test_the_one_owner_lock_makes_a_second_owner_wait(self, url: str, name: str, holder_setup: str) -> None:
        check_lock_waits(url, name, holder_setup)

    def test_an_unopenable_storage_is_one_line(self, unopenable_url: str) -> None:
        check_unopenable(unopenable_url)
