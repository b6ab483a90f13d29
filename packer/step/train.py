"""The packed training loop: many adapters, one frozen base model, one fixed-shape step for all of them.

Read ``train()`` top to bottom. Each step every active slot draws its own micro-batch from its own stream; the
rows of all slots go through the model together in one step of fixed shape (``packer.step.loop`` builds it:
C slots x ``rows`` rows x a length padded to a multiple of ``SEQ_MULTIPLE``); each slot's loss is the mean over
its own target tokens and the pack's loss is the sum of those means, so each slot's gradient is exactly the
gradient it would get training alone (a global token mean would rescale each slot's gradient by its share of
tokens: a hidden learning-rate change). Each slot then clips to its own norm and takes its own AdamW step, every
slot in one pass (``packer.step.optim``). The same step runs eagerly on the CPU and is replayed as a CUDA graph
on CUDA: every per-step value (tokens, slot tables, learning rates, loss weights) is data in the step's buffers.

Gradient accumulation is per slot: a slot with ``gradient_accumulation_steps`` k draws the k micro-batches of its
next optimizer step at once and counts their target tokens N; each micro-batch's mean enters the backward times
its share of N, so the accumulated gradient is that of the mean over all N tokens, as if the k micro-batches were
one batch (transformers' ``num_items_in_batch``). Only when its k-th micro-batch is in does a slot clip, step and
advance its schedule; slots with other k in the same pack keep accumulating. A slot is reported (``StepReport``)
once per optimizer step, with the loss and tokens of the whole step. Sample packing, activation checkpointing and
``chunked_ce`` are switches of the same step.

Slots have a lifecycle: when one finishes (``max_steps``) or is stopped (``should_stop``), the caller is told
(``on_end``: it may save or score the adapter, whose weights still exist) and the slot is refilled with
``next_job`` while the pack keeps running.

``optimizer_in_backward`` (torchtune's ``optimizer_in_bwd``) is mapped onto this step: the same updates, after the
backward, from the step's fp32 gradient buffer (the memory the option would save; docs/guides/training.md).
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Collection, Sequence
from typing import Protocol

import torch

from lora_sweep.errors import ConfigError
from lora_sweep.kernels.ops import resolve_impl
from lora_sweep.packer.loss import DEFAULT_CHUNK_TOKENS
from lora_sweep.packer.model.packed import PackedModel
from lora_sweep.packer.model.store import ShapeBuffers, SlotStore
from lora_sweep.packer.plan import AdapterSpec
from lora_sweep.packer.step import loop
from lora_sweep.packer.step.capture import precompile
from lora_sweep.packer.step.isolation import check_sample_packing
from lora_sweep.packer.step.jobs import (
    STEP_NAMES,
    BatchSource,
    FixedBatch,
    SlotEnd,
    SlotJob,
    StepReport,
    TrainResult,
    Window,
    target_tokens,
)
from lora_sweep.packer.step.loop import DEFAULT_READBACK, SEQ_MULTIPLE, Live, Pending, Staging
from lora_sweep.packer.step.optim import lr_schedule
from lora_sweep.packer.step.shapes import padded_length

__all__ = ["BatchSource", "FixedBatch", "SlotJob", "SlotEnd", "StepReport", "TrainResult", "StepProfiler", "train",
           "chunk_tokens_of", "check_in_backward", "target_tokens",
           "STEP_NAMES"]


class StepProfiler(Protocol):
    """What ``train`` needs of a profiler (``torch.profiler.profile`` is one): a mark at the end of every step."""

    def step(self) -> None: ...


def chunk_tokens_of(chunked_ce: bool | int) -> int | None:
    """Tokens per loss chunk for a ``chunked_ce`` option (None: not chunked)."""
    if chunked_ce is True:
        return DEFAULT_CHUNK_TOKENS
    if chunked_ce is False:
        return None
    if chunked_ce < 1:
        raise ValueError(f"chunked_ce: tokens per chunk must be >= 1 (got {chunked_ce})")
    return int(chunked_ce)


def check_in_backward(spec: AdapterSpec) -> None:
    """Refuse an adapter that ``optimizer_in_backward`` cannot train (torchtune refuses the same).

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


def configuration(pm: PackedModel, active: dict[int, Live], chunk: int | None) -> str:
    """The step's configuration in words, for a capture failure's one line: the model class and attention, the
    fused base ops, and the switches the live slots and the pack turn on."""
    config = getattr(pm.model, "config", None)
    attn = getattr(config, "_attn_implementation", None) or "default"
    specs = [a.job.spec for a in active.values()]
    switches = [name for name, on in (
        ("dropout", any(s.dropout > 0 for s in specs)),
        ("sample packing", any(s.sample_packing for s in specs)),
        ("gradient accumulation", any(s.gradient_accumulation_steps > 1 for s in specs)),
        ("activation checkpointing", pm.checkpointing),
        ("chunked loss", chunk is not None),
    ) if on]
    base = f"fused base ops on {len(pm.fused)} modules" if pm.fused else "base ops eager"
    return f"{type(pm.model).__name__} ({attn} attention, {base}{''.join(', ' + w for w in switches)})"


_TORCH_DROPOUT = "LoRA dropout on the torch path draws its masks from Python seeds (the Triton kernels' on the device)"


def _fell_back(result: TrainResult, pm: PackedModel, active: dict[int, Live], chunk: int | None, why: str) -> None:
    """Record the first reason a CUDA run's step runs eagerly, with its configuration, and warn once."""
    if result.fallback is None:
        result.fallback = f"{configuration(pm, active, chunk)}: {why}"
        warnings.warn(f"CUDA graph capture failed, training eagerly: {result.fallback}", stacklevel=3)


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
    cuda_graphs: str = "auto",
    readback_every: int = DEFAULT_READBACK,
    sync_steps: Collection[int] = (),
    max_rows: int | None = None,
    optimizer_in_backward: bool = False,
    seq_multiple: int = SEQ_MULTIPLE,
    lengths: Sequence[int] | None = None,
    profiler: StepProfiler | None = None,
    graphs: loop.Graphs | None = None,
) -> TrainResult:
    """Train adapters in ``capacity`` slots until no job is left.

    Args:
        pm: the packed model (base frozen; slots are added and removed here).
        capacity: number of slots, C.
        next_job: called with each free slot id before every step; returns a job or None. The run ends when no
            slot is active and every call returns None.
        pad_id: padding token id.
        on_step: receives the ``StepReport`` of every slot that took an optimizer step in a global step; the
            losses are read back from the device every ``readback_every`` steps, so reports arrive in order but
            up to ``readback_every - 1`` steps late (never late at a ``sync_steps`` step or a slot's last step).
        should_stop: asked per slot when its report arrives; True ends the slot early (having trained up to
            ``readback_every - 1`` steps past that report; none past it at a ``sync_steps`` step).
        on_end: receives the slots that end at this step, together (so they can be saved and scored in one
            packed pass), before their weights are released.
        max_global_steps: stop after this many global steps (the slots still running end ``interrupted``).
        chunked_ce: the loss's logits exist for a chunk of tokens at a time (True: ``DEFAULT_CHUNK_TOKENS``).
        activation_checkpointing: recompute decoder layers in the backward; set on ``pm`` and left as set.
        cuda_graphs: ``auto`` / ``on``: replay the step as a CUDA graph on CUDA (where capture fails: one
            warning naming the configuration and the cause, ``TrainResult.fallback``, and the same step eagerly);
            ``off``: run it eagerly. The CPU always runs it eagerly.
        readback_every: steps between reads of the loss ring buffer (>= 1).
        sync_steps: slot steps at which the loop reads back at once (the sweep's rungs).
        max_rows: the most rows per slot and layer a job will need (the largest ``AdapterSpec.rows`` the caller
            will send): the slots' rank bucket holds them from the first step, so no later job grows it (a grown
            bucket moves the live slots and re-captures the step's graphs). None: the bucket holds the first job's
            rows, and a larger job later moves the live slots to a larger bucket.
        optimizer_in_backward: torchtune's option, mapped onto this step: the same updates, the gradient buffer
            kept (one warning says so); jobs that clip or accumulate are refused (``check_in_backward``).
        seq_multiple: rows are padded to a multiple of this many positions.
        lengths: the padded lengths a step may take (ascending; ``packer.step.shapes.length_buckets`` chooses at
            most a few from the data, which bounds the step shapes and so the CUDA graphs): a step pads to the
            smallest that holds its longest row. None, or a row longer than the last: a multiple of ``seq_multiple``.
        profiler: told ``step()`` once per global step, at the end of it (after any read-back and slot ends): a
            ``torch.profiler.profile`` the caller has entered, whose ``schedule`` then counts the pack's steps
            (torchtune's recipes call theirs the same way); None: nothing.
        graphs: the runner that captures and replays the step's CUDA graphs, used as given (its ``enabled``
            included; a failed capture turns it off); None: a new ``loop.Graphs``, on where the device is CUDA and
            ``cuda_graphs`` is not ``off``. A benchmark passes a subclass that also times replays of a captured graph
            (``benchmarks.gpu_graph``).

    Returns:
        Totals of the run; ``step`` says how it ran (``STEP_NAMES``).

    Raises:
        ConfigError: ``chunked_ce`` for a model that post-processes its logits, ``activation_checkpointing`` for a
            model without support for it, or with ``optimizer_in_backward`` a job that clips or accumulates.
    """
    if cuda_graphs not in ("auto", "on", "off"):
        raise ValueError(f"cuda_graphs must be auto, on or off (got {cuda_graphs!r})")
    if readback_every < 1:
        raise ValueError(f"readback_every must be >= 1 (got {readback_every})")
    chunk = chunk_tokens_of(chunked_ce)
    if chunk is not None:
        pm.output_head()  # refuses models whose logits are not head(hidden), before any slot starts
    if optimizer_in_backward:
        warnings.warn("optimizer_in_backward: the training step keeps its preallocated fp32 gradient buffer and takes "
                      "each slot's AdamW step after the backward (the same updates, not the memory saving)",
                      stacklevel=2)
    pm.set_activation_checkpointing(activation_checkpointing)
    device = pm.device
    triton = resolve_impl(pm.state.impl, device) == "triton"
    if graphs is None:
        graphs = loop.Graphs(enabled=device.type == "cuda" and cuda_graphs != "off")
    ring = torch.zeros((readback_every + 1, capacity, 3), device=device)  # per step and slot: loss, count, norm
    result, active, pending = TrainResult(), dict[int, Live](), list[Pending]()
    store: SlotStore | None = None
    shapes: dict[tuple[int, int], tuple[ShapeBuffers, Staging]] = {}
    rows_per_slot, prepared = 1, set()
    t0 = time.perf_counter()
    try:
        while True:
            # 1. Refill free slots (the sweep's backfill); a rank above the bucket moves the pack to a larger one.
            for slot in range(capacity):
                job = next_job(slot) if slot not in active else None
                if job is None:
                    continue
                if job.spec.sample_packing:
                    check_sample_packing(pm)
                if optimizer_in_backward:
                    check_in_backward(job.spec)
                if store is None or job.spec.rows > store.rank_bucket:
                    store = pm.ensure_store(capacity, job.spec.rows, max_rows)
                    shapes, graphs.graphs, prepared = {}, {}, set()
                pm.add_slot(slot, job.spec)
                active[slot] = Live(job, lr_schedule(job.spec), Window(job.spec.gradient_accumulation_steps))
                result.jobs_started += 1
            if not active or (max_global_steps is not None and result.steps >= max_global_steps):
                break
            assert store is not None
            store.active = frozenset(p for s in active for p in pm.slot_paths[s])

            # 2. Each live slot's micro-batch (k of them for an accumulating slot's step, one at a time), staged
            # into the buffers of the step's shape: rows per slot x the step length (``lengths``) holding the longest.
            rows = {s: active[s].window.draw(active[s].job.stream) for s in sorted(active)}
            rows_per_slot = max(rows_per_slot, *(len(r) for r in rows.values()))
            longest = max(len(r.input_ids) for rs in rows.values() for r in rs)
            dims = (rows_per_slot, padded_length(longest, seq_multiple, lengths))
            result.shapes.add(dims)
            if dims not in shapes:
                buffers = store.shape_buffers(*dims)
                shapes[dims] = buffers, Staging(buffers.ints.numel(), buffers.floats.numel(), device.type == "cuda")
            shape, stage = shapes[dims]
            ring_row = result.steps % readback_every
            host_ints, host_floats = stage.take()
            lrs, input_tokens, store.host_layout = loop.fill(host_ints.numpy(), host_floats.numpy(), store,
                                                                    shape, active, rows, pad_id, ring_row)
            stage.send(shape)

            # 3. The step (forward, per-slot losses, backward, clip + AdamW): replayed, captured on first use of
            # its key, or eager.
            dropout = any(a.job.spec.dropout > 0 for a in active.values())
            packed = any(a.job.spec.sample_packing for a in active.values())
            # the last two: the variants whose buffers the store holds (each adds work to the step: DoRA's rescale),
            # and the number of DoRA slots with dropout (their extra GEMM's shape)
            drop = store.mag.stage_dropout(store.host_layout.dropout) if dropout and store.mag is not None else 0
            key = (*dims, store.active, dropout, packed, store.variant_key, drop)
            step = loop.step_fn(pm, store, shape, ring, triton, dropout, packed, chunk)
            graphs.grads = ((store.grad,) + (() if store.mag is None else (store.mag.grad,))
                            if any(a.k > 1 for a in active.values()) else ())
            if triton and key not in prepared:  # the step's Triton kernel variants, compiled in parallel
                prepared.add(key)
                t_compile = time.perf_counter()
                precompile(step)  # gradients, weights and moments stay as they were (``capture.precompile``)
                result.compile_s += time.perf_counter() - t_compile
            # the torch path's masks come from Python seeds, and its DoRA branch is chosen on the host: eager only
            eager_only = not triton and (dropout or (store.mag is not None and bool(store.mag.slots)))
            if eager_only and graphs.enabled:
                _fell_back(result, pm, active, chunk, _TORCH_DROPOUT)
            step() if eager_only else graphs.run(key, step, shape, readback_every)
            if graphs.fallback is not None:
                _fell_back(result, pm, active, chunk, graphs.fallback)
            due = loop.record_step(active, pending, result.steps, ring_row, lrs, input_tokens, sync_steps,
                                          readback_every)
            result.steps += 1

            # 4. Read the losses back when due; report; end the finished and stopped slots (they free up for 1.).
            if due:
                loop.flush(ring, pending, active, result, on_step, should_stop)
                loop.end_slots(pm, active, loop.ends(active), on_end, result)
            if profiler is not None:
                profiler.step()
        loop.flush(ring, pending, active, result, on_step, should_stop)
        loop.end_slots(pm, active, loop.ends(active, "interrupted"), on_end, result)
    finally:
        pm.drop_store()
    result.wall_s = time.perf_counter() - t0
    result.warmup_s, result.capture_s, result.graphs = graphs.warmup_s, graphs.capture_s, len(graphs.graphs)
    result.step = "cuda-graph" if graphs.enabled and graphs.graphs else "eager"
    return result
