"""Workers: many processes (one per GPU, or many hosts) sharing one study through its Optuna storage.

``run_worker`` is ``sweep worker``: it runs packs (``sweep.study.run_study`` with ``sharing``) while
the shared budget has room, then stays until no other worker has a RUNNING trial, retrying the
trials of workers that died (stale heartbeat), so the study ends with exactly its budget.
``launch`` is ``sweep run --workers N``: one ``sweep worker`` process per visible GPU (pinned with
``CUDA_VISIBLE_DEVICES``; N CPU workers on a host without one), each on its own share of the host's
cores (``sweep.affinity``), and the combined progress, polled from the storage.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from functools import partial
from pathlib import Path

import optuna

from lora_sweep.store.api import ResultsStore, StudyDir
from lora_sweep.store.storage import Sharing, open_storage, storage_lock
from lora_sweep.sweep.affinity import allowed_cpus, cpu_list, cpu_shares
from lora_sweep.sweep.budget import shared_budget
from lora_sweep.sweep.config.spec import StudySpec
from lora_sweep.sweep.ledger import Ledger, storage_url
from lora_sweep.sweep.ranks import Channel
from lora_sweep.sweep.session import trial_adapter_dir
from lora_sweep.sweep.study import Progress, RunSummary, run_study

__all__ = ["run_worker", "launch", "study_counts", "with_storage"]

WAIT_POLL_S = 0.5
"""How often a worker whose pack drained looks for the end of the others' RUNNING trials."""


def run_worker(spec: StudySpec, sharing: Sharing, *, progress: Callable[[Progress], None] | None = None,
               log: Callable[[str], None] = print, allow_changes: bool = False,
               ranks: Channel | None = None) -> RunSummary:
    """Run packs of the shared study until its budget is spent and no worker trains; totals of all packs.

    ``ranks``: this worker is rank 0 of a sharded pack (``sweep.ranks``): the other ranks train each of its packs
    and are told the end when it returns.
    """
    total = RunSummary(pack_id=-1)
    while True:
        done = run_study(spec, progress=progress, log=log, sharing=sharing, allow_changes=allow_changes, ranks=ranks)
        for name in ("steps", "tokens", "wall_s", "complete", "pruned", "failed"):
            setattr(total, name, getattr(total, name) + getattr(done, name))
        total.pack_id = done.pack_id
        if not _wait_for_others(spec, sharing, log):
            if ranks is not None:  # not after an error: the others may be inside a collective (torchrun ends them)
                ranks.send("end")
            return total


def _wait_for_others(spec: StudySpec, sharing: Sharing, log: Callable[[str], None]) -> bool:
    """After this worker's pack drained: True when the shared budget has room again, False when the study is done.

    Room comes back when a dead worker's trials are failed and retried (they no longer count) or, for
    tokens, when another worker's trial is pruned or fails short of its planned tokens: run another
    pack. Spent with no trial RUNNING anywhere, the study is done. Waiting meanwhile lets this worker
    reap the trials of workers that die, so none stays RUNNING.
    """
    storage = open_storage(sharing.url)
    study = optuna.load_study(study_name=spec.name, storage=storage)
    sdir = StudyDir(spec.out_dir)
    store = ResultsStore(sdir.results_db)
    ledger = Ledger(study, storage, store, partial(trial_adapter_dir, spec, sdir), log)
    try:
        while True:
            with storage_lock(sharing.url, spec.name):
                ledger.reap(sharing.grace)
                budget = shared_budget(spec, study)
                running = ledger.running()
            if not budget.exhausted:
                return True
            if not running:
                return False
            # Not the heartbeat: the last RUNNING trial's end should end this worker at once, as it does
            # the one that ran it (the study's makespan waits for the slowest worker to notice).
            time.sleep(min(sharing.heartbeat, WAIT_POLL_S))
    finally:
        store.close()


def study_counts(url: str, name: str) -> Counter[str]:
    """Trials of study ``name`` in storage ``url`` by state name."""
    study = optuna.load_study(study_name=name, storage=open_storage(url))
    return Counter(t.state.name for t in study.get_trials(deepcopy=False))


def _gpus() -> list[str]:
    """Visible GPU ids (as ``CUDA_VISIBLE_DEVICES`` names them); empty on a CPU-only host."""
    import torch

    if not torch.cuda.is_available():
        return []
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible:
        return [v.strip() for v in visible.split(",") if v.strip()]
    return [str(i) for i in range(torch.cuda.device_count())]


STORAGE_ENV = "LORA_SWEEP_STORAGE"
"""Environment variable a worker reads its storage URL from when ``--storage`` is not given."""


def launch(study_file: str, overrides: tuple[str, ...], spec: StudySpec, url: str, workers: int | None, *,
           heartbeat: float, grace: float, show: Callable[[Counter[str]], None] | None = None,
           allow_changes: bool = False) -> list[int]:
    """Start the workers of one host and wait for them; returns their exit codes.

    Args:
        study_file: The study YAML every worker loads (with ``overrides``).
        spec: The loaded study (its output folder holds the workers' logs, ``workers/worker-<i>.log``).
        url: The shared storage URL.
        workers: Number of workers; None: one per visible GPU (one on a CPU-only host).
        show: Called with the study's counts by state every second while the workers run (the caller
            reads the final counts); None: no polling (a journal storage's every reader replays the log
            and takes its lock, beside the workers).
    """
    gpus = [] if spec.model.device == "cpu" else _gpus()
    n = workers if workers is not None else max(1, len(gpus))
    sdir = StudyDir(spec.out_dir).create()
    ResultsStore(sdir.results_db).close()  # the schema exists before the workers race to open it
    logs = sdir.root / "workers"
    logs.mkdir(exist_ok=True)
    shares = cpu_shares(allowed_cpus(), n) if n > 1 else [[]]
    procs = []
    for i in range(n):
        env = dict(os.environ)
        if gpus:
            env["CUDA_VISIBLE_DEVICES"] = gpus[i % len(gpus)]
        # torch sizes its CPU thread pool to every core; N workers would each take all of them and fight
        # over the host's cores. Each gets its own share, pinned; a user's own thread count wins.
        env.setdefault("OMP_NUM_THREADS", str(len(shares[i]) or max(1, (os.cpu_count() or 1) // n)))
        env[STORAGE_ENV] = url  # not on the command line, which every user of the host can read (ps)
        cmd = [sys.executable, "-m", "lora_sweep", "worker", study_file, *overrides,
               "--out", str(sdir.root), "--index", str(i), "--heartbeat", str(heartbeat), "--grace", str(grace),
               "--quiet", *(["--cpus", cpu_list(shares[i])] if shares[i] else []),
               *(["--allow-changes"] if allow_changes else [])]
        with open(logs / f"worker-{i}.log", "wb") as out:
            procs.append(subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env,
                                          cwd=Path.cwd()))
    watched: optuna.Study | None = None  # opened once: a journal storage then replays only what is new
    try:
        while (running := [p for p in procs if p.poll() is None]):
            if show is not None:
                try:
                    watched = watched or optuna.load_study(study_name=spec.name, storage=open_storage(url))
                    show(Counter(t.state.name for t in watched.get_trials(deepcopy=False)))
                except Exception:  # the first worker has not created the study yet
                    pass
            try:  # returns as soon as that worker exits (no polling delay at the end of the study)
                running[0].wait(timeout=None if show is None else 1.0)
            except subprocess.TimeoutExpired:
                pass
    except KeyboardInterrupt:
        for p in procs:
            p.terminate()
        raise
    return [p.returncode for p in procs]


def with_storage(spec: StudySpec, url: str | None) -> tuple[StudySpec, str]:
    """The spec with its shared storage URL set (``url``, the study's, or the study directory's own:
    ``StudyDir.optuna_url``)."""
    from lora_sweep.store.storage import normalize_url

    chosen = normalize_url(url) if url else storage_url(spec, StudyDir(spec.out_dir))
    return dataclasses.replace(spec, storage=chosen), chosen
