"""The Optuna + PEFT ways of ``benchmarks.vs_peft``: the study's trials asked by Optuna and trained one at a time by
transformers + PEFT alone, on a base loaded once per process.

This is the loop a careful user writes around Optuna, doing per trial the work a ``sweep run`` trial does:

- the same Optuna study: the study's sampler built by ``sweep.sampling.make_sampler`` with the study's seed,
  its objective directions, the community default (and a config baseline) enqueued first, as ``sweep.ledger``;
- the same rows in the same order (``sweep._trial_data``: ``trial_adapter`` for the step count, ``trial_stream``
  for the seeded micro-batches), the same adapter (``adapter_spec``: rank, alpha, dropout, targets resolved by
  ``packer.model.inject.resolve_targets``, rsLoRA), PEFT's init drawn from a generator seeded by the trial's seed
  in module order as the pack draws it (A Kaiming-uniform, B zero), so the same trial starts from the same weights;
- the same step: AdamW (fused on CUDA, foreach on the CPU) with the adapter's lr, betas, eps and weight decay,
  ``transformers.get_scheduler``'s warm-up and schedule, the loss summed over the accumulation window's target
  tokens and divided by their count (transformers' ``num_items_in_batch``), clipping to ``max_grad_norm``;
- the same held-out loss (mean next-token cross-entropy over every target token of ``data.eval``) at every rung and
  at the end, and the same pruning rule: ``sweep.pruning.CohortSHA`` with the study's rungs and reduction factor,
  each trial ranked at a rung against every trial that reached it before (read back from the Optuna storage, so
  processes sharing the study share the cohorts); the community default and the baseline are never pruned;
- the adapter of a complete trial saved with ``save_pretrained``.

What differs, by the nature of one trial at a time: a trial reaching a rung is ranked against the trials that
reached it *before* it (the sweep ranks a pack's peers arriving together), and TPE proposes each trial knowing
every earlier one finished (the sweep asks a pack's trials while its peers run, with constant liar). Dropout masks
come from torch's global generator (the pack seeds them per slot), so trials with dropout > 0 differ in noise, not
in expectation. Only ``heldout_loss`` runs: a study's other evaluators are left out of every way.

Two step implementations (``graph``): eager, and the strongest single-trial step there is, the micro-batch's
forward and backward at fixed shapes (rows right-padded to ``data.max_length``) captured once per trial as a CUDA
graph and replayed (``packer.step.capture``; the fused AdamW step and clipping run eagerly, a few kernels), or on a
CPU the same fixed-shape step under ``torch.compile``. Neither passes an attention mask: with right padding and a
causal model no real token attends to padding, so the logits of the real tokens are those of a masked batch.

Run by ``benchmarks.vs_peft``; ``python -m lora_sweep.benchmarks.optuna_peft --child JOB`` is one process of its
``peft-procs`` and ``peft-graph-procs`` ways.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import optuna
import torch
from optuna.storages import BaseStorage
from optuna.trial import TrialState

from lora_sweep.errors import UserError
from lora_sweep.packer.data.batch import collate
from lora_sweep.packer.data.rows import IGNORE_INDEX, Example, load_examples
from lora_sweep.packer.model.inject import resolve_targets
from lora_sweep.packer.model.load import load_base, resolve_base
from lora_sweep.packer.plan import AdapterSpec
from lora_sweep.packer.step.capture import capture
from lora_sweep.store.api import attrs
from lora_sweep.sweep._trial_data import trial_adapter, trial_stream
from lora_sweep.sweep.config.space import adapter_spec, baseline_params, community_default
from lora_sweep.sweep.config.spec import StudySpec
from lora_sweep.sweep.device import resolve_device
from lora_sweep.sweep.pruning import CohortSHA
from lora_sweep.sweep.sampling import make_sampler, suggest

__all__ = ["METRICS", "Base", "load", "create_study", "journal", "open_study", "run_trials", "heldout_loss", "wrap"]

METRICS = ("eval_loss", "perplexity", "adapter_params")
"""What a trial of these ways measures: an objective or pruning proxy outside these is refused."""
RUNG_ATTR = "vs_peft_rung_"
"""Prefix of the trial user attribute holding its held-out loss at a rung (``vs_peft_rung_25``)."""
WORKER_SEED = 100_003
"""A worker's sampler seed is the study's seed plus this times its index, as ``sweep.ledger`` seeds workers."""


@dataclass
class Base:
    """What a process loads once: the frozen base and the study's tokenized rows."""

    spec: StudySpec
    model: torch.nn.Module
    pad_id: int
    train: list[Example]
    heldout: list[Example]

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device


def load(spec: StudySpec) -> Base:
    """The base as ``sweep run`` loads it (``load_base``, the study's dtype and device) and the tokenized rows."""
    device = resolve_device(spec.model.device)
    model, tokenizer = load_base(resolve_base(spec.model.path, spec.model.gguf_file), dtype=spec.model.dtype,
                                 device=device)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id  # type: ignore
    data = spec.data
    kw = dict(fmt=data.format, max_length=data.max_length, train_on_prompt=data.train_on_prompt)
    if data.eval is None:
        raise UserError("vs_peft: data.eval is not set: every way ranks trials by the held-out loss")
    return Base(spec, model, int(pad), load_examples(data.train, tokenizer, **kw),  # type: ignore[arg-type]
                load_examples(data.eval, tokenizer, **kw))  # type: ignore[arg-type]


def create_study(spec: StudySpec, storage: str | BaseStorage) -> optuna.Study:
    """The study as ``sweep.ledger`` creates it: the study's sampler and seed, its directions, the community default
    enqueued first and the config baseline after it."""
    study = optuna.create_study(study_name=spec.name, storage=storage, directions=list(spec.directions),
                                sampler=make_sampler(spec.sampler, spec.seed, spec.search))
    default, _ = community_default(spec.search, spec.train)
    baseline, _ = baseline_params(spec.search, spec.baseline) if spec.baseline else (None, "")
    if default is not None:
        study.enqueue_trial(default, user_attrs={attrs.DEFAULT: True, **({attrs.BASELINE: True}
                                                                          if baseline == default else {})})
    if baseline is not None and baseline != default:
        study.enqueue_trial(baseline, user_attrs={attrs.BASELINE: True})
    return study


def journal(path: str | Path) -> BaseStorage:
    """The journal-file storage at ``path``: Optuna's storage for processes sharing a study on one host."""
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend

    return JournalStorage(JournalFileBackend(str(path)))


def open_study(spec: StudySpec, storage: str | BaseStorage, worker: int = 0) -> optuna.Study:
    """The study ``create_study`` made, with worker ``worker``'s own sampler (seed + ``WORKER_SEED`` x worker)."""
    sampler = make_sampler(spec.sampler, spec.seed + WORKER_SEED * worker, spec.search)
    return optuna.load_study(study_name=spec.name, storage=storage, sampler=sampler)


def run_trials(base: Base, study: optuna.Study, n: int, *, graph: bool, adapters: Path,
               log: Callable[[dict], None]) -> None:
    """Ask, train and tell ``n`` trials one after another; ``log`` gets each finished trial's
    ``{trial, state, eval_loss, steps, params}``."""
    spec = base.spec
    for _ in range(n):
        trial = study.ask()
        params = suggest(trial, spec.search)
        adapter = adapter_spec(params, spec.train, spec.seed, space=spec.search)
        adapter = trial_adapter(spec, adapter, list(params), base.train)
        state, metrics, steps = train_trial(base, trial, adapter, graph=graph, adapters=adapters)
        values = [metrics[o.metric] for o in spec.objectives] if state == TrialState.COMPLETE else None
        study.tell(trial, values=values, state=state)
        log(dict(trial=trial.number, state=state.name, eval_loss=metrics.get("eval_loss"), steps=steps,
                 params=params))


def wrap(base: Base, adapter: AdapterSpec) -> Any:
    """``base.model`` with a PEFT LoRA adapter of ``adapter`` on its projections, initialised as the pack
    initialises a slot: A Kaiming-uniform(a=sqrt(5)) from a generator seeded by ``adapter.seed`` on the base's
    device, drawn layer by layer in module order; B zero (PEFT's)."""
    from peft import LoraConfig, get_peft_model

    paths = resolve_targets(base.model, adapter.targets)
    config = LoraConfig(r=adapter.rank, lora_alpha=adapter.alpha, lora_dropout=adapter.dropout, target_modules=paths,
                        use_rslora=adapter.rslora)
    model = get_peft_model(base.model, config)
    generator = torch.Generator(device=base.device).manual_seed(adapter.seed)
    with torch.no_grad():
        for path in paths:
            a = model.base_model.model.get_submodule(path).lora_A["default"].weight  # (r, D_in)
            torch.nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=generator)
    if base.spec.pack.activation_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def train_trial(base: Base, trial: optuna.Trial, adapter: AdapterSpec, *, graph: bool,
                adapters: Path) -> tuple[TrialState, dict[str, float], int]:
    """Train one trial, ranked at each rung; returns (its state, its metrics, the steps it took)."""
    from transformers import get_scheduler

    model = wrap(base, adapter)
    try:
        model.train()
        params = [p for p in model.parameters() if p.requires_grad]
        cuda = base.device.type == "cuda"
        opt = torch.optim.AdamW(params, lr=adapter.lr, betas=adapter.betas, eps=adapter.eps,
                                weight_decay=adapter.weight_decay, **({"fused": True} if cuda else {"foreach": True}))
        name = "constant_with_warmup" if adapter.schedule == "constant" else adapter.schedule
        sched = get_scheduler(name, opt, num_warmup_steps=adapter.warmup_steps, num_training_steps=adapter.max_steps)
        micro = _GraphedMicro(model, base, adapter) if graph else _EagerMicro(model, base)
        stream = trial_stream(base.spec, adapter, base.train)
        pruning = base.spec.pruning
        for step in range(1, adapter.max_steps + 1):
            window = [stream.next_batch() for _ in range(adapter.gradient_accumulation_steps)]
            n_items = sum(sum(t != IGNORE_INDEX for t in r.labels[1:]) for rows in window for r in rows)
            for rows in window:
                micro(rows, n_items)
            if adapter.max_grad_norm is not None:
                torch.nn.utils.clip_grad_norm_(params, adapter.max_grad_norm, foreach=True)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=not graph)  # a graph's gradients live at fixed addresses
            if pruning.kind == "cohort_sha" and step in pruning.rungs and step < adapter.max_steps:
                if not _kept(base.spec, trial, step, heldout_loss(base, model)):
                    return TrialState.PRUNED, {}, step
        loss = heldout_loss(base, model)
        model.save_pretrained(adapters / f"trial-{trial.number}")
        return TrialState.COMPLETE, dict(eval_loss=loss, perplexity=math.exp(min(loss, 700.0)),
                                         adapter_params=sum(p.numel() for p in params)), adapter.max_steps
    finally:
        base.model = model.unload()  # the base without the adapter's layers, for the next trial
        torch._dynamo.reset()  # a compiled step's graphs name this trial's modules


class _EagerMicro:
    """One micro-batch's forward and backward, as the rows come (right-padded to the longest)."""

    def __init__(self, model: Any, base: Base) -> None:
        self.model, self.base = model, base

    def __call__(self, rows: Sequence[Any], n_items: int) -> None:
        batch = collate([0], [rows], self.base.pad_id, dropout=[0.0], seeds=[0], device=self.base.device)
        self.model(input_ids=batch.input_ids, labels=batch.labels, num_items_in_batch=n_items,
                   use_cache=False).loss.backward()


class _GraphedMicro:
    """One micro-batch's forward and backward at fixed shapes: ``micro_batch`` rows of ``data.max_length`` tokens
    in static buffers, captured as a CUDA graph on the first call (gradients accumulate in place into ``.grad``
    buffers allocated before the capture), or compiled by ``torch.compile`` on a CPU."""

    def __init__(self, model: Any, base: Base, adapter: AdapterSpec) -> None:
        self.model, self.base = model, base
        shape, device = (adapter.micro_batch, base.spec.data.max_length), base.device
        self.ids = torch.full(shape, base.pad_id, dtype=torch.long, device=device)  # (B, L)
        self.labels = torch.full(shape, IGNORE_INDEX, dtype=torch.long, device=device)  # (B, L)
        self.n_items = torch.ones((), device=device)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.cuda = device.type == "cuda"
        self.step: Callable[[], None] = (self._step if self.cuda
                                         else torch.compile(self._step, dynamic=False))  # type: ignore[assignment]

    def _step(self) -> None:
        self.model(input_ids=self.ids, labels=self.labels, num_items_in_batch=self.n_items,
                   use_cache=False).loss.backward()

    def _load(self, rows: Sequence[Any], n_items: int) -> None:
        batch = collate([0], [rows], self.base.pad_id, dropout=[0.0], seeds=[0], device=self.base.device)
        b, length = batch.input_ids.shape
        if b != self.ids.shape[0] or length > self.ids.shape[1]:
            raise ValueError(f"a micro-batch of {b} x {length} does not fit the fixed {tuple(self.ids.shape)}")
        self.ids.fill_(self.base.pad_id)
        self.labels.fill_(IGNORE_INDEX)
        self.ids[:, :length].copy_(batch.input_ids)
        self.labels[:, :length].copy_(batch.labels)
        self.n_items.fill_(float(n_items))

    def __call__(self, rows: Sequence[Any], n_items: int) -> None:
        self._load(rows, n_items)
        if not self.cuda:
            self.step()
            return
        if self.graph is None:
            params = [p for p in self.model.parameters() if p.requires_grad]

            def warmup() -> None:  # the capture's side-stream runs: their gradients are zeroed after each
                self._step()
                for p in params:
                    p.grad.zero_()  # type: ignore[union-attr]

            for p in params:
                p.grad = torch.zeros_like(p)
            self.graph = capture(self._step, warmups=3, warmup=warmup).graph
        self.graph.replay()


def heldout_loss(base: Base, model: Any, batch_size: int = 8) -> float:
    """Mean next-token cross-entropy over every target token of the held-out rows (the ``heldout_loss`` evaluator's
    ``eval_loss``), dropout off."""
    model.eval()
    total = torch.zeros((), dtype=torch.float64, device=base.device)
    count = 0
    with torch.no_grad():
        for i in range(0, len(base.heldout), batch_size):
            rows = base.heldout[i:i + batch_size]
            batch = collate([0], [rows], base.pad_id, dropout=[0.0], seeds=[0], device=base.device)
            logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                           use_cache=False).logits  # (B, L, V)
            labels = batch.labels[:, 1:]  # (B, L-1)
            total += torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels.flatten(),
                                                       ignore_index=IGNORE_INDEX, reduction="sum")
            count += int((labels != IGNORE_INDEX).sum())
    model.train()
    return float(total) / max(count, 1)


def _kept(spec: StudySpec, trial: optuna.Trial, rung: int, value: float) -> bool:
    """Cohort SHA's decision for ``trial`` at ``rung``, ranked against every trial of the study that reached the rung
    before (their values are trial user attributes, so processes sharing the storage share the cohort)."""
    key = f"{RUNG_ATTR}{rung}"
    trial.set_user_attr(key, value)
    _, direction = spec.prune_metric()
    seen = {t.number: t.user_attrs[key] for t in trial.study.get_trials(deepcopy=False)
            if key in t.user_attrs and t.number != trial.number}
    sha = CohortSHA(spec.pruning.rungs, spec.pruning.reduction_factor, direction, {rung: seen})
    keep = sha.decide(rung, {trial.number: value})[0].keep
    return keep or bool(trial.user_attrs.get(attrs.DEFAULT) or trial.user_attrs.get(attrs.BASELINE))


def _child(job_file: str) -> None:
    """One process of a processes way: its share of the trials on the shared storage, each finished trial a
    JSON line (seconds since the way's start) in its log file."""
    from lora_sweep.sweep.config.loader import load_study

    job = json.loads(Path(job_file).read_text())
    if job["threads"]:
        torch.set_num_threads(job["threads"])  # processes sharing the CPU cores, as a user would set them
    spec = load_study(job["study"], job["overrides"])
    base = load(spec)
    study = open_study(spec, journal(job["storage"]), job["worker"])
    with open(job["log"], "a", encoding="utf-8") as out:
        def log(line: dict) -> None:
            out.write(json.dumps(dict(t=time.time() - job["t0"], worker=job["worker"], **line)) + "\n")
            out.flush()

        run_trials(base, study, job["trials"], graph=job["graph"], adapters=Path(job["adapters"]), log=log)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m lora_sweep.benchmarks.optuna_peft")
    parser.add_argument("--child", required=True, help="a job file written by benchmarks.vs_peft")
    _child(parser.parse_args().child)
