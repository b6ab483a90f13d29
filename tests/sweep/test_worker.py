"""Many workers sharing one study: a journal file, PostgreSQL with a worker killed mid-pack, CPU shares (the storage
lock of every backend: test_storage.py's contract).

The server tests need one: ``.ci/run`` starts PostgreSQL and MariaDB and exports ``LORA_SWEEP_TEST_PG``
(e.g. ``postgresql+psycopg2://sweep:sweep@127.0.0.1:55432/sweep``) and ``LORA_SWEEP_TEST_MYSQL``
(``mysql+pymysql://sweep:sweep@127.0.0.1:53306/sweep``). Outside CI they are skipped without them.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import time
import uuid
from collections import Counter
from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState

from lora_sweep.store.api import StudyDir
from lora_sweep.store.attrs import WORKER
from lora_sweep.store.storage import Sharing, normalize_url
from lora_sweep.sweep import worker
from lora_sweep.sweep.affinity import allowed_cpus
from lora_sweep.sweep.config.loader import load_study
from lora_sweep.sweep.ledger import open_study
from tests.helpers import WORKER_ENV, cli, server_url, stored_trials, worker_study

ROOT = Path(__file__).resolve().parents[2]


def _check_study(trials: list[optuna.trial.FrozenTrial], budget: int, artifacts: Path) -> None:
    """Exactly the budget COMPLETE, each orphan retried once with its parameters, every adapter on disk."""
    complete = [t for t in trials if t.state == TrialState.COMPLETE]
    assert len(complete) == budget, Counter(t.state.name for t in trials)
    assert not [t for t in trials if t.state in (TrialState.RUNNING, TrialState.WAITING)]
    failed = {t.number: t for t in trials if t.state == TrialState.FAIL}
    retries = [t.user_attrs["retry_of"] for t in trials if "retry_of" in t.user_attrs]
    assert sorted(retries) == sorted(failed), "every failed trial is an orphan retried exactly once"
    for t in trials:  # a trial killed while its parameters were drawn keeps those drawn, draws the rest
        if "retry_of" in t.user_attrs:
            orphan = failed[t.user_attrs["retry_of"]].params
            assert {k: t.params[k] for k in orphan} == orphan
    for t in complete:
        assert Path(t.user_attrs["adapter_path"]) == artifacts / f"trial-{t.number}"
        assert (artifacts / f"trial-{t.number}" / "adapter_model.safetensors").is_file()


def test_journal_workers_on_one_host_share_the_budget(tiny_dirs, tmp_path) -> None:
    name = "journal"
    path = worker_study(tmp_path, tiny_dirs("llama"), name, budget={"trials": 4},
                        train={"max_steps": 10, "micro_batch": 4})
    log = tmp_path / "optuna-journal.log"
    started = time.time()
    result = subprocess.run(cli("run", str(path), "--workers", "2", "--storage", str(log), "--heartbeat", "1",
                                "--grace", "10"), capture_output=True, text=True, timeout=180, cwd=ROOT,
                            env=WORKER_ENV)
    assert result.returncode == 0, result.stderr + "".join(
        p.read_text() for p in (tmp_path / f"runs-{name}" / "workers").glob("*.log"))
    trials = stored_trials(f"journal://{log}", name)
    _check_study(trials, 4, tmp_path / "shared-adapters" / name)
    assert not [t for t in trials if t.state == TrialState.FAIL]
    workers = Counter(t.system_attrs[WORKER] for t in trials)
    assert set(workers) <= {0, 1}, workers  # which worker trains what depends on timing
    assert "4 complete" in result.stdout and time.time() - started < 180
    # The study directory's store knows every trial and its adapter: export works from it.
    out = tmp_path / "exported"
    exported = subprocess.run(cli("export", str(tmp_path / f"runs-{name}"), "--trial", "0", "--out", str(out),
                                  "--no-vllm"), capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert exported.returncode == 0, exported.stderr
    assert (out / "adapter_model.safetensors").is_file()
    # ... and the report opens the journal storage for its Optuna figures.
    from lora_sweep.reports._load import load_optuna_study, load_study_data

    study = load_optuna_study(load_study_data(tmp_path / f"runs-{name}"))
    assert not isinstance(study, str), study
    assert len(study.trials) == 4


def test_pg_three_workers_one_killed_mid_pack(tiny_dirs, tmp_path) -> None:
    url = server_url("postgresql")
    name = f"pg-{uuid.uuid4().hex[:8]}"
    # 100 steps a trial, not the helper's 20: at 20 the time between the first COMPLETE and the last trial's end was
    # about 1 s on CPU-G (0.4 s a trial), and a CI run whose polls missed it failed; at 100 it is about 2.5 s.
    path = worker_study(tmp_path, tiny_dirs("llama"), name, train={"max_steps": 100, "micro_batch": 4})
    procs = [subprocess.Popen(cli("worker", str(path), "--storage", url, "--index", str(i), "--heartbeat", "0.5",
                                  "--grace", "4", "--quiet"), cwd=ROOT, env=WORKER_ENV, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, start_new_session=True) for i in range(3)]
    victim, killed, seen = None, [], [f"{0.0:.1f} s: started"]
    started = time.time()
    # Kill a worker while it trains, once some trial is complete; stop looking once every worker has ended.
    while time.time() < started + 120 and any(p.poll() is None for p in procs):
        time.sleep(0.2)
        try:
            trials = stored_trials(url, name)
            now = str(dict(Counter(t.state.name for t in trials)))
        except Exception as exc:  # the study is made by the first worker to start
            trials, now = [], type(exc).__name__
        if not seen[-1].endswith(now):  # what the test saw, for the message if no kill came
            seen.append(f"{time.time() - started:.1f} s: {now}")
        running = sorted((t for t in trials if t.state == TrialState.RUNNING and WORKER in t.system_attrs),
                         key=lambda t: t.datetime_start)
        if running and any(t.state == TrialState.COMPLETE for t in trials):
            # Which worker trains what depends on timing: take the one whose trial started last, the
            # furthest from its end (a trial of 100 steps lasts about 2 s on one thread).
            index = running[-1].system_attrs[WORKER]
            victim = procs[index]
            # Frozen first, so that its trials cannot end between looking at them and the kill.
            os.killpg(victim.pid, signal.SIGSTOP)
            time.sleep(0.5)  # a live worker names its new trial a few ms after asking; a frozen one may never
            killed = [t for t in stored_trials(url, name)
                      if t.state == TrialState.RUNNING and t.system_attrs.get(WORKER, index) == index]
            if not killed:  # it was between packs: let it go on, and look again
                os.killpg(victim.pid, signal.SIGCONT)
                victim = None
                continue
            os.killpg(victim.pid, signal.SIGKILL)
            victim.wait()
            break
    if not killed:
        for p in procs:  # none left behind to share the next tests' cores
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
        tails = "".join(f"\nworker {i}, exit {p.wait()}: {p.stderr.read().decode()[-800:]}"
                        for i, p in enumerate(procs))
        pytest.fail("a worker must be killed mid-pack, with trials still training; seen: "
                    + "; ".join(seen[-12:]) + tails)
    for p in procs:
        if p is not victim:
            _, err = p.communicate(timeout=150)
            assert p.returncode == 0, err.decode()[-3000:]
    trials = stored_trials(url, name)
    _check_study(trials, 9, tmp_path / "shared-adapters" / name)
    assert {t.number for t in trials if t.state == TrialState.FAIL} == {t.number for t in killed}
    params = [tuple(sorted(t.params.items())) for t in trials if t.state == TrialState.COMPLETE]
    for orphan in killed:  # the killed worker's trials were trained once more, not twice
        assert params.count(tuple(sorted(orphan.params.items()))) <= 1


def _one_line_exit_2(result: subprocess.CompletedProcess, expected: str) -> None:
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert expected in lines[0], lines[0]


def test_unreachable_postgres_url_is_one_line_exit_2(tiny_dirs, tmp_path) -> None:
    path = worker_study(tmp_path, tiny_dirs("llama"), "unreachable")
    result = subprocess.run(cli("worker", str(path), "--storage", "postgresql+psycopg2://u:p@127.0.0.1:9/none",
                                "--quiet"), capture_output=True, text=True, timeout=120, cwd=ROOT)
    # without the postgres extra the URL's driver is what is missing (the README's install has no extras)
    installed = importlib.util.find_spec("psycopg2") is not None
    _one_line_exit_2(result, "storage: cannot open" if installed else "needs the psycopg2 driver")
    assert ":p@" not in result.stderr


def _backend_url(backend: str, tmp_path: Path) -> str:
    return normalize_url(str(tmp_path / f"{backend}.log")) if backend == "journal" else server_url(backend)


@pytest.mark.parametrize("backend", ["journal", "postgresql", "mysql"])
def test_other_search_space_under_the_same_name_is_one_line_exit_2(tiny_dirs, tmp_path, backend: str) -> None:
    url = _backend_url(backend, tmp_path)
    name = f"space-{uuid.uuid4().hex[:8]}"
    first = load_study(worker_study(tmp_path, tiny_dirs("llama"), name))
    open_study(first, StudyDir(first.out_dir), Sharing(normalize_url(url)))  # the study exists, no training
    other = worker_study(tmp_path, tiny_dirs("llama"), name, search={"rank": [2, 4]})
    result = subprocess.run(cli("worker", str(other), "--storage", url, "--quiet"), capture_output=True,
                            text=True, timeout=120, cwd=ROOT)
    _one_line_exit_2(result, "with a different search space")


@pytest.mark.parametrize(("user", "expected"), [(None, "4"), ("3", "3")])
def test_launch_gives_each_worker_its_share_of_the_cpus(tiny_dirs, tmp_path, monkeypatch, user, expected) -> None:
    """Each of N workers is pinned to its own cores // N CPUs and sizes torch's thread pool to them (torch
    would give every one of them all the cores); a user's own OMP_NUM_THREADS is kept."""
    calls: list[tuple[list[str], dict[str, str]]] = []

    class _Done:
        returncode = 0

        def poll(self) -> int:
            return 0

    monkeypatch.setattr(worker.subprocess, "Popen", lambda cmd, **kw: calls.append((cmd, kw["env"])) or _Done())
    monkeypatch.setattr(worker, "allowed_cpus", lambda: list(range(8, 16)))
    if user is None:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    else:
        monkeypatch.setenv("OMP_NUM_THREADS", user)
    path = worker_study(tmp_path, tiny_dirs("llama"), "threads")
    spec = load_study(path)
    assert worker.launch(str(path), (), spec, f"journal://{tmp_path / 'j.log'}", 2, heartbeat=1, grace=5) == [0, 0]
    assert [env["OMP_NUM_THREADS"] for _, env in calls] == [expected, expected]
    assert [cmd[cmd.index("--cpus") + 1] for cmd, _ in calls] == ["8-11", "12-15"]


def test_worker_cpus_pins_the_process_and_bad_lists_are_one_line_exit_2(tmp_path) -> None:
    cpu = min(allowed_cpus())
    code = f"from lora_sweep.sweep.affinity import pin; import os; pin('{cpu}'); print(sorted(os.sched_getaffinity(0)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.stdout.strip() == f"[{cpu}]", out.stderr
    for bad, why in (("x", "not a CPU list"), ("100000", "this process may use")):
        result = subprocess.run(cli("worker", str(tmp_path / "missing.yaml"), "--cpus", bad), capture_output=True,
                                text=True, timeout=60, cwd=ROOT)
        _one_line_exit_2(result, why)
