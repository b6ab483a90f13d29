"""Open a study directory: create it, or resume it after a stop or a crash.

``open_session`` takes the directory (``sweep.session``), loads the base model once, records the
resolved spec and creates or loads the Optuna study (``sweep.ledger.open_study``). The Optuna storage
is the source of truth. Trials it still holds as RUNNING belong to a run that died (a kill loses at
most the in-flight work): they are told FAIL, marked ``orphaned`` in the results store and their
parameters enqueued again (``Ledger.recover``), so the constant-liar sampler does not avoid their
region forever and the budget counts stay exact (an orphan does not count, its retry does). The
session then starts from the counts of the earlier runs.

Shared by several workers (``store.storage.Sharing``), a RUNNING trial may belong to a live worker:
only trials whose heartbeat is older than the grace period are orphans (``Ledger.reap``), and the
study's wall-time clock resumes first (``store.storage.resume_clock``).
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from functools import partial

import optuna
import torch.distributed as dist
from optuna.trial import TrialState

from lora_sweep.errors import ConfigError, UserError
from lora_sweep.evaluators.registry import metrics_of
from lora_sweep.packer.api import Packer, open_base
from lora_sweep.store.api import DirectoryLock, ResultsStore, StudyDir, cache_dir, strip_password
from lora_sweep.store.storage import Sharing, resume_clock, storage_lock
from lora_sweep.sweep.budget import counted
from lora_sweep.sweep.config.spec import StudySpec
from lora_sweep.sweep.device import resolve_device
from lora_sweep.sweep.ledger import Ledger, open_study, recorded_trials, storage_url
from lora_sweep.sweep.session import Note, Session, own_directory, record_spec, trial_adapter_dir
from lora_sweep.sweep.timing import WallSplit

__all__ = ["open_session", "resolve_device", "record_data", "data_digests"]


def open_session(spec: StudySpec, *, log: Callable[[str], None] = print, sharing: Sharing | None = None,
                 allow_changes: bool = False, split: WallSplit | None = None,
                 allow_data_change: bool = False) -> Session:
    """Create or resume the study in ``spec.out_dir`` and load the base model once.

    With ``sharing`` the study lives in a storage other workers use too: only stale RUNNING trials
    are orphans, and the budget is counted there. The resolved spec is recorded in the store (meta
    ``spec``) and the directory (``study.yaml``); resumed, a changed fixed setting
    (``sweep.session.spec_changes``) is an error unless ``allow_changes``. ``split``: the run's wall-time split,
    given the sub-phases ``load:model`` (base model and tokenizer to the device) and ``load:study`` (the results
    store, the Optuna storage and study). The data files' digests are recorded too (``record_data``); resumed, a
    changed file is an error unless ``allow_data_change``.
    """
    optuna.logging.set_verbosity(optuna.logging.WARNING)  # our progress and store say what happened
    device = resolve_device(spec.model.device)  # before anything is created: a user error leaves no trace
    if spec.pack.shard == "fsdp":
        _check_shard(spec)
    sdir = StudyDir(spec.out_dir)
    lock = None if sharing is not None else own_directory(sdir, log)
    try:
        return _open(spec, sdir, device, log, sharing, lock, (allow_changes, allow_data_change), split or WallSplit())
    except BaseException:
        if lock is not None:
            lock.release()
        raise


def _check_shard(spec: StudySpec) -> None:
    """Refuse a sharded study this process cannot run as asked (never run unsharded: not the base that was asked
    for).

    Raises:
        ConfigError: no process group started, or sample packing (its isolation check forwards on rank 0 alone,
            once per model: ``packer.step.isolation``).
    """
    if not dist.is_initialized():
        raise ConfigError("pack.shard: fsdp: the ranks of a sharded pack are not started: run it with sweep run "
                          "--gpus N (api.run(..., gpus=N)) or sweep worker under torchrun")
    if spec.train.sample_packing or any(p.name == "sample_packing" for p in spec.search.params):
        raise ConfigError("pack.shard: fsdp does not take sample packing (train.sample_packing or a searched "
                          "sample_packing): its isolation check runs forwards on one rank")


def _capacity(spec: StudySpec, packer: Packer, log: Callable[[str], None], split: WallSplit) -> int:
    """The pack's slots: ``pack.max_slots``, or with ``auto`` the planner's, its calibration (announced, and
    read from the cache when it can be) charged to the run's ``calibrate`` phase."""
    if spec.pack.max_slots != "auto":
        return int(spec.pack.max_slots)
    from lora_sweep.sweep.planning import plan_pack

    with split.phase("calibrate"):
        report = plan_pack(spec, packer, log=log)
    log(f"pack: auto -> {report.slots} slots (calibration {report.calibration})")
    return report.slots


def _open(spec: StudySpec, sdir: StudyDir, device: str, log: Callable[[str], None], sharing: Sharing | None,
          lock: DirectoryLock | None, allow: tuple[bool, bool], split: WallSplit) -> Session:
    from lora_sweep.sweep.planning import check_targets

    allow_changes, allow_data_change = allow
    url = storage_url(spec, sdir, sharing)  # a URL no storage takes, or without its driver: refused before the load
    log(Note(f"loading the base model {spec.model.path} on {device} (model.dtype: {spec.model.dtype})"))
    if device == "cpu" and spec.model.dtype in ("bfloat16", "float16"):  # a torchtune config's dtype: bf16, say
        log(f"warning: model.dtype: {spec.model.dtype} on a CPU: the base and adapters run in {spec.model.dtype} as "
            f"asked, less exact than float32 and often slower (most CPUs lack {spec.model.dtype} matrix units); "
            f"model.dtype=float32 for CPU runs")
    with split.part("load:model"):
        # a GGUF source becomes its cached checkpoint directory: what every adapter and export names (source);
        # sharded, each rank reads its shard of the base, as every other rank does (sweep.ranks.follow), before any
        # slot; compiled kernels kept between runs beside the calibrations
        packer = open_base(spec.model.path, gguf_file=spec.model.gguf_file, dtype=spec.model.dtype, device=device,
                           quantize=spec.model.quantize, kernels=spec.pack.kernels,
                           fused_base_ops=spec.pack.fused_base_ops, sharded=spec.pack.shard == "fsdp",
                           kernel_cache=cache_dir(), log=log)
    check_targets(spec, packer)  # before the study is created: a target set the model lacks fails no trial
    with split.part("load:study"):
        sdir.create()
        store = ResultsStore(sdir.results_db)
        recorded = recorded_trials(store, trial_adapter_dir(spec, sdir, 0).parent)
        study, storage = open_study(spec, sdir, sharing, recorded, log)
        # until a trial finishes, a run pins nothing: a rerun after a failed start (a data error before or at the
        # first evaluation) is a new start, and the trials the failed run had asked are retried as orphans
        started = bool(counted(study.get_trials(deepcopy=False)))
        record_spec(spec, sdir, store, log, allow_changes, started=started)
        record_data(spec, store, log, allow_data_change, started=started)
        ledger = Ledger(study, storage, store, partial(trial_adapter_dir, spec, sdir), log)
        if sharing is None:
            ledger.recover()
    store.set_meta(name=spec.name, storage=strip_password(url), model=packer.source,
                   **({"model_source": str(packer.gguf)} if packer.gguf else {}), data=str(spec.data.train),
                   objectives=[o.metric for o in spec.objectives], directions=spec.directions,
                   constraints=[c.as_dict() for c in spec.constraints],
                   metric_directions={m: d for e in spec.evaluators for m, d in metrics_of(e.name, e.options).items()})
    if sharing is not None:
        with storage_lock(sharing.url, spec.name):  # the clock first: reaping makes dead trials' ends recent
            resume_clock(study, sharing.grace, earlier=float(store.meta().get("elapsed", 0.0)))
            ledger.reap(sharing.grace)
        ledger.sync()
    trials = ledger.trials()
    return Session(spec, sdir, store, ledger, packer, _capacity(spec, packer, log, split),
                   finished=len(counted(trials)), tokens=sum(r.tokens or 0 for r in store.trials()),
                   elapsed=float(store.meta().get("elapsed", 0.0)),
                   completed=[(t.number, list(t.values)) for t in trials if t.state == TrialState.COMPLETE],
                   sharing=sharing, lock=lock)


def data_digests(spec: StudySpec) -> dict[str, dict[str, str]]:
    """``{"train": {"path", "sha256"}, "eval": ...}`` of the study's data files, read in 1 MiB blocks."""
    out = {}
    for role, path in (("train", spec.data.train), ("eval", spec.data.eval)):
        if path is not None:
            with open(path, "rb") as f:
                out[role] = {"path": str(path), "sha256": hashlib.file_digest(f, "sha256").hexdigest()}
    return out


def record_data(spec: StudySpec, store: ResultsStore, log: Callable[[str], None], allow: bool = False,
                started: bool = True) -> None:
    """Compare the data files' digests with those the study started with, then record them (meta ``data_digests``).

    Trials scored on other data do not rank together (another held-out set is another metric), so a changed file is
    refused as a changed fixed setting is. ``allow`` (``--allow-data-change``): resume anyway; each change is
    logged and kept in meta ``data_changes`` (file, both digests, when, trials finished before it). ``started``: a
    trial finished; until then a changed file pins nothing.

    Raises:
        UserError: a data file's contents changed since the study started (naming the file), and not ``allow``.
    """
    now = data_digests(spec)
    meta = store.meta()
    earlier = meta.get("data_digests") or {}
    changed = [(role, earlier[role], now[role]) for role in now if started and role in earlier
               and earlier[role].get("sha256") != now[role]["sha256"]]
    if changed and not allow:
        role, old, new = changed[0]
        raise UserError(f"run: data.{role}: {new['path']} changed since the study started (sha256 {old['sha256'][:12]} "
                        f"-> {new['sha256'][:12]}); trials scored on other data do not rank together: restore the "
                        f"file, start a new study (--out), or pass --allow-data-change (recorded in the study)")
    if changed:
        history = list(meta.get("data_changes") or [])
        for role, old, new in changed:
            log(f"resuming with changed data.{role}: {new['path']} (--allow-data-change; recorded)")
            history.append({"key": f"data.{role}", "path": new["path"], "from": old["sha256"], "to": new["sha256"],
                            "at": time.time(), "trials_before": sum(1 for t in store.trials() if t.state != "RUNNING")})
        store.set_meta(data_changes=history)
    store.set_meta(data_digests=now)
