"""The results store: the layout of a study directory and the flat results tables of one study.

A leaf: it imports no other lora-sweep module and nothing heavy, so the report (which may import only
``store``) and every layer of ``sweep`` share it. Its modules:

    schema       the row classes the tables are derived from; JSON and non-finite values
    results      ``ResultsStore``, typed reads and writes of results.db
    directory    ``StudyDir`` (the layout below), the owner's lock, atomic writes, the user's cache folder
    feasibility  constraints and the one Pareto front
    attrs        the Optuna attribute keys, in one table
    stats        the paired bootstrap of two trials' per-item scores
    urls         URIs without their password (storage, trackers): the one masking of secrets

A study directory (default ``runs/<name>/``, see :class:`StudyDir`) holds::

    optuna.log           Optuna journal storage, the source of truth for trials (``optuna-dashboard <dir>/optuna.log``);
                         a directory an earlier version started holds optuna.db (SQLite) instead and keeps it;
                         ``storage:`` in study.yaml may point to any other Optuna RDB URL or journal file instead
    optuna.log.writer-lock  flock'ed while a process appends to optuna.log (the kernel drops it with a killed writer)
    optuna.log.torn-<time>  the partial last record a writer killed mid-append (or a full disk) left, set aside when
                         the journal was next opened; every complete record stays in optuna.log
    results.db           the tables below, for SQL queries and the HTML report
    study.yaml           the resolved study the last run used (overrides and aliases applied; also meta ``spec``)
    adapters/trial-<n>/  each completed trial's adapter in PEFT format (``PeftModel.from_pretrained``)
    report.html          the self-contained HTML report
    trackers.json        with ``trackers:``, each tracker's run ids and how far it logged (``sweep.trackers.sync``);
                         beside it their default stores: mlflow.db and mlruns/, wandb/, tensorboard/
    lock                 flock'ed by the one ``sweep run`` that owns the directory; holds its pid and host (JSON).
                         A second run finds it held and stops; a dead holder's lock is released by the kernel
                         and the next run takes it over (``StudyDir.acquire``)

Tables of results.db (open with ``sqlite3 runs/<name>/results.db`` or ``sqlite-utils``):

``study`` (PK key): key/value metadata; ``value`` is JSON. Keys: name (also the Optuna study name), storage (the
Optuna storage URL), model, data, objectives (list of metric names), directions (list of "minimize"/"maximize"),
spec (the resolved study as plain data, compared on resume: ``sweep.session.spec_changes``), constraints (list of
{metric, op ("<=" or ">="), value}; a trial is feasible when its metrics meet them all, see ``is_feasible``),
created, updated (time of the last write), lora_sweep_version.

``trials`` (PK number): one row per Optuna trial.
    number            Optuna trial number.
    state             Optuna state name: RUNNING, COMPLETE, PRUNED, FAIL or WAITING.
    params            JSON object, hyperparameter name -> value.
    objective_values  JSON list, one value per objective, in the order of ``study.objectives``.
    metrics           JSON object, metric name -> final value (every evaluator metric, objectives included).
    user_attrs        JSON object, Optuna user attributes.
    adapter_path      The trial's adapter directory, relative to the study directory (adapters/trial-<n>).
    pack_id, slot     The pack and slot the trial trained in last.
    steps_done        Optimizer steps the trial completed.
    tokens            Training tokens the trial consumed.
    device_seconds    Device time attributed to the trial (its share of its packs' wall time).
    started, finished Start and end times.
    reason            Why the trial was pruned or failed (prune reason or exception text).

``steps`` (PK trial, step): per-step training curves; a resumed run rewriting a step replaces the row.
    trial, step       Trial number and the trial's own optimizer step (not the pack step).
    loss              Training loss of the step.  tokens: cumulative training tokens of the trial after it.
    lr, grad_norm     Learning rate used and gradient norm before clipping.  time: when the step ended.

``evals`` (PK trial, kind, step, metric): evaluations during (kind 'rung') and after (kind 'final') training.
    trial, step       Trial number and the trial step evaluated at.  time: when the evaluation ended.
    kind              'rung' (pruning evaluation) or 'final'.
    metric, value     Metric name and value.

``items`` (PK trial, evaluator, item): per-item results of the final evaluation, for paired statistics
(the same item index means the same example for every trial).
    trial, evaluator  Trial number and evaluator name.  item: index of the example in the evaluation set.
    score             Numeric per-item score (loss, 0/1 correctness, ...).  detail: JSON, anything else; a
                      generative evaluator's item keeps {prompt, output, reference} (the item is the prompt's id).

``packs`` (PK pack_id): one row per packed training run.
    pack_id           Number of the pack, assigned by the store (1, 2, ...).
    started, finished Start and end times.  wall_s: finished - started.
    slots             Number of slots (adapters trained at once).  device: device name.
    steps, tokens     Pack steps run and training tokens over all slots.  tokens_per_s: throughput.
    peak_mem_bytes    Peak device memory allocated.
    status            'running', 'finished', 'failed' or 'oom'; a pack left 'running' was killed.
    step              The training step it ran: 'cuda-graph' (fixed shapes replayed as CUDA graphs) or
                      'eager' (the same step run eagerly: the CPU, cuda_graphs off, a failed capture; an older
                      file may hold 'static-eager', read back as 'eager'); NULL for a pack that did not finish
                      training (and in stores written before schema 2).
    fallback          Why a CUDA pack ran 'eager' though CUDA graphs were on: its configuration and the failed
                      capture's error with the line that raised it (docs/guides/training.md); NULL otherwise.

``slot_spans`` (PK pack_id, slot, trial): the pack timeline, which trial sat in which slot when.
    pack_id, slot, trial      Pack, slot index and the trial in it.
    start_step, end_step      Pack steps at which the trial entered and left the slot.
    start_time, end_time      The same as times.
    end_reason                'finished' (max_steps reached), 'stopped' (pruned) or 'interrupted'; NULL while it trains.

``prune_decisions`` (PK pack_id, rung_step, trial): each decision of the cohort pruner.
    pack_id, rung_step, trial Pack, the trial step of the rung, and the trial decided on.
    decision                  'prune' or 'keep'.
    value, rank, cohort_size  The trial's rung value, its rank in the cohort (1 = best) and the cohort size.
    reason, time              Human-readable reason and decision time.

Conventions. Times are Unix epoch seconds (REAL; ``datetime(started, 'unixepoch')`` in SQL). JSON columns hold
JSON text: ``json_extract(params, '$.lr')``. Non-finite floats: inside JSON columns NaN, inf and -inf are written as
the strings "NaN", "Infinity" and "-Infinity" (JSON has no such numbers) and read back as floats, so a string
with one of those spellings is also read back as a float; in REAL columns inf and -inf are stored as SQLite's
native infinities and NaN as NULL (SQLite has no NaN), read back as None.

Concurrency. results.db runs in WAL mode; writes are short ``BEGIN IMMEDIATE`` transactions and connections wait
up to ``timeout`` seconds for a lock, so several processes of one host may write to one results.db. SQLite over a
network file system is unsafe: multi-host runs keep one results.db per host, or treat the Optuna RDB (PostgreSQL
or MySQL) as the truth and rebuild results from it.
"""

from __future__ import annotations

from lora_sweep.store import attrs
from lora_sweep.store.directory import (
    DirectoryInUse,
    DirectoryLock,
    StudyDir,
    atomic_write_bytes,
    atomic_write_text,
    cache_dir,
)
from lora_sweep.store.feasibility import constraint_text, constraint_violation, is_feasible, pareto_front
from lora_sweep.store.results import ResultsStore
from lora_sweep.store.schema import (
    SCHEMA_VERSION,
    EvalRow,
    ItemRow,
    PackRecord,
    PruneDecision,
    SlotSpan,
    StepRow,
    TrialRecord,
    reference_trial,
)
from lora_sweep.store.stats import paired_bootstrap, paired_scores
from lora_sweep.store.urls import redact_record, redact_url, strip_password

__all__ = [
    "DirectoryInUse", "DirectoryLock", "EvalRow", "ItemRow", "constraint_text", "constraint_violation",
    "is_feasible", "pareto_front", "redact_record", "redact_url", "strip_password", "PackRecord", "PruneDecision",
    "ResultsStore",
    "SCHEMA_VERSION", "SlotSpan", "StepRow", "StudyDir", "TrialRecord", "atomic_write_bytes", "atomic_write_text",
    "attrs", "cache_dir", "paired_bootstrap", "paired_scores", "reference_trial",
]  # fmt: skip
