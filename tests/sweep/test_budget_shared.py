"""Token and wall-time budgets: one run stops asking once a budget is reached, and workers sharing a
study stop at the same rule over the study's totals (``sweep.budget.shared_budget``), not each their own.

The token rule, for one run and for workers alike: no trial starts once the tokens trained reach the
budget, and the trials training then finish, so ``budget <= total < budget + slots * T`` where T is a
full trial's tokens and ``slots`` one worker's pack. The MySQL variant needs a server: ``.ci/run``
starts MariaDB and exports ``LORA_SWEEP_TEST_MYSQL``; outside CI it is skipped without it.
"""

from __future__ import annotations

import dataclasses
import sqlite3
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState
from transformers import AutoTokenizer

from lora_sweep.packer.data.rows import load_examples
from lora_sweep.store.attrs import CLOCK, HEARTBEAT, PLANNED_TOKENS, TOKENS
from lora_sweep.store.storage import open_storage, resume_clock, study_elapsed
from lora_sweep.sweep.budget import TokenPlan, shared_budget
from lora_sweep.sweep.config.loader import load_study
from lora_sweep.sweep.config.spec import Budget, StudySpec
from lora_sweep.sweep.study import run_study
from tests.conftest import DEMO_DATA, optuna_study, write_study
from tests.helpers import WORKER_ENV, cli, server_url, stored_trials, worker_study

ROOT = Path(__file__).resolve().parents[2]

SMALL = {"max_steps": 10, "micro_batch": 4}
NO_DEFAULT = {"rank": [2, 4, 8], "lr": {"low": 1e-4, "high": 3e-2, "log": True}}  # no community-default trial


def _full_trial_tokens(model_dir: Path) -> int:
    """T: the target tokens of a full trial of the SMALL schedule (every trial reads the same batches)."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    examples = load_examples(DEMO_DATA / "arith-train.jsonl", tokenizer, fmt="prompt_completion", max_length=48)
    return TokenPlan(examples, seed=0)(SMALL["micro_batch"], SMALL["max_steps"])


def _check_tokens(trials: list[optuna.trial.FrozenTrial], store_db: Path, budget: int, slots: int, full: int) -> None:
    """Every trial trained its planned T tokens (the store agrees), and the total obeys the rule above."""
    with sqlite3.connect(store_db) as db:
        stored = dict(db.execute("select number, tokens from trials"))
    assert trials and all(t.state == TrialState.COMPLETE for t in trials), [t.state.name for t in trials]
    for t in trials:
        assert t.user_attrs[TOKENS] == t.user_attrs[PLANNED_TOKENS] == stored[t.number] == full, t.number
    total = sum(t.user_attrs[TOKENS] for t in trials)
    assert budget <= total < budget + slots * full, (total, budget, full)


def test_one_run_stops_asking_once_the_tokens_trained_reach_the_budget(tiny_dirs, tmp_path) -> None:
    """Trials told during the run count too (they did not: a token budget above one pack never ended)."""
    full = _full_trial_tokens(tiny_dirs("llama"))
    budget = int(2.5 * full)
    spec = load_study(write_study(tmp_path, tiny_dirs("llama"), "tokens-one", search=NO_DEFAULT, train=SMALL,
                                  objectives=[{"metric": "eval_loss", "direction": "minimize"}],
                                  budget={"tokens": budget, "trials": 12}, pruning={"kind": "none"},
                                  pack={"max_slots": 2}, evaluators=[{"name": "heldout_loss"}]))
    run_study(spec, log=lambda m: None)
    trials = optuna_study(spec.out_dir, "tokens-one").trials
    _check_tokens(trials, spec.out_dir / "results.db", budget, slots=2, full=full)


@pytest.mark.parametrize("backend", ["journal", "mysql"])
def test_workers_stop_at_the_shared_token_budget(tiny_dirs, tmp_path, backend: str) -> None:
    """Two one-slot workers together train what one one-slot run would: each trial T, so exactly 4 trials
    for a budget of 3.5 T (workers counting only their own tokens train 4 each; counting another worker's
    training trial as nothing, they start a fifth)."""
    url = str(tmp_path / "tokens.log") if backend == "journal" else server_url("mysql")
    name = f"tokens-{uuid.uuid4().hex[:8]}"
    full = _full_trial_tokens(tiny_dirs("llama"))
    budget = int(3.5 * full)
    path = worker_study(tmp_path, tiny_dirs("llama"), name, search=NO_DEFAULT, train=SMALL,
                        budget={"tokens": budget, "trials": 12}, pack={"max_slots": 1})
    result = subprocess.run(cli("run", str(path), "--workers", "2", "--storage", url, "--heartbeat", "1",
                                "--grace", "20"), capture_output=True, text=True, cwd=ROOT, env=WORKER_ENV,
                            timeout=900)  # a hang's bound: three processes' imports took 132 s of 150 on a loaded host
    out = tmp_path / f"runs-{name}"
    assert result.returncode == 0, result.stderr + "".join(p.read_text() for p in (out / "workers").glob("*.log"))
    url = url if backend == "mysql" else f"journal://{url}"
    _check_tokens(stored_trials(url, name), out / "results.db", budget, slots=1, full=full)


JOIN_ON_SIGNAL = """
import os, sys, time
from pathlib import Path
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as the command line sets it, before torch is imported
import lora_sweep.sweep.study, lora_sweep.sweep.worker  # what a worker imports before it joins
from lora_sweep.cli import main
ready, go, args = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3:]
ready.touch()
while not go.exists():
    time.sleep(0.05)
sys.argv = ["sweep", *args]
main()
"""
"""``sweep worker ARGS`` once its imports are made and the file GO exists (READY written in between)."""


def _wait(condition: Callable[[], bool], what: str, bound: float = 900.0) -> None:
    """Poll ``condition`` until it holds; ``bound`` only catches a hang."""
    deadline = time.time() + bound
    while not condition():
        assert time.time() < deadline, f"waited {bound:.0f} s for {what}"
        time.sleep(0.1)


def test_workers_start_no_trial_after_the_shared_deadline(tiny_dirs, tmp_path) -> None:
    """A worker that joins late stops at the study's deadline, not at its own start plus the wall time."""
    wall = 12.0
    log = tmp_path / "wall.log"
    path = worker_study(tmp_path, tiny_dirs("llama"), "wall", search=NO_DEFAULT, train=SMALL,
                        budget={"wall_time": wall}, pack={"max_slots": 1})

    args = ("worker", str(path), "--storage", str(log), "--heartbeat", "0.5", "--grace", "5", "--quiet")
    ready, go = tmp_path / "late-ready", tmp_path / "late-go"
    # The late worker has made its imports (seconds, or a minute on a loaded 2-core host) before the first starts
    # the clock, and joins on a signal once it has: it joins within the wall time however slow the host, where a
    # worker started after the clock could still be importing when the study's deadline passed.
    late = subprocess.Popen([sys.executable, "-c", JOIN_ON_SIGNAL, str(ready), str(go), *args, "--index", "1"],
                            cwd=ROOT, env=WORKER_ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _wait(lambda: ready.exists() or late.poll() is not None, "the late worker's imports")
    launched = time.time()
    procs = [subprocess.Popen(cli(*args, "--index", "0"), cwd=ROOT, env=WORKER_ENV, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE), late]
    storage = open_storage(f"journal://{log}")

    def clock_started() -> bool:  # the second worker joins once the first has started the clock
        try:
            return CLOCK in optuna.load_study(study_name="wall", storage=storage).user_attrs
        except KeyError:  # the study does not exist yet
            return procs[0].poll() is not None

    _wait(clock_started, "the first worker's clock")
    go.touch()
    for p in procs:
        _, err = p.communicate(timeout=900)  # a hang's bound
        assert p.returncode == 0, err.decode()[-3000:]
    study = optuna.load_study(study_name="wall", storage=storage)
    clock = study.user_attrs[CLOCK]
    starts = sorted(t.datetime_start.timestamp() for t in study.trials)
    assert clock["banked"] == 0 and launched <= clock["start"] <= starts[0], (clock, launched, starts[:1])
    assert all(t.state == TrialState.COMPLETE for t in study.trials), [t.state.name for t in study.trials]
    # The budget is checked under the lock just before the ask stamps the start: allow that instant.
    assert starts[-1] <= clock["start"] + wall + 0.5, (starts[-1] - clock["start"], wall)
    assert starts[-1] >= clock["start"] + wall / 2, "the workers stopped long before the deadline"


def _shared_spec(tiny_dirs: Callable[[str], Path], tmp_path: Path, **budget: int) -> StudySpec:
    spec = load_study(write_study(tmp_path, tiny_dirs("llama")))
    return dataclasses.replace(spec, budget=Budget(**budget))


def test_shared_budget_counts_told_planned_and_own_tokens(tiny_dirs, tmp_path) -> None:
    study = optuna.create_study()
    done = study.ask()
    done.set_user_attr(PLANNED_TOKENS, 100)
    done.set_user_attr(TOKENS, 60)  # pruned: trained less than planned
    study.tell(done, 1.0)
    for _ in range(2):  # one trains in another worker, one here (30 tokens so far)
        study.ask().set_user_attr(PLANNED_TOKENS, 100)
    orphan = study.ask()  # killed after recording its tokens, before its tell: failed and retried
    orphan.set_user_attr(PLANNED_TOKENS, 100)
    orphan.set_user_attr(TOKENS, 100)
    study.tell(orphan, state=TrialState.FAIL)
    study.enqueue_trial({}, user_attrs={"retry_of": orphan.number})  # WAITING: counts once asked
    mine = {2}
    # 60 told + 100 planned elsewhere + 30 trained here = 190 tokens; 3 trials (the orphan does not count)
    for budget, exhausted in (({"tokens": 191}, False), ({"tokens": 190}, True), ({"trials": 4}, False),
                              ({"trials": 3}, True)):
        state = shared_budget(_shared_spec(tiny_dirs, tmp_path, **budget), study, mine=mine, live_tokens=30)
        assert state.exhausted is exhausted, (budget, state)
    assert shared_budget(_shared_spec(tiny_dirs, tmp_path, tokens=260), study).exhausted  # 60 + 2 * 100


def test_study_clock_counts_only_while_workers_run(tmp_path) -> None:
    storage = optuna.storages.InMemoryStorage()
    study = optuna.create_study(storage=storage)
    t0 = time.time()
    resume_clock(study, grace=10, earlier=7.0, now=t0)  # 7 s of earlier single runs
    assert study_elapsed(study, now=t0 + 5) == pytest.approx(12.0)
    trial = study.ask()  # activity now, within the grace: a worker joining later changes nothing
    resume_clock(study, grace=10, now=t0 + 8)
    assert study.user_attrs[CLOCK] == {"start": t0, "banked": 7.0}
    trial_id = storage.get_trial_id_from_study_id_trial_number(storage.get_study_id_from_name(study.study_name),
                                                                 trial.number)
    storage.set_trial_system_attr(trial_id, HEARTBEAT, t0 + 100)  # a live worker beats
    resume_clock(study, grace=10, now=t0 + 105)
    assert study.user_attrs[CLOCK]["start"] == t0
    # Its worker died at t0 + 100; the study stood still until a worker came back at t0 + 1000.
    resume_clock(study, grace=10, now=t0 + 1000)
    assert study.user_attrs[CLOCK] == {"start": t0 + 1000, "banked": pytest.approx(107.0)}
    assert study_elapsed(study, now=t0 + 1010) == pytest.approx(117.0)
