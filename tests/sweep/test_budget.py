"""sweep/budget.py: a single run's budget (trials, tokens, wall time: whichever ends first) and what counts."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import optuna
from optuna.trial import TrialState

from lora_sweep.store.api import attrs
from lora_sweep.sweep.budget import budget_state, counted
from lora_sweep.sweep.config.loader import load_study
from lora_sweep.sweep.config.spec import Budget
from tests.conftest import write_study


def _spec(tiny_dirs, tmp_path, **budget):
    return dataclasses.replace(load_study(write_study(tmp_path, tiny_dirs("llama"))), budget=Budget(**budget))


def _counts(study=None, *, finished=0, tokens=0, elapsed=0.0):
    return SimpleNamespace(study=study or optuna.create_study(), sharing=None, finished=finished, tokens=tokens,
                           elapsed=elapsed)


def test_each_budget_stops_the_asking_once_reached(tiny_dirs, tmp_path) -> None:
    spec = _spec(tiny_dirs, tmp_path, trials=6, tokens=1000, wall_time=60.0)
    room = budget_state(spec, _counts(finished=3, tokens=500, elapsed=20.0), live=2, elapsed=10.0, live_tokens=100)
    assert not room.exhausted
    # trials: finished earlier + training now
    spent = budget_state(spec, _counts(finished=4), live=2, elapsed=0.0, live_tokens=0)
    assert (spent.exhausted, spent.key, spent.reason) == (True, "budget.trials", "6 trials")
    # tokens: told earlier + trained so far by the live trials
    spent = budget_state(spec, _counts(tokens=900), live=1, elapsed=0.0, live_tokens=100)
    assert (spent.exhausted, spent.key) == (True, "budget.tokens")
    # wall time: earlier runs' seconds + this run's
    spent = budget_state(spec, _counts(elapsed=50.0), live=0, elapsed=10.0, live_tokens=0)
    assert (spent.exhausted, spent.key, spent.reason) == (True, "budget.wall_time", "60 s of wall time")


def test_the_first_budget_to_end_is_named(tiny_dirs, tmp_path) -> None:
    spec = _spec(tiny_dirs, tmp_path, trials=2, tokens=10)
    assert budget_state(spec, _counts(finished=2, tokens=10), live=0, elapsed=0.0, live_tokens=0).key == "budget.trials"
    only_tokens = _spec(tiny_dirs, tmp_path, tokens=10)  # unset budgets never end the study
    assert not budget_state(only_tokens, _counts(finished=10**6), live=0, elapsed=1e9, live_tokens=9).exhausted


def test_counted_excludes_orphans_and_unfinished_trials() -> None:
    study = optuna.create_study()
    done, pruned, orphan, running = (study.ask() for _ in range(4))
    study.tell(done, 1.0)
    study.tell(pruned, state=TrialState.PRUNED)
    study.tell(orphan, state=TrialState.FAIL)
    study.enqueue_trial({}, user_attrs={attrs.RETRY_OF: orphan.number})  # WAITING: not counted until asked
    trials = study.get_trials(deepcopy=False)
    assert [t.number for t in counted(trials)] == [done.number, pruned.number]
    assert [t.number for t in counted(trials, running=True)] == [done.number, pruned.number, running.number]
