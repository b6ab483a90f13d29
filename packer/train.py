"""The packed training loop: many adapters, one frozen base model, one forward/backward per step.

Read ``train()`` top to bottom. Each step every active slot draws its own micro-batch from its own
stream; the rows of all slots go through the model together; each slot's loss is the mean over its
own target tokens, and the pack's loss is the sum of those means, so each slot's gradient is exactly
the gradient it would get training alone (a global token mean would rescale each slot's gradient by
its share of tokens: a hidden learning-rate change). Each slot then clips to its own norm and takes
its own AdamW step, every slot in one pass (``packer.optim.PackedAdamW``).

Gradient accumulation is per slot: a slot with ``gradient_accumulation_steps`` k draws the k
micro-batches of its next optimizer step at once, counts their target tokens N, and each of its
micro-batches adds (sum of its token losses) / N to the backward, so the accumulated gradient is that
of the mean over all N tokens, as if the k micro-batches were one batch (transformers'
``num_items_in_batch``): independent of the split. Only when its k-th micro-batch is in does a slot
clip, step and advance its schedule; slots with other k in the same pack keep accumulating. A slot
is reported (``StepReport``) once per optimizer step, with the loss and tokens of the whole step.

Slots have a lifecycle: when one finishes (``max_steps``) or is stopped (``should_stop``), the
caller is told (``on_end``: it may save or score the adapter, whose weights still exist) and the
slot is refilled with ``next_job`` while the pack keeps running.

Three memory options leave the losses and updates unchanged: ``chunked_ce`` computes the loss from
the final hidden states a chunk of target tokens at a time (``packer.loss``), never holding the
logits of the whole batch; ``activation_checkpointing`` recomputes each decoder layer in the backward;
``optimizer_in_backward`` (torchtune's ``optimizer_in_bwd``) takes each slot's AdamW step layer by layer
inside the backward, as soon as a layer's gradient is accumulated, and frees it, so no slot keeps a
gradient buffer (``packer.optim``). It needs the whole step in one micro-batch and no clipping (a norm
needs the whole gradient first): slots with ``max_grad_norm`` or ``gradient_accumulation_steps`` > 1 are
refused.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from lora_sweep.kernels import dropout_seed
from lora_sweep.packer.batch import IGNORE_INDEX, PackBatch, Row, collate, row_slots
from lora_sweep.packer.errors import ConfigError
from lora_sweep.packer.isolation import check_sample_packing
from lora_sweep.packer.jobs import (
    STEP_NAMES,
    BatchSource,
    FixedBatch,
    SlotEnd,
    SlotJob,
    StepReport,
    Tally,
    TrainResult,
    Window,
    target_tokens,
)
from lora_sweep.packer.loss import DEFAULT_CHUNK_TOKENS, chunked_slot_losses
from lora_sweep.packer.model import PackedModel
from lora_sweep.packer.optim import PackedAdamW
from lora_sweep.packer.plan import AdapterSpec

__all__ = ["BatchSource", "FixedBatch", "SlotJob", "SlotEnd", "StepReport", "TrainResult", "train", "slot_losses",
           "make_optimizer", "make_scheduler", "chunk_tokens_of", "check_in_backward", "target_tokens",
           "STEP_NAMES"]


@dataclass
class _Active:
    job: SlotJob
    params: list[nn.Parameter]
    window: Window
    steps: int = 0
    """Optimizer steps taken."""
    micro: int = 0
    """Micro-batches trained (seeds the dropout masks; equals ``steps`` without accumulation)."""
    tally: Tally = field(default_factory=Tally)


def make_optimizer(params: Sequence[nn.Parameter], spec: AdapterSpec) -> torch.optim.Optimizer:
    """One adapter's own torch AdamW: what one-trial-at-a-time baselines use (the pack uses PackedAdamW)."""
    # One fused multi-tensor kernel per slot on CUDA; on CPU foreach (a handful of multi-tensor ops
    # instead of ~10 small ops per tensor, the CPU default). Same update rule either way.
    fast = {"fused": True} if params and params[0].is_cuda else {"foreach": True}
    return torch.optim.AdamW(params, lr=spec.lr, betas=spec.betas, eps=spec.eps, weight_decay=spec.weight_decay,
                             **fast)


def make_scheduler(optimizer: torch.optim.Optimizer, spec: AdapterSpec) -> torch.optim.lr_scheduler.LRScheduler:
    """Warm-up then ``spec.schedule``, by the names and formulas of ``transformers.get_scheduler``."""
    from transformers import get_scheduler

    name = "constant_with_warmup" if spec.schedule == "constant" else spec.schedule
    return get_scheduler(name, optimizer, num_warmup_steps=spec.warmup_steps, num_training_steps=spec.max_steps)


def slot_losses(logits: torch.Tensor, labels: torch.Tensor, batch: PackBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-slot mean next-token cross-entropy over target tokens.

    Args:
        logits: (B, L, V).
        labels: (B, L) unshifted labels, ``IGNORE_INDEX`` where no loss is taken.
        batch: the packed batch (for its layout).

    Returns:
        (N,) float32 mean losses (0 for a slot without target tokens) and (N,) target-token counts.
    """
    b, seq, vocab = logits.shape
    shift_labels = labels[:, 1:]  # (B, L-1)
    ce = F.cross_entropy(logits[:, :-1].reshape(-1, vocab).float(), shift_labels.reshape(-1),
                         ignore_index=IGNORE_INDEX, reduction="none").view(b, seq - 1)
    layout = batch.layout
    seg = row_slots(layout, logits.device)
    n = len(layout.slots)
    sums = torch.zeros(n, dtype=torch.float32, device=logits.device).index_add(0, seg, ce.sum(dim=1))
    counts = torch.zeros(n, dtype=torch.float32, device=logits.device).index_add(
        0, seg, (shift_labels != IGNORE_INDEX).sum(1).float())
    return sums / counts.clamp(min=1.0), counts


def _pack_losses(pm: PackedModel, batch: PackBatch, chunk_tokens: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-slot losses and target counts of one forward: full logits, or chunked from the hidden states."""
    if chunk_tokens is None:
        logits = pm.forward(batch.input_ids, batch.attention_mask, batch.layout, batch.position_ids)
        return slot_losses(logits, batch.labels, batch)
    hidden = pm.forward_hidden(batch.input_ids, batch.attention_mask, batch.layout, batch.position_ids)
    return chunked_slot_losses(hidden, pm.output_head(), batch.labels, batch.layout, chunk_tokens=chunk_tokens)


def chunk_tokens_of(chunked_ce: bool | int) -> int | None:
    """Tokens per loss chunk for a ``chunked_ce`` option (None: not chunked)."""
    if chunked_ce is True:
        return DEFAULT_CHUNK_TOKENS
    if chunked_ce is False:
        return None
    if chunked_ce < 1:
        raise ValueError(f"chunked_ce: tokens per chunk must be >= 1 (got {chunked_ce})")
    return int(chunked_ce)


def _start(pm: PackedModel, optimizer: PackedAdamW, slot: int, job: SlotJob) -> _Active:
    if job.spec.sample_packing:
        check_sample_packing(pm)
    if pm.state.grad_sink is not None:
        check_in_backward(job.spec)
    params = pm.add_slot(slot, job.spec)
    optimizer.add_slot(slot, *pm.flat_buffers(slot), job.spec)
    return _Active(job, params, Window(job.spec.gradient_accumulation_steps))


def check_in_backward(spec: AdapterSpec) -> None:
    """Refuse an adapter the optimizer step in the backward cannot train exactly.

    Raises:
        ConfigError: ``max_grad_norm`` set (clipping needs the whole gradient before the step) or
            ``gradient_accumulation_steps`` > 1 (the step needs every micro-batch's gradient first).
    """
    if spec.max_grad_norm is not None:
        raise ConfigError(f"optimizer_in_backward: needs max_grad_norm: null (got {spec.max_grad_norm}): clipping "
                          "needs the whole gradient before the step")
    if spec.gradient_accumulation_steps != 1:
        raise ConfigError(f"optimizer_in_backward: needs gradient_accumulation_steps: 1 (got "
                          f"{spec.gradient_accumulation_steps}): the step needs every micro-batch's gradient first")


def train(
    pm: PackedModel,
    capacity: int,
    next_job: Callable[[int], SlotJob | None],
    *,
    pad_id: int,
    on_step: Callable[[list[StepReport]], None] | None = None,
    should_stop: Callable[[StepReport], bool] | None = None,
    on_end: Callable[[list[SlotEnd]], None] | None = None,
    max_global_steps: int | None = None,
    chunked_ce: bool | int = False,
    activation_checkpointing: bool = False,
    static_shapes: bool | None = None,
    cuda_graphs: str = "auto",
    readback_every: int = 8,
    sync_steps: Collection[int] = (),
    rank_bucket: int | None = None,
    optimizer_in_backward: bool = False,
) -> TrainResult:
    """Train adapters in ``capacity`` slots until no job is left.

    Args:
        pm: the packed model (base frozen; slots are added and removed here).
        capacity: number of slots.
        next_job: called with each free slot id before every step; returns a job or None. The run
            ends when no slot is active and every call returns None.
        pad_id: padding token id.
        on_step: receives the ``StepReport`` of every slot that took an optimizer step in a global step
            (every active slot, without accumulation); not called when none did.
        should_stop: asked per slot after each step (after ``on_step``); True ends the slot early.
        on_end: receives the slots that end at this step, together (so they can be saved and scored
            in one packed pass), before their weights are released.
        max_global_steps: stop after this many global steps (the slots still running are ended
            with reason ``interrupted``).
        chunked_ce: compute the loss from the hidden states, a chunk of target tokens at a time
            (True: ``packer.loss.DEFAULT_CHUNK_TOKENS`` per chunk; an int: that many).
        activation_checkpointing: recompute decoder layers in the backward; set on ``pm`` for this
            run and left as set.
        static_shapes: run the static-shape step (``packer.static_loop``: fixed shapes, per-step values in
            device buffers, losses read back every ``readback_every`` steps, so ``on_step`` and
            ``should_stop`` see each step up to that many steps late; gradient accumulation, sample packing,
            activation checkpointing and ``chunked_ce`` are data or switches of it); None: on CUDA.
        cuda_graphs: static path only: ``auto`` / ``on`` capture the step as a CUDA graph on CUDA (falling
            back to eager with a warning if capture fails); ``off`` runs it eagerly.
        readback_every, sync_steps, rank_bucket: static path only, see ``packer.static_loop.train_static``.
        optimizer_in_backward: take every slot's AdamW step inside the backward, layer by layer, and keep no
            gradient buffers (the dynamic step). The static step keeps its one preallocated gradient buffer (the
            size of the pack's adapter weights, fp32) and steps after the backward, the same updates: there it
            checks the jobs the same way and warns once that the memory saving is not taken.

    Returns:
        Totals of the run.

    Raises:
        ConfigError: ``chunked_ce`` for a model that post-processes its logits,
            ``activation_checkpointing`` for a model without support for it, or with
            ``optimizer_in_backward`` a job that clips or accumulates (``check_in_backward``).
    """
    if cuda_graphs not in ("auto", "on", "off"):
        raise ValueError(f"cuda_graphs must be auto, on or off (got {cuda_graphs!r})")
    chunk_tokens = chunk_tokens_of(chunked_ce)
    if static_shapes is None:
        static_shapes = pm.device.type == "cuda"
    if static_shapes:
        from lora_sweep.packer.static_loop import train_static

        if optimizer_in_backward:
            next_job = _in_backward_jobs(next_job)
            warnings.warn("optimizer_in_backward: the static-shape step keeps its preallocated gradient buffer and "
                          "takes each slot's AdamW step after the backward (the same updates, not the memory saving)",
                          stacklevel=2)
        if chunk_tokens is not None:
            pm.output_head()  # refuses models whose logits are not head(hidden), before any slot starts
        pm.set_activation_checkpointing(activation_checkpointing)
        return train_static(pm, capacity, next_job, pad_id=pad_id, on_step=on_step, should_stop=should_stop,
                            on_end=on_end, max_global_steps=max_global_steps, cuda_graphs=cuda_graphs,
                            readback_every=readback_every, sync_steps=sync_steps, rank_bucket=rank_bucket,
                            chunk_tokens=chunk_tokens)
    if chunk_tokens is not None:
        pm.output_head()  # refuses models whose logits are not head(hidden), before any slot starts
    pm.set_activation_checkpointing(activation_checkpointing)
    optimizer = PackedAdamW()
    pm.state.grad_sink = optimizer.backward_step if optimizer_in_backward else None
    try:
        result = _train(pm, optimizer, capacity, next_job, pad_id, on_step, should_stop, on_end, max_global_steps,
                        chunk_tokens)
        result.step = "dynamic"
        return result
    finally:
        pm.state.grad_sink = None


def _in_backward_jobs(next_job: Callable[[int], SlotJob | None]) -> Callable[[int], SlotJob | None]:
    """``next_job`` whose jobs are checked as the step in the backward would check them (``check_in_backward``):
    a study keeps one meaning of ``optimizer_in_backward`` on either step."""
    def checked(slot: int) -> SlotJob | None:
        job = next_job(slot)
        if job is not None:
            check_in_backward(job.spec)
        return job

    return checked


def _train(pm: PackedModel, optimizer: PackedAdamW, capacity: int, next_job: Callable[[int], SlotJob | None],
           pad_id: int, on_step: Callable[[list[StepReport]], None] | None,
           should_stop: Callable[[StepReport], bool] | None, on_end: Callable[[list[SlotEnd]], None] | None,
           max_global_steps: int | None, chunk_tokens: int | None) -> TrainResult:
    """``train``'s dynamic loop (its arguments, resolved)."""
    result = TrainResult()
    active: dict[int, _Active] = {}
    in_backward = pm.state.grad_sink is not None
    t0 = time.perf_counter()
    while True:
        # 1. Refill free slots (the sweep's backfill). None means "nothing for this slot now".
        for slot in range(capacity):
            job = next_job(slot) if slot not in active else None
            if job is not None:
                active[slot] = _start(pm, optimizer, slot, job)
                result.jobs_started += 1
        if not active or (max_global_steps is not None and result.steps >= max_global_steps):
            break

        # 2. One micro-batch per slot, drawn from the slot's own stream, packed into one batch.
        slots = sorted(active)
        rows: list[list[Row]] = [active[s].window.draw(active[s].job.stream) for s in slots]
        specs = [active[s].job.spec for s in slots]
        batch = collate(slots, rows, pad_id, dropout=[sp.dropout for sp in specs],
                        seeds=[dropout_seed(sp.seed, active[s].micro) for s, sp in zip(slots, specs, strict=True)],
                        device=pm.device)

        if result.steps == 0:  # the first step's kernel variants, compiled in parallel rather than in turn
            pm.precompile(batch.layout, *batch.input_ids.shape)

        # 3. One forward/backward for the whole pack; sum of per-slot means keeps slots independent
        # (an accumulating slot's mean is over its whole optimizer step's target tokens).
        # With the step in the backward every slot steps now (no accumulation): its scalars are fixed first.
        losses, counts = _pack_losses(pm, batch, chunk_tokens)
        weights = _accumulation_weights([active[s] for s in slots], counts)
        lrs = optimizer.begin_step(slots) if in_backward else None
        (losses.sum() if weights is None else (losses * weights).sum()).backward()
        stepped = None if lrs is None else (lrs, optimizer.end_step({s: _weight_views(pm, s) for s in slots}))

        # 4. Slots whose step is complete clip to their own norm and take their own AdamW step, in one pass
        # (stepping in the backward, they already have).
        reports = _step_slots(optimizer, active, slots, batch, losses, counts, result.steps, stepped)
        result.steps += 1
        result.tokens += sum(r.tokens for r in reports)
        result.input_tokens += sum(r.input_tokens for r in reports)
        if on_step is not None and reports:  # an accumulating pack may have a step in which no slot stepped
            on_step(reports)

        # 5. Lifecycle: finished or stopped slots hand their weights to the caller, then free up.
        ends = []
        for rep in reports:
            a = active[rep.slot]
            reason = ("finished" if a.steps >= a.job.spec.max_steps
                      else "stopped" if should_stop is not None and should_stop(rep) else None)
            if reason is not None:
                ends.append(SlotEnd(rep.slot, a.job, a.steps, reason))
        _end(pm, optimizer, active, ends, on_end, result)
    _end(pm, optimizer, active, [SlotEnd(s, a.job, a.steps, "interrupted") for s, a in sorted(active.items())],
         on_end, result)
    result.wall_s = time.perf_counter() - t0
    return result


def _accumulation_weights(order: list[_Active], counts: torch.Tensor) -> torch.Tensor | None:
    """(N,) factors turning each slot's micro-batch mean into (micro-batch loss sum) / (step's target tokens);
    None when no slot accumulates (every factor would be 1)."""
    if all(a.job.spec.gradient_accumulation_steps == 1 for a in order):
        return None
    total = torch.tensor([float(max(a.window.tokens, 1)) for a in order], device=counts.device)
    ones = torch.tensor([a.job.spec.gradient_accumulation_steps == 1 for a in order], device=counts.device)
    return torch.where(ones, torch.ones_like(total), counts / total)


def _weight_views(pm: PackedModel, slot: int) -> list[torch.Tensor]:
    """Every piece of the slot's weights a layer hands to the optimizer: each layer's A and B^T."""
    views = [pm.layers[p].slot_weights(slot) for p in pm.slot_paths[slot]]
    return [t for w in views for t in (w.a, w.bt)]


def _step_slots(optimizer: PackedAdamW, active: dict[int, _Active], slots: list[int], batch: PackBatch,
                losses: torch.Tensor, counts: torch.Tensor, global_step: int,
                stepped: tuple[list[float], torch.Tensor] | None = None) -> list[StepReport]:
    """Account one micro-batch per slot; step the slots whose accumulation is complete and report them
    (``stepped``: every slot has stepped in the backward, with these learning rates and gradient norms)."""
    input_tokens = batch.attention_mask.sum(dim=1).tolist()
    done = []
    for i, (slot, loss, count) in enumerate(zip(slots, losses.tolist(), counts.tolist(), strict=True)):
        a = active[slot]
        a.micro += 1
        r0, n = batch.layout.row_start[i], batch.layout.n_rows[i]
        a.tally.add(loss, int(count), int(sum(input_tokens[r0:r0 + n])), a.job.spec.gradient_accumulation_steps)
        if a.window.complete:
            done.append(slot)
    if not done:
        return []
    if stepped is not None:
        lrs, norms = stepped[0], stepped[1].tolist()
    else:
        lrs = [optimizer.lr(slot) for slot in done]
        norms = optimizer.step(done).tolist()
    reports = []
    for slot, lr, norm in zip(done, lrs, norms, strict=True):
        a = active[slot]
        a.steps += 1
        loss, n_in = a.tally.take(a.window.tokens, a.job.spec.gradient_accumulation_steps)
        reports.append(StepReport(global_step, slot, a.job.key, a.steps, loss, a.window.tokens, n_in, lr, norm))
    return reports


def _end(pm: PackedModel, optimizer: PackedAdamW, active: dict[int, _Active], ends: list[SlotEnd],
         on_end: Callable[[list[SlotEnd]], None] | None, result: TrainResult) -> None:
    if not ends:
        return
    if on_end is not None:
        on_end(ends)
    for e in ends:
        del active[e.slot]
        result.ended.append((e.job.key, e.steps, e.reason))
        optimizer.remove_slot(e.slot)
        pm.remove_slot(e.slot)
