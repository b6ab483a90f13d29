"""``sweep run``: Optuna asks, one pack trains, evaluators score, Optuna is told, the store records.

One call of ``run_study`` is one pack: a single ``packer.step.train`` run whose slots are refilled with
newly asked trials (backfill) until the budget ends. At rung steps the trials reaching the rung are
scored on the pruning proxy and cohort successive halving (``sweep.pruning``) stops the weak ones;
finished trials are scored by every configured evaluator in one packed pass, their adapters saved,
and Optuna told COMPLETE / PRUNED / FAIL (with the reason in the store). The Optuna storage is the
source of truth, and ``sweep.ledger`` alone asks and tells it; a rerun on the same study resumes it
(``sweep.resume``).

Shared with other workers (``sharing``), the budget check and the ask run under the storage's lock,
a heartbeat thread stamps this worker's RUNNING trials, and stale trials of dead workers are failed
and retried every few heartbeats (``sweep.worker`` runs the loop around it).

Over ~400 lines on purpose: the sweep's one loop (``_Sweep``'s callbacks, asking to telling) reads top to
bottom in one file; what is not the loop lives in ``sweep.ledger``, ``sweep.budget`` and ``sweep.session``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from concurrent.futures import Future
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import optuna
import torch
from optuna.trial import TrialState

from lora_sweep.errors import STOP_SAID, Terminated, UserError, first_line
from lora_sweep.evaluators.cost import cost_metrics, slot_adapter_params
from lora_sweep.evaluators.registry import (
    EvalResult,
    EvaluatorHung,
    Limits,
    curve_entry,
    evaluate,
    load_eval_data,
    metrics_of,
)
from lora_sweep.packer.api import AdapterSpec, Packer, jobs
from lora_sweep.store.api import attrs
from lora_sweep.store.storage import Sharing, storage_lock
from lora_sweep.sweep._trial_data import (
    check_data,
    check_packing,
    planned_tokens,
    step_lengths,
    trial_adapter,
    trial_stream,
)
from lora_sweep.sweep.bookkeeping import CURVE_EVERY
from lora_sweep.sweep.budget import BudgetState, TokenPlan, budget_state, end_line, recorded_budget
from lora_sweep.sweep.config.space import adapter_spec
from lora_sweep.sweep.config.spec import StudySpec
from lora_sweep.sweep.eta import expected_steps, pack_steps_left, steps_left
from lora_sweep.sweep.ledger import Heartbeat, Ledger
from lora_sweep.sweep.planning import largest_rank
from lora_sweep.sweep.pruning import CohortSHA
from lora_sweep.sweep.ranks import Channel
from lora_sweep.sweep.resume import open_session
from lora_sweep.sweep.sampling import suggest
from lora_sweep.sweep.session import Note, Session
from lora_sweep.sweep.timing import WallSplit, append_run, run_split

__all__ = ["run_study", "RunSummary", "Progress"]


@dataclass(frozen=True)
class Progress:
    """What the CLI shows after each packed step."""

    step: int
    active: int
    capacity: int
    tokens_per_s: float
    """Training tokens of the pack per wall second of it so far, evaluation included (the packs
    table's ``tokens_per_s``: one definition)."""
    finished: int
    budget_trials: int | None
    best: str
    eta_s: float | None = None
    """Seconds until the budget is spent: its packed steps left at this run's seconds per packed step
    (``sweep.eta``), capped by the wall-time budget; None before the first step."""
    phase: str = "training"
    """What the run is doing: ``training``, or ``evaluating`` (a frame sent as an evaluation starts)."""


@dataclass
class RunSummary:
    """Totals of one ``run_study`` call."""

    pack_id: int
    """The run's (last) pack in results.db; 0 when it trained none (``already_spent``)."""
    steps: int = 0
    tokens: int = 0
    wall_s: float = 0.0
    complete: int = 0
    pruned: int = 0
    failed: int = 0
    spent: str = ""
    """The budget that ended the asking (``BudgetState.reason``), '' while it had room."""
    spent_key: str = ""
    """Its study key (``BudgetState.key``)."""
    split: dict[str, Any] = field(default_factory=dict)
    """Where the run's wall time went (``sweep.timing.WallSplit.record``), and how it ended (``end``)."""
    end_reason: str = ""
    """How the run ended: a budget key (``budget.trials``), ``grid``, ``interrupt``, ``sigterm`` or ``error``."""
    ended: str = ""
    """That, in one line for people (``budget.end_line``; also the store's meta ``last_end``)."""
    over: bool = False
    """The run went over the budget that ended it (the trials training when it was reached ran on)."""
    already_spent: bool = False
    """The budget was spent before this run started: it trained nothing and wrote no pack or timing row."""
    report: Path | None = None
    """The HTML report, when the run wrote it itself (``api.run``, for the trackers' parent runs); None: not written."""


@dataclass
class _Live:
    """A trial training in a slot."""

    trial: optuna.Trial
    params: dict[str, Any]
    spec: AdapterSpec
    start_step: int
    started: float
    tokens: int = 0
    device_s: float = 0.0
    steps: list[dict[str, float]] = field(default_factory=list)
    reported: set[int] = field(default_factory=set)
    """Steps whose intermediate value Optuna has."""

    def report(self, value: float, step: int, single_objective: bool) -> None:
        """Give Optuna the pruner's metric at ``step`` as the trial's intermediate value: what optuna-dashboard
        plots is what the pruning decided on (the training loss stays in results.db's steps and the report).
        Once per step (a rung may also be an ``eval_every`` step); single objective only: Optuna forbids it
        otherwise."""
        if single_objective and step not in self.reported and math.isfinite(value):
            self.reported.add(step)
            self.trial.report(value, step)


class _Sweep:
    """The callbacks ``packer.step.train`` runs the pack with; all study state lives here."""

    def __init__(self, spec: StudySpec, session: Session, train_examples: list, eval_data: Any,
                 pack_id: int, progress: Callable[[Progress], None] | None, started: float) -> None:
        self.spec, self.s, self.pm = spec, session, session.packer.model
        self.train_examples, self.eval_data = train_examples, eval_data
        self.pack_id, self.progress = pack_id, progress
        self.live: dict[int, _Live] = {}
        self.to_prune: set[int] = set()
        self.global_step = 0
        self.t_start = started  # the pack row's start: tokens/s and elapsed mean what the packs table means
        self.step_t = time.perf_counter()
        self.summary = RunSummary(pack_id)
        metric, direction = spec.prune_metric()
        self.proxy = metric
        self.sha = (CohortSHA(spec.pruning.rungs, spec.pruning.reduction_factor, direction,
                              session.rung_history(metric)) if spec.pruning.kind == "cohort_sha" else None)
        self.entries = [(e.name, dict(e.options)) for e in spec.evaluators]
        self.plan = TokenPlan(train_examples, spec.seed)
        self.heartbeat: Heartbeat | None = None
        self.last_reap = time.time()
        self.pack_step0 = self.pack_tokens0 = 0  # the run's steps and tokens when the current pack started
        self.idle_until = 0.0  # shared budget spent: look again after a heartbeat, not before every step
        self.log: Callable[[str], None] = print
        self.split = WallSplit()
        self.warned_warmup = False
        self.ranks: Channel | None = None  # a sharded pack's other ranks, told every decision (sweep.ranks)
        self.hung: EvaluatorHung | None = None  # a user evaluator overran: the run stops (stop_if_hung)
        self.eval_failed: dict[int, str] = {}  # slot -> why its evaluation at a rung failed: it stops as FAIL
        self.paced_from: tuple[float, int] | None = None  # (wall time, run step) the ETA's pace counts from

    def _lock(self) -> Any:
        sharing = self.s.sharing
        return storage_lock(sharing.url, self.spec.name) if sharing is not None else nullcontext()

    def live_numbers(self) -> list[int]:
        return [lv.trial.number for lv in list(self.live.values())]

    # -- asking -------------------------------------------------------------------------------
    def next_job(self, slot: int) -> jobs.SlotJob | None:
        """Backfill: ask Optuna for a trial while the budget allows."""
        if time.time() < self.idle_until:
            return None
        with self._lock():  # count + ask, atomic across workers sharing the study
            budget = budget_state(self.spec, self.s, live=len(self.live), elapsed=time.time() - self.t_start,
                                  live_tokens=sum(lv.tokens for lv in self.live.values()),
                                  mine={lv.trial.number for lv in self.live.values()})
            if budget.exhausted:
                self.summary.spent, self.summary.spent_key = budget.reason, budget.key
                if self.s.sharing is not None:
                    self.idle_until = time.time() + self.s.sharing.heartbeat
                return None
            trial = self.s.ledger.ask(worker=self.s.sharing.worker if self.s.sharing is not None else None)
            params = suggest(trial, self.spec.search)
            spec = adapter_spec(params, self.spec.train, self.spec.seed, space=self.spec.search)
            spec = trial_adapter(self.spec, spec, list(params), self.train_examples)
            # Under the lock: the next worker to count sees this trial's tokens before it asks.
            Ledger.plan(trial, planned_tokens(self.spec, spec, self.train_examples, self.plan))
        self.live[slot] = _Live(trial, params, spec, self.global_step, time.time())
        if spec.warmup_steps >= spec.max_steps and not self.warned_warmup:
            self.warned_warmup = True  # once a run: every such trial has the same cause
            self.log(f"warning: trial {trial.number} warms up for {spec.warmup_steps} steps of its {spec.max_steps}: "
                     f"it trains at a fraction of its learning rate throughout; set train.warmup_ratio (e.g. "
                     f"warmup_ratio=0.1, and warmup_steps=0) to scale the warm-up with each trial's steps")
        # said when it happens, not with the next progress frame (after the step, which compiles at first)
        self.log(Note(f"trial {trial.number}{_role(trial)} started in slot {slot}: {_params_text(params)}"))
        with self.s.store.transaction():  # one commit (one log sync) for the trial's row and its span
            self.s.store.upsert_trial(trial.number, state="RUNNING", params=params, pack_id=self.pack_id, slot=slot,
                                      started=time.time(), user_attrs=dict(trial.user_attrs))
            self.s.store.open_span(self.pack_id, slot, trial.number, start_step=self.global_step)
        # Every trial sees the same data order (one data seed): pack peers are paired samples.
        return jobs.SlotJob(spec, trial_stream(self.spec, spec, self.train_examples), key=trial.number)

    # -- each step ----------------------------------------------------------------------------
    def on_step(self, reports: list[jobs.StepReport]) -> None:
        now = time.perf_counter()
        step_s, self.step_t = now - self.step_t, now
        step_tokens = sum(r.tokens for r in reports) or 1
        arrivals: dict[int, int] = {}
        for r in reports:
            lv = self.live[r.slot]
            lv.tokens += r.tokens
            lv.device_s += step_s * r.tokens / step_tokens  # the step's time, shared by trained tokens
            lv.steps.append({"step": r.slot_step, "loss": r.loss, "tokens": lv.tokens, "lr": r.lr,
                             "grad_norm": r.grad_norm, "time": time.time()})
            if self.sha is not None and r.slot_step in self.sha.rungs and r.slot_step < lv.spec.max_steps:
                arrivals[r.slot] = r.slot_step
        self.global_step = reports[0].step + 1
        self.summary.steps, self.summary.tokens = self.pack_step0 + self.global_step, self.summary.tokens + step_tokens
        if self.global_step % CURVE_EVERY == 0:  # the plan's storage times this cadence
            self._flush_curves()
        if self.s.sharing is not None and time.time() - self.last_reap > 2 * self.s.sharing.heartbeat:
            self.reap()
        every = self.spec.train.eval_every
        due = {r.slot: r.slot_step for r in reports if every is not None and r.slot_step % every == 0}
        if due:
            self._eval_curve(due)
        if arrivals:
            self._rung(arrivals)
        self._fail_hung_at_step({**due, **arrivals})
        self.show(len(reports))

    def show(self, active: int, phase: str = "training") -> None:
        """Send the progress frame: after each step, before each evaluation (``phase`` evaluating) and after trials
        end (the last frame is current)."""
        if self.progress is None:
            return
        now = time.time()
        elapsed = max(now - self.t_start, 1e-9)
        if phase == "training" and self.paced_from is None:  # the first step's end: the pace counts from here
            self.paced_from = (now, self.summary.steps)
        self.progress(Progress(self.global_step, active, self.s.capacity, self.summary.tokens / elapsed,
                               self.s.finished_count(), self.spec.budget.trials, self.s.best_text(),
                               self._eta(now), phase))

    def _eta(self, now: float) -> float | None:
        """Seconds left: the budget's packed steps left (``sweep.eta``: the live trials' expected steps, those not
        started yet at their expected steps under the rungs) at this run's seconds per packed step since its first,
        capped by the wall-time budget; None before the first step."""
        b, done = self.spec.budget, self.s.finished_count()
        if b.trials is not None and done >= b.trials:
            return 0.0
        etas = []
        if b.wall_time is not None:
            etas.append(max(0.0, b.wall_time - self.s.elapsed - (now - self.t_start)))
        if b.trials is not None and self.paced_from is not None and self.summary.steps > 0:
            since, step0 = self.paced_from
            # The loop hands the steps over in bursts (``packer.step.loop``: losses read back every few steps), so
            # the pace counts from the first frame once a second has passed; before, from the pack's start (its
            # first step's warm-up and compile too: an ETA that only shrinks).
            paced = now - since >= 1.0 and self.summary.steps > step0
            per_step = ((now - since) / (self.summary.steps - step0) if paced
                        else (now - self.t_start) / self.summary.steps)
            rungs, factor = (self.sha.rungs, self.spec.pruning.reduction_factor) if self.sha else ((), 1)
            live = [steps_left(self.global_step - lv.start_step, lv.spec.max_steps, rungs, factor)
                    for lv in self.live.values()]
            max_steps = [lv.spec.max_steps for lv in self.live.values()] or [self.spec.train.max_steps]
            per_trial = expected_steps(round(sum(max_steps) / len(max_steps)), rungs, factor)
            waiting = b.trials - done - len(self.live)
            etas.append(pack_steps_left(live, waiting, per_trial, self.s.capacity) * per_step)
        return min(etas) if etas else None

    def reap(self) -> list[int]:
        """Fail and retry the trials of dead workers (their retries are asked by the next free slot)."""
        assert self.s.sharing is not None
        self.last_reap = time.time()
        with self._lock():
            return self.s.ledger.reap(self.s.sharing.grace)

    def _flush_curves(self) -> None:
        curves = {lv.trial.number: lv.steps for lv in self.live.values() if lv.steps}
        if curves:
            self.s.store.add_curves(curves)
        for lv in self.live.values():
            lv.steps = []

    def _eval_curve(self, due: dict[int, int]) -> None:
        """``train.eval_every``: the curve metric of the slots at such a step (the held-out loss, or what the entry
        serving the curve declares: ``curve_entry``), stored as a curve and, when it is the pruner's metric with one
        objective, given to Optuna as the intermediate value at that step."""
        entry, metric = curve_entry(self.entries)  # the evaluator that declares it serves the curve
        with self.split.phase("evaluate"):
            result = self._scored(sorted(due), [entry])
        for slot, step in due.items():
            lv = self.live[slot]
            value = result.metrics.get(slot, {}).get(metric, math.nan)
            self.s.store.add_eval(lv.trial.number, step, {metric: value}, kind="curve")
            if self.proxy == metric:  # the pruner's metric: intermediate values never mix two metrics
                lv.report(value, step, len(self.spec.objectives) == 1)

    def _rung(self, arrivals: dict[int, int]) -> None:
        """Score the slots reaching a rung on the proxy metric and let cohort SHA decide."""
        assert self.sha is not None
        result = self._evaluate(sorted(arrivals), proxy_only=True)  # charged to the slots it scores
        with self.s.store.transaction():  # the rung's values and decisions in one commit: all of them or none
            self._decide(arrivals, result)

    def _decide(self, arrivals: dict[int, int], result: EvalResult) -> None:
        """Record the rung values of the arriving slots and cohort SHA's decisions; mark the slots to stop."""
        assert self.sha is not None
        for slot, err in result.errors.items():  # a user evaluator failed on it: the trial stops as FAIL
            if slot in arrivals:
                self.eval_failed[slot] = f"at the rung of step {arrivals[slot]}: {err.reason}"
                self.to_prune.add(slot)
        for rung in sorted(set(arrivals.values())):
            values = {}
            for slot in (s for s, r in arrivals.items() if r == rung and s not in self.eval_failed):
                value = result.metrics.get(slot, {}).get(self.proxy, math.nan)
                values[self.live[slot].trial.number] = value
                self.s.store.add_eval(self.live[slot].trial.number, rung, {self.proxy: value}, kind="rung")
                self.live[slot].report(value, rung, len(self.spec.objectives) == 1)
            for d in self.sha.decide(rung, values):
                slot = next(s for s, lv in self.live.items() if lv.trial.number == d.trial)
                # The community default and the config baseline are ranked (they set the bar) but never
                # stopped: the report compares the best with their final scores. Its row says it is kept, and why.
                role = _role(self.live[slot].trial)
                spared = not d.keep and bool(role)
                reason = (f"kept as the {role.strip(' ()')}, which is never pruned (below the cut: {d.reason})"
                          if spared else d.reason)
                self.s.store.add_prune_decision(self.pack_id, rung, d.trial, "keep" if d.keep or spared else "prune",
                                                value=d.value, rank=d.rank + 1, cohort_size=d.cohort_size,
                                                reason=reason)
                if not d.keep and not spared:
                    self.to_prune.add(slot)

    def retry_after_oom(self, why: str) -> None:
        """The pack ran out of memory: fail its training trials (not counted: each is enqueued again
        with its parameters, like a stopped run's orphans) and free their slots."""
        self._flush_curves()
        for slot, lv in sorted(self.live.items()):
            reason = f"out of memory at pack step {self.global_step} ({why}); retried in a smaller pack"
            self.s.store.close_span(self.pack_id, slot, lv.trial.number, end_step=self.global_step, end_reason="oom")
            self.s.ledger.requeue([lv.trial], reason, log=lambda m: None)
            self.pm.remove_slot(slot)
        self.live.clear()
        self.to_prune.clear()

    def new_pack(self, pack_id: int) -> None:
        """Carry on in pack ``pack_id``: its steps count from 0 again, the run's totals go on."""
        self.pack_id, self.global_step = pack_id, 0
        self.pack_step0, self.pack_tokens0 = self.summary.steps, self.summary.tokens

    def should_stop(self, report: jobs.StepReport) -> bool:
        return report.slot in self.to_prune

    # -- leaving ------------------------------------------------------------------------------
    def _evaluate(self, slots: list[int], *, proxy_only: bool = False) -> EvalResult:
        """Score ``slots``; each is charged an equal share of the evaluation's time (device_seconds),
        and the next training step's clock starts after it, so no trial pays for another's evaluation."""
        entries = self.entries
        if proxy_only:
            entries = [e for e in entries if self.proxy in metrics_of(*e)] or entries
        t0 = time.perf_counter()
        with self.split.phase("evaluate"):
            result = self._scored(slots, entries)
        self.step_t = time.perf_counter()
        for slot in slots:
            self.live[slot].device_s += (self.step_t - t0) / len(slots)
        return result

    def _scored(self, slots: list[int], entries: list[tuple[str, dict[str, Any]]]) -> EvalResult:
        """``evaluate`` the slots; a sharded pack's other ranks run the same forwards meanwhile (``sweep.ranks``).
        A user evaluator that hangs (``EvaluatorHung``) fails the slots it scored; the run stops after the caller
        has told them (``stop_if_hung``)."""
        self.show(len(self.live), "evaluating")  # said as it starts: an evaluation can take minutes
        if self.ranks is not None:
            self.ranks.send("evaluate", (slots, entries))
        wall = self.spec.budget.wall_time
        deadline = (None if wall is None else
                    time.monotonic() + wall - self.s.elapsed - (time.time() - self.t_start))
        limits = Limits({e.name: e.timeout for e in self.spec.evaluators}, deadline,
                        {e.name: f"evaluators.{i}.timeout" for i, e in enumerate(self.spec.evaluators)},
                        grace=max(10.0, 0.1 * wall) if wall is not None else 0.0)
        try:
            return evaluate(self.pm, slots, self.eval_data, entries, timings=self._eval_timings, limits=limits)
        except EvaluatorHung as hung:
            self.hung = hung
            return hung.result

    def stop_if_hung(self) -> None:
        """After a hung evaluator's trials were told: the trials still training are failed and enqueued again (the
        study's resume retries them, as a stopped run's), and the run stops with the reason.

        Raises:
            EvaluatorHung: an evaluation of this run hung.
        """
        if self.hung is None:
            return
        self._flush_curves()
        for slot, lv in sorted(self.live.items()):
            self.s.store.close_span(self.pack_id, slot, lv.trial.number, end_step=self.global_step, end_reason="stop")
            self.s.ledger.requeue([lv.trial], f"the run stopped: {self.hung}; retried when the study is resumed",
                                  log=lambda m: None)
        self.live.clear()
        raise self.hung

    def _eval_timings(self, name: str, seconds: float) -> None:
        self.split.add(f"evaluate:{name}", seconds)

    def on_end(self, ends: list[jobs.SlotEnd]) -> None:
        self._flush_curves()
        done = [e for e in ends if e.reason == "finished"]
        writes = self._write_adapters(done)  # written while they are evaluated
        result = self._evaluate([e.slot for e in done]) if done else EvalResult()
        verdicts = {e.slot: self._verdict(e, self.live[e.slot], result) for e in done}
        with self.split.phase("save"):  # only what the writer has not finished yet waits here
            adapters = {e.slot: w.result() for e, w in zip(done, writes, strict=True)}
        for e in done:
            if verdicts[e.slot][2] is not None:  # a trial that fails keeps no adapter
                Packer.discard_adapter(adapters.pop(e.slot))
        for e in ends:
            lv = self.live.pop(e.slot)
            self.to_prune.discard(e.slot)
            if e.reason == "finished":
                self._complete(e, lv, result, *verdicts[e.slot], adapters.get(e.slot))
            elif e.reason == "stopped" and e.slot in self.eval_failed:
                self._tell(lv, TrialState.FAIL, e, reason=self.eval_failed.pop(e.slot))
            elif e.reason == "stopped":
                self._tell(lv, TrialState.PRUNED, e, reason=f"pruned by cohort SHA at step {e.steps}")
            else:
                self._tell(lv, TrialState.FAIL, e, reason=f"{e.reason} at step {e.steps}")
        self.show(len(self.live))
        self.step_t = time.perf_counter()  # saving adapters and telling Optuna are no trial's step
        self.stop_if_hung()

    def _fail_hung_at_step(self, steps: dict[int, int]) -> None:
        """A rung or curve evaluation hung: the slots it scored fail now (``steps``: slot -> the trial's step), the
        others are retried, and the run stops (``stop_if_hung``)."""
        if self.hung is None:
            return
        self._flush_curves()
        for slot in sorted(set(self.hung.result.errors) & set(self.live) & set(steps)):
            end = jobs.SlotEnd(slot, None, steps[slot], "failed")  # type: ignore[arg-type]  # no job: it ends here
            self._tell(self.live.pop(slot), TrialState.FAIL, end, reason=self.hung.result.errors[slot].reason)
        self.stop_if_hung()

    def _write_adapters(self, done: list[jobs.SlotEnd]) -> list[Future[Path]]:
        """Queue the adapters of the slots that finished on the packer's writer (``Packer.save``: their weights
        copied off the slots now, the files written on its threads); one future per slot.

        A trial is told COMPLETE only once its adapter is durable: ``on_end`` waits for the write after the
        evaluation that it overlaps, before the tell. Telling at the next step boundary instead would let the next
        asks run before it, and the sampler propose other trials than a seeded study does (``constant_liar`` sees
        a trial RUNNING until it is told). A kill before the tell leaves the trial RUNNING: resume fails and retries
        it, and removes what its write left (``sweep.ledger``).
        """
        with self.split.phase("save"):
            return self.s.packer.save([(e.slot, self.s.adapter_dir(self.live[e.slot].trial.number),
                                        {"trial": str(self.live[e.slot].trial.number), "study": self.spec.name})
                                       for e in done])

    def _verdict(self, e: jobs.SlotEnd, lv: _Live,
                 result: EvalResult) -> tuple[dict[str, float], list[float], str | None]:
        """(metrics, objective values, why the trial fails or None) of a slot that finished training."""
        if e.slot in result.errors:
            return {}, [], result.errors[e.slot].reason
        metrics = dict(result.metrics.get(e.slot, {}))
        metrics.update(cost_metrics(adapter_params=slot_adapter_params(self.pm, e.slot), trial_tokens=lv.tokens,
                                    pack_tokens=lv.tokens, pack_seconds=lv.device_s))
        values = [metrics.get(o.metric, math.nan) for o in self.spec.objectives]
        bad = [o.metric for o, v in zip(self.spec.objectives, values, strict=True) if not math.isfinite(v)]
        return metrics, values, f"objective {', '.join(bad)} is not finite" if bad else None

    def _complete(self, e: jobs.SlotEnd, lv: _Live, result: EvalResult, metrics: dict[str, float], values: list[float],
                  failed: str | None, adapter: Path | None) -> None:
        number = lv.trial.number
        if failed is not None:
            self._tell(lv, TrialState.FAIL, e, metrics=metrics or None, reason=failed)
            return
        assert adapter is not None, "on_end saves the adapter of every trial whose verdict passes"
        for c in self.spec.constraints:
            lv.trial.set_constraint(c.metric, c.violation(metrics.get(c.metric)))
        Ledger.set_adapter(lv.trial, adapter)
        samples = result.samples.get(e.slot, [])
        with self.s.store.transaction():  # one commit for the per-item scores and the final metrics
            for metric, items in result.per_item.get(e.slot, {}).items():
                self.s.store.add_items(number, metric, items, _texts(samples, metric, len(items)))
            self.s.store.add_eval(number, e.steps, metrics, kind="final")
        self._tell(lv, TrialState.COMPLETE, e, metrics=metrics, values=values,
                   adapter=str(adapter.relative_to(self.s.sdir.root) if adapter.is_relative_to(self.s.sdir.root)
                               else adapter))

    def _tell(self, lv: _Live, state: TrialState, e: jobs.SlotEnd, *, reason: str | None = None,
              metrics: dict[str, float] | None = None, values: list[float] | None = None,
              adapter: str | None = None) -> None:
        """Record in the store first, then tell Optuna (the source of truth): a kill in between leaves
        the trial RUNNING in Optuna, and resume fails and retries it."""
        number = lv.trial.number
        with self.s.store.transaction():
            self.s.store.upsert_trial(number, state=state.name, metrics=metrics, objective_values=values,
                                      adapter_path=adapter, steps_done=e.steps, tokens=lv.tokens,
                                      device_seconds=lv.device_s, finished=time.time(), reason=reason)
            self.s.store.close_span(self.pack_id, e.slot, number, end_step=self.global_step, end_reason=e.reason)
        self.s.ledger.tell(lv.trial, state, values, reason=reason, tokens=lv.tokens)
        self.s.record(number, state, values, lv.tokens)
        counter = {"COMPLETE": "complete", "PRUNED": "pruned"}.get(state.name, "failed")
        setattr(self.summary, counter, getattr(self.summary, counter) + 1)
        scores = {o.metric: v for o, v in zip(self.spec.objectives, values or [], strict=False)}
        what = (f"complete: {_params_text(scores)}" if state == TrialState.COMPLETE
                else reason if state == TrialState.PRUNED else f"failed: {reason}")
        self.log(Note(f"trial {number}{_role(lv.trial)} {what} ({e.steps} steps, {lv.tokens:,} tokens)"))


def _role(trial: optuna.Trial) -> str:
    """' (community default)', ' (config baseline)' (the config's own hyperparameters), both, or '' for a trial
    the sampler proposed."""
    names = [n for n, key in (("community default", attrs.DEFAULT), ("config baseline", attrs.BASELINE))
             if trial.user_attrs.get(key)]
    return f" ({', '.join(names)})" if names else ""


def _params_text(values: dict[str, Any]) -> str:
    """``rank=8, lr=0.001`` (floats to 4 significant digits)."""
    return ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in values.items())


def _texts(samples: list[dict[str, Any]], metric: str, n: int) -> list[dict[str, Any]]:
    """Per-item details of ``metric`` from an evaluation's samples: {prompt, output, reference}.

    A generative evaluator's samples hold one record per item, in item order, with its scores by
    metric name (``EvalResult.samples``); several evaluators' records are concatenated, so the
    records scoring ``metric`` are its own. None found (a loss), or not one per item: no details.
    """
    own = [r for r in samples if metric in r]
    if len(own) != n:
        return []
    return [{"prompt": r.get("prompt"), "output": r.get("generation"), "reference": r.get("reference")} for r in own]


def run_study(spec: StudySpec, *, progress: Callable[[Progress], None] | None = None,
              log: Callable[[str], None] = print, sharing: Sharing | None = None,
              allow_changes: bool = False, ranks: Channel | None = None, allow_data_change: bool = False
              ) -> RunSummary:
    """Run (or resume) the study until its budget ends; returns what this call did.

    With ``sharing`` this is one pack of a worker: other workers share the study's storage and budget.
    ``allow_changes``: resume even if a fixed setting changed (``sweep.session.spec_changes``).
    ``allow_data_change``: resume even if a data file's contents changed (``sweep.resume.record_data``).
    ``ranks``: rank 0's channel to the other ranks of a sharded pack (``pack.shard: fsdp``, ``sweep.ranks``).
    """
    spent = recorded_budget(spec, log) if sharing is None and ranks is None else None
    if spent is not None and spent.exhausted:  # a finished study's rerun: said before the model loads
        nothing = _nothing_to_run(spent)
        log(f"{spec.name}: {nothing.ended}")
        return nothing
    split = run_split()  # a `sweep run` command's, from the process's start
    with split.phase("load"), split.part("load:data"):
        check_data(spec)  # the rows before the model: a bad row costs no model load
    with split.phase("load"):
        session = open_session(spec, log=log, sharing=sharing, allow_changes=allow_changes, split=split,
                               allow_data_change=allow_data_change)
    packer = session.packer
    pm = packer.model
    already = _spent_before(spec, session)
    if already is not None:
        log(f"{spec.name}: {already.ended}")
        return already
    log(Note(f"tokenizing the data (data.max_length: {spec.data.max_length})"))
    try:  # a data error gives the study directory back (its lock, results.db) before it is reported
        with split.phase("load"), split.part("load:data"):
            check_packing(spec, packer)
            train_examples = packer.examples(spec.data.train, fmt=spec.data.format, max_length=spec.data.max_length,
                                             train_on_prompt=spec.data.train_on_prompt,
                                             max_line_bytes=spec.data.line_bytes)
            eval_data = (load_eval_data(spec.data.eval, packer.tokenizer, fmt=spec.data.format,
                                        max_length=spec.data.max_length, train_on_prompt=spec.data.train_on_prompt,
                                        work_dir=session.sdir.root, max_line_bytes=spec.data.line_bytes)
                         if spec.data.eval is not None else None)
    except BaseException:
        session.close()
        raise
    started = time.time()
    pack_id = session.store.start_pack(slots=session.capacity, device=str(pm.device), started=started)
    log(Note(f"pack {pack_id}: training {session.capacity} slots on {len(train_examples)} examples (its first step "
             f"also warms up{', compiles and captures' if pm.device.type == 'cuda' else ''})"))
    sweep = _Sweep(spec, session, train_examples, eval_data, pack_id, progress, started)
    sweep.log, sweep.split, sweep.ranks = log, split, ranks
    if sharing is not None:
        sweep.heartbeat = session.ledger.heartbeat(sweep.live_numbers, sharing.heartbeat)
    summary = sweep.summary
    try:
        with sweep.heartbeat or nullcontext():
            while not _train_pack(sweep, session):  # False: out of memory, the pack shrank; train again
                pass
        summary.wall_s = time.time() - started
        state = BudgetState(True, summary.spent, summary.spent_key)
        summary.ended, summary.over = end_line(spec, state, trials=session.finished, tokens=session.tokens,
                                               elapsed=session.elapsed + summary.wall_s)
        summary.end_reason = summary.spent_key or "grid"
    except BaseException as err:
        interrupt = _interrupt_in(err)
        summary.end_reason, summary.ended = _stopped(interrupt or err, sweep)
        if interrupt is not None:
            interrupt.add_note(STOP_SAID)
            if interrupt is not err:  # a library's error around it: the caller sees the Ctrl-C or SIGTERM itself
                raise interrupt from None
        raise
    finally:
        if summary.end_reason != "error":  # an error's own message is its one line (the CLI's error:, a traceback)
            log(f"{spec.name}: {summary.ended}")
        with split.phase("storage"):
            session.add_elapsed(time.time() - started)
            session.store.set_meta(last_end={"reason": summary.end_reason, "text": summary.ended,
                                             "over": summary.over, "at": time.time()})
            session.close()
        split.add("save:writer", session.packer.save_seconds)  # the writer's threads, beside the run's path
        summary.split = {**split.record(), "end": {"reason": summary.end_reason, "text": summary.ended,
                                                   "over": summary.over}}
        with sweep._lock():  # workers sharing the study directory append one after another
            append_run(session.sdir.root, summary.split)
    return summary


def _spent_before(spec: StudySpec, session: Session) -> RunSummary | None:
    """A study whose budget is already spent (a shared one, or one ``recorded_budget`` could not read): the session
    closed and ``_nothing_to_run``; None when the budget has room."""
    with storage_lock(session.sharing.url, spec.name) if session.sharing is not None else nullcontext():
        state = budget_state(spec, session, live=0, elapsed=0.0, live_tokens=0)
    if not state.exhausted:
        return None
    session.close()
    return _nothing_to_run(state)


def _nothing_to_run(state: BudgetState) -> RunSummary:
    """The summary of a run that found the budget spent: it trained and wrote nothing (no pack, no timing row, no
    run end in the store's meta)."""
    more = f": raise {state.key} to continue" if state.key else ""
    return RunSummary(0, spent=state.reason, spent_key=state.key, end_reason=state.key or "grid",
                      ended=f"nothing to run: the budget was already spent ({state.reason}) before this run{more}",
                      already_spent=True)


def _interrupt_in(err: BaseException) -> KeyboardInterrupt | None:
    """The Ctrl-C or SIGTERM (``Terminated``) behind ``err``: ``err`` itself, or one a library wrapped in an error of
    its own on the way, found down the cause and context chain. A Ctrl-C landing inside transformers' lazy import of
    a name (``get_scheduler`` at a slot's first step) surfaced as "Could not import module 'get_scheduler'" (Python
    wraps it in a RuntimeError around a class body's ``__set_name__``, transformers that in ModuleNotFoundError), and
    the run ended as an error instead of a resumable stop."""
    seen: set[int] = set()
    link: BaseException | None = err
    while link is not None and id(link) not in seen:
        if isinstance(link, KeyboardInterrupt):
            return link
        seen.add(id(link))
        link = link.__cause__ or link.__context__
    return None


def _stopped(err: BaseException, sweep: _Sweep) -> tuple[str, str]:
    """(reason key, one line) of a run that an interrupt, a SIGTERM or an error stopped."""
    done = sweep.summary.complete + sweep.summary.pruned + sweep.summary.failed
    left = (f" at pack step {sweep.global_step} ({done} trials finished in this run; the "
            f"{len(sweep.live)} training are retried when the run is resumed)")
    resume = "; a study keeps what finished: run the same command again to resume"
    if isinstance(err, Terminated):  # before KeyboardInterrupt: it is one
        return "sigterm", f"stopped: terminated (SIGTERM){left}{resume}"
    if isinstance(err, KeyboardInterrupt):
        return "interrupt", f"stopped: interrupted (Ctrl-C){left}{resume}"
    first = first_line(err)
    return "error", f"stopped by an error{left}: {first}"


def _train_pack(sweep: _Sweep, session: Session) -> bool:
    """Train the current pack until the budget ends (True), or until a CUDA out-of-memory error (False):
    the trials that were training are retried and the next pack gets one slot fewer than ran out.

    Raises:
        UserError: out of memory with a single slot (nothing smaller to try).
    """
    pm, spec = session.packer.model, sweep.spec
    if pm.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(pm.device)
    status, step, fallback = "failed", None, None
    phased = sweep.split.timed  # the callbacks' own work is storage; evaluations and saves inside are their own
    sharded = spec.pack.shard == "fsdp"
    options = dict(chunked_ce=spec.pack.chunked_ce, activation_checkpointing=spec.pack.activation_checkpointing,
                   # no graph under FSDP (packer.model.shard)
                   cuda_graphs="off" if sharded else spec.pack.cuda_graphs,
                   sync_steps=tuple(sweep.sha.rungs) if sweep.sha else (),
                   optimizer_in_backward=spec.train.optimizer_in_backward,
                   # the space's largest rank held from the first step, as the pack is planned: a rank bucket
                   # grown when such a trial arrives re-captures every graph and precompiles again
                   max_rows=largest_rank(spec),
                   # at most a few step lengths, fitted to the data: bounded shapes, bounded CUDA graphs and pools
                   lengths=step_lengths(spec, sweep.train_examples, session.capacity))
    callbacks = (phased("storage", sweep.next_job), phased("storage", sweep.on_step), sweep.should_stop,
                 phased("storage", sweep.on_end))
    if sweep.ranks is not None:  # every rank trains this pack with rank 0's decisions
        sweep.ranks.send("pack", (session.capacity, session.packer.pad_id, options))
        callbacks = sweep.ranks.lead(*callbacks)
    next_job, on_step, should_stop, on_end = callbacks
    try:
        with sweep.split.phase("train"):
            result = session.packer.train(session.capacity, next_job, on_step=on_step, should_stop=should_stop,
                                          on_end=on_end, **options)  # type: ignore[arg-type]
        for part, seconds in (("precompile", result.compile_s), ("warm-up", result.warmup_s),
                              ("capture", result.capture_s)):
            sweep.split.move(seconds, "train", "compile", detail=f"compile:{part}")
        step, fallback = result.step, result.fallback
        sweep.log(f"pack {sweep.pack_id}: trained on the {step} step ({jobs.STEP_NAMES[step]})")
        if fallback is not None:  # slower than asked: the log, sweep status and packs.fallback say why
            sweep.log(f"pack {sweep.pack_id}: CUDA graph capture failed, trained eagerly: {fallback}")
        status = "finished"
        return True
    except torch.OutOfMemoryError as err:
        if sharded:  # the other ranks are inside the step's collectives: no smaller pack to agree on
            raise UserError(f"pack.shard: out of memory on rank 0 with {len(sweep.live)} slots "
                            f"({first_line(err, 'CUDA out of memory')}); lower "
                            "pack.max_slots, or shard over more GPUs") from None
        status = "oom"
        training = len(sweep.live)
        sweep.retry_after_oom(first_line(err, "CUDA out of memory"))
        if training <= 1:
            raise UserError(f"out of memory with a single slot ({first_line(err)}); lower "
                            "data.max_length or the search space's largest rank / micro_batch, or set "
                            "pack.activation_checkpointing: true") from None
        session.capacity = training - 1
        sweep.log(f"pack {sweep.pack_id}: out of memory with {training} slots training; its trials are retried "
                  f"in a pack of {session.capacity} slots")
        return False
    finally:
        peak = torch.cuda.max_memory_allocated(pm.device) if pm.device.type == "cuda" else None
        with sweep.split.phase("storage"):
            session.store.finish_pack(sweep.pack_id, status=status, steps=sweep.summary.steps - sweep.pack_step0,
                                      tokens=sweep.summary.tokens - sweep.pack_tokens0, peak_mem_bytes=peak,
                                      step=step, fallback=fallback)
        if status == "oom":
            if pm.device.type == "cuda":
                torch.cuda.empty_cache()  # the failed step's activations, before the next pack plans on them
            sweep.new_pack(session.store.start_pack(slots=session.capacity, device=str(pm.device)))
