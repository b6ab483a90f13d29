"""The parts of ``packer.step.train.train``'s loop: one fixed-shape step, eager on the CPU, a CUDA graph replay on CUDA.

``train`` reads top to bottom and calls these; what they make true is where a step's numbers live:

- **Shapes are fixed.** C slots x ``rows`` rows (the largest micro-batch seen; a slot with fewer rows, or a
  free slot, gets padding rows with no loss) x a length padded up to a multiple of ``seq_multiple``. One step
  shape, with the set of adapted layers and whether dropout is compiled in, is one graph key: refills,
  prunes and slot ends change no key (``packer.model.store`` says how the buffers make that exact).
- **Features are data too.** Gradient accumulation (per slot, any mix of k in one pack; ``packer.step.jobs.Window``):
  each slot's mean loss enters the backward times its loss weight (its micro-batch's share of its optimizer
  step's target tokens), and a slot whose step awaits more micro-batches gets the ``ACCUMULATE`` optimizer row
  (no-op step, gradient kept); it clips, steps and advances its schedule after its k-th. Sample packing: the
  positions restart at each example of a row, and the model builds the block-diagonal causal mask from them on
  the device (one more graph key: positions instead of a padding mask).
- **Per-step values are data.** The host writes tokens, segment tables and the optimizer table into pinned
  staging memory (a ring of ``_STAGING`` blocks, each reused only once the GPU has copied it: the host runs
  ahead of the GPU without racing it) and copies them with two non-blocking copies; then the graph replays.
- **No host sync in the step.** Per-slot losses, target counts and gradient norms go to a device ring buffer
  that the loop reads every ``readback_every`` steps, when a slot reaches its ``max_steps``, and when a slot
  reaches one of ``sync_steps`` (the sweep's rungs). ``on_step`` therefore receives each step's reports in
  order but up to ``readback_every - 1`` steps late, and ``should_stop`` is asked then: a slot it stops has
  trained up to that many steps past the report that stopped it (zero at a sync step, which is where the
  sweep prunes). Its ``SlotEnd.steps`` counts every step it took, and its reports up to its end are delivered.

Capture (``cuda_graphs``: ``auto``/``on`` on CUDA): on the first key the step runs twice eagerly on a side stream with
a no-op optimizer table (weights and moments stay as they were), then is captured (seconds in ``TrainResult``); a
later key (another step shape) is captured straight into the graphs' shared pool, with no eager run beside it: an
eager run's activations live outside the pool, so with the earlier graphs' pool held they doubled the peak (the
0.5B unpacked benchmark's 128 rows of up to 512 tokens ran out of an 80 GB card that way, its pool 39.8 GiB). If
capture fails, a one-line warning says why and the pack runs the same step eagerly.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from lora_sweep.kernels.ops import FREE_FLT, PackLayout, SegFlt, dropout_seed, free_segment
from lora_sweep.packer.data.batch import IGNORE_INDEX
from lora_sweep.packer.loss import chunked_slot_losses
from lora_sweep.packer.model.packed import PackedModel
from lora_sweep.packer.model.store import (
    SEG_FLT,
    SEG_INT,
    ShapeBuffers,
    SlotStore,
    fused_loss_head,
    head_losses,
    slot_losses,
)
from lora_sweep.packer.step.capture import capture, capture_failure
from lora_sweep.packer.step.jobs import SlotEnd, SlotJob, StepReport, Tally, TrainResult, Window, target_tokens
from lora_sweep.packer.step.optim import ACCUMULATE, NOOP, adamw_step, optimizer_row

__all__ = ["DEFAULT_READBACK", "SEQ_MULTIPLE", "Live", "Pending", "Graphs", "Staging", "fill",
           "step_fn", "record_step", "flush", "ends", "end_slots"]

DEFAULT_READBACK = 8
SEQ_MULTIPLE = 16
"""Sequence lengths are padded up to a multiple of this: few graph keys, little padding on short rows."""
_STAGING = 4


@dataclass
class Live:
    job: SlotJob
    schedule: Any
    window: Window
    steps: int = 0
    """Optimizer steps taken."""
    micro: int = 0
    """Micro-batches trained (seeds the dropout masks; equals ``steps`` without accumulation)."""
    stopped: bool = False
    tally: Tally = field(default_factory=Tally)
    """The reported loss of the optimizer step whose micro-batches are being read back."""

    @property
    def k(self) -> int:
        return self.job.spec.gradient_accumulation_steps


@dataclass
class Entry:
    """What the host knows of one live slot's micro-batch in one step; the ring holds the rest."""

    slot: int
    key: Any
    slot_step: int
    """Optimizer steps after this micro-batch."""
    lr: float
    input_tokens: int
    steps: bool
    """Whether the slot took its optimizer step after this micro-batch (its last)."""
    tokens: int
    """Target tokens of the slot's whole optimizer step."""


@dataclass
class Pending:
    step: int
    row: int
    entries: list[Entry]


@dataclass
class Graphs:
    """Captured graphs by key, or eager execution where capture is off or failed."""

    enabled: bool
    graphs: dict[tuple, torch.cuda.CUDAGraph] = field(default_factory=dict)
    pool: Any = None
    warmup_s: float = 0.0
    capture_s: float = 0.0
    grads: tuple[torch.Tensor, ...] = ()
    """The store's gradient buffers (DoRA's magnitudes' too) while a slot accumulates: the warm-up steps before a
    capture add their gradients and zero them, so an accumulating slot's gradient so far is saved and put back around
    them."""
    fallback: str | None = None
    """Why the step runs eagerly on CUDA: the failed capture's error and where it was raised (None: no failure)."""

    def run(self, key: tuple, step: Callable[[], None], shape: ShapeBuffers, scratch_row: int) -> None:
        if not self.enabled:
            step()
            return
        graph = self.graphs.get(key)
        if graph is None:
            graph = self._capture(step, shape, scratch_row)
            if graph is None:
                step()
                return
            self.graphs[key] = graph
        graph.replay()

    def _capture(self, step: Callable[[], None], shape: ShapeBuffers, scratch_row: int) -> torch.cuda.CUDAGraph | None:
        saved = shape.floats.clone(), shape.ints[-1:].clone()
        grads = [g.clone() for g in self.grads]
        shape.opt.copy_(torch.tensor(NOOP, device=shape.opt.device).expand_as(shape.opt))
        shape.ring_row.fill_(scratch_row)
        try:
            if self.pool is None:
                self.pool = torch.cuda.graph_pool_handle()
            graph, warmup_s, capture_s = capture(step, pool=self.pool, warmups=0 if self.graphs else 2)
            self.warmup_s += warmup_s
            self.capture_s += capture_s
        except Exception as err:  # any failure: the same step runs eagerly from now on (the caller says so)
            self.enabled, graph, self.fallback = False, None, capture_failure(err)
        shape.floats.copy_(saved[0])
        shape.ints[-1:].copy_(saved[1])
        for buf, kept in zip(self.grads, grads, strict=True):
            buf.copy_(kept)
        return graph


class Staging:
    """Pinned host blocks the step's values are written into, reused round-robin once their copy has run."""

    def __init__(self, n_int: int, n_flt: int, cuda: bool) -> None:
        self.cuda = cuda
        self.blocks = [(torch.zeros(n_int, dtype=torch.int64, pin_memory=cuda),
                        torch.zeros(n_flt, dtype=torch.float32, pin_memory=cuda)) for _ in range(_STAGING)]
        self.events: list[torch.cuda.Event | None] = [None] * _STAGING
        self.i = 0

    def take(self) -> tuple[torch.Tensor, torch.Tensor]:
        self.i = (self.i + 1) % _STAGING
        event = self.events[self.i]
        if event is not None:
            event.synchronize()  # waits only when the GPU is _STAGING steps behind the host
        return self.blocks[self.i]

    def send(self, shape: ShapeBuffers) -> None:
        ints, floats = self.blocks[self.i]
        shape.ints.copy_(ints, non_blocking=self.cuda)
        shape.floats.copy_(floats, non_blocking=self.cuda)
        if self.cuda:
            event = torch.cuda.Event()
            event.record()
            self.events[self.i] = event


def fill(ints: np.ndarray, floats: np.ndarray, store: SlotStore, shape: ShapeBuffers, active: dict[int, Live],
          rows: dict[int, list], pad_id: int, ring_row: int) -> tuple[dict[int, float], dict[int, int], PackLayout]:
    """Write one step's values into the staging arrays; returns per live slot its lr and input tokens, and the
    step's layout as Python values (for the eager torch path's dropout). A slot whose micro-batch is not its
    optimizer step's last (``Window.complete``) gets the ``ACCUMULATE`` row: its gradient stays."""
    c, m, seq = store.capacity, shape.rows, shape.seq_len
    b = c * m
    ids, labels, mask, pos = (ints[i * b * seq:(i + 1) * b * seq].reshape(b, seq) for i in range(4))
    ids.fill(pad_id)
    labels.fill(IGNORE_INDEX)
    mask.fill(0)
    mask[:, 0] = 1  # a padding row attends to one token: no fully masked row (whose attention would be NaN)
    pos[:] = np.arange(seq)
    off = 4 * b * seq
    seg_int = ints[off:off + c * SEG_INT].reshape(c, SEG_INT)
    rank = ints[off + c * SEG_INT:off + c * SEG_INT + c]
    ints[-1] = ring_row
    seg_flt = floats[:c * SEG_FLT].reshape(c, SEG_FLT)
    n_opt = c * len(NOOP)
    opt = floats[c * SEG_FLT:c * SEG_FLT + n_opt].reshape(c, -1)
    loss_w = floats[c * SEG_FLT + n_opt:]
    lrs, input_tokens, p_list, seeds, own = {}, {}, [0.0] * c, [0] * c, [seq] * c
    for g in range(c):
        live = active.get(g)
        seg_int[g] = free_segment(g, m, seq, store.rank_bucket)
        seg_flt[g] = FREE_FLT
        rank[g] = 0
        opt[g] = NOOP
        loss_w[g] = 1.0
        if live is None:
            continue
        spec = live.job.spec
        for i, r in enumerate(rows[g]):
            _put_row(r, g * m + i, ids, labels, mask, pos)
        lr = spec.lr * live.schedule(live.steps)
        seeds[g], p_list[g] = dropout_seed(spec.seed, live.micro), spec.dropout
        own[g] = max((len(r.input_ids) for r in rows[g]), default=0)
        # the kernels read the slot's rows (a frozen principal correction's too); the optimizer its rank's
        seg_int[g] = free_segment(g, m, seq, store.rank_bucket)._replace(rank=spec.rows, seed=seeds[g])
        rank[g] = spec.rank
        seg_flt[g] = SegFlt(scale=spec.scale, p=spec.dropout, inv_keep=1.0 / (1.0 - spec.dropout))
        opt[g] = optimizer_row(spec, lr, live.steps + 1) if live.window.complete else ACCUMULATE
        if live.k > 1:  # (1 otherwise: no count to take on the host)
            loss_w[g] = live.window.weight(sum(target_tokens(r) for r in rows[g]))
        lrs[g], input_tokens[g] = lr, sum(len(r.input_ids) for r in rows[g])
    layout = PackLayout(tuple(range(c)), tuple(g * m for g in range(c)), (m,) * c, tuple(own), tuple(p_list),
                        tuple(seeds))
    return lrs, input_tokens, layout


def _put_row(r: Any, i: int, ids: np.ndarray, labels: np.ndarray, mask: np.ndarray, pos: np.ndarray) -> None:
    """One example row (or sample-packed row: positions restarting per example) into row ``i`` of the arrays."""
    n = len(r.input_ids)
    ids[i, :n] = r.input_ids
    labels[i, :n] = r.labels
    mask[i, :n] = 1
    packed_pos = getattr(r, "position_ids", None)
    if packed_pos is not None:
        # the padding tail continues the last example's positions: it belongs to no new example
        pos[i, :n] = packed_pos
        pos[i, n:] = np.arange(pos.shape[1] - n) + (packed_pos[-1] + 1)


def step_fn(pm: PackedModel, store: SlotStore, shape: ShapeBuffers, ring: torch.Tensor, triton: bool,
             dropout: bool, packed: bool, chunk: int | None) -> Callable[[], None]:
    """The whole step on the shape's buffers: forward, per-slot losses, backward, clip + AdamW, ring write.

    On the Triton path the loss goes through the frozen head in one fused function (``head_losses``: no fp32
    logits, the head's input gradient computed in the forward); a model whose logits are not a plain head's output,
    and the torch path, compute full logits (``slot_losses``). The backward takes each slot's mean loss
    times its loss weight (gradient accumulation). ``packed``: some row is sample-packed; the model gets the
    positions and no padding mask, and builds the block-diagonal causal mask from the positions on the device
    (``PackedModel.forward``). ``chunk`` (``chunked_ce``): the fused loss holds the logits of that many token rows
    at a time (fixed ranges: capturable); off the Triton path the loss is ``packer.loss.chunked_slot_losses`` over
    the target tokens (a data-dependent gather: eager only, a capture of it fails over to the eager step)."""
    c = store.capacity
    pos = shape.pos if packed else None

    def step() -> None:
        head = fused_loss_head(pm.model) if triton else None  # here, not above: a replay never runs this function
        with store.stepping(shape, dropout), torch.enable_grad():
            if head is not None:
                hidden = pm.forward_hidden(shape.ids, shape.mask, None, pos)  # (B, L, H)
                losses, counts = head_losses(hidden, head, shape.labels, c, chunk=chunk)
                del hidden
            elif chunk is not None:
                hidden = pm.forward_hidden(shape.ids, shape.mask, None, pos)
                losses, counts = chunked_slot_losses(hidden, pm.output_head(), shape.labels, store.host_layout,
                                                     chunk_tokens=chunk)  # type: ignore[arg-type]
                del hidden
            else:
                logits = pm.forward(shape.ids, shape.mask, None, pos)
                losses, counts = slot_losses(logits, shape.labels, c)
                del logits
            (losses * shape.loss_w).sum().backward()
        norms = adamw_step(store, shape, triton)
        ring.index_copy_(0, shape.ring_row, torch.stack([losses.detach(), counts, norms], dim=1)[None])

    return step


def flush(ring: torch.Tensor, pending: list[Pending], active: dict[int, Live], result: TrainResult,
           on_step: Callable[[list[StepReport]], None] | None,
           should_stop: Callable[[StepReport], bool] | None) -> None:
    """Read the ring buffer once (the loop's only sync) and report, in order, every optimizer step the pending
    steps completed (an accumulating slot's micro-batches are tallied until its last)."""
    if not pending:
        return
    values = ring.cpu().tolist()
    for p in pending:
        reports = []
        for e in p.entries:
            live = active[e.slot]
            loss, count, norm = values[p.row][e.slot]
            live.tally.add(loss, int(count), e.input_tokens, live.k)
            if e.steps:
                loss, n_in = live.tally.take(e.tokens, live.k)
                reports.append(StepReport(p.step, e.slot, e.key, e.slot_step, loss, e.tokens, n_in, e.lr, norm))
        result.tokens += sum(r.tokens for r in reports)
        result.input_tokens += sum(r.input_tokens for r in reports)
        if on_step is not None and reports:  # an accumulating pack may have a step in which no slot stepped
            on_step(reports)
        for r in reports:
            live = active[r.slot]
            if should_stop is not None and not live.stopped and r.slot_step < live.job.spec.max_steps:
                live.stopped = should_stop(r)
    pending.clear()


def record_step(active: dict[int, Live], pending: list[Pending], step: int, ring_row: int, lrs: dict[int, float],
                input_tokens: dict[int, int], sync_steps: Collection[int], readback_every: int) -> bool:
    """Count one step's micro-batch for every live slot (a slot whose window is complete took its optimizer step)
    and queue what the host knows of it for ``flush``; True when the ring is due to be read: it is full, or a slot
    reached its last step or a ``sync_steps`` step."""
    entries, due = [], len(pending) + 1 >= readback_every
    for s in sorted(active):
        a = active[s]
        a.micro += 1
        stepped = a.window.complete
        a.steps += stepped
        due = due or (stepped and (a.steps >= a.job.spec.max_steps or a.steps in sync_steps))
        entries.append(Entry(s, a.job.key, a.steps, lrs[s], input_tokens[s], stepped, a.window.tokens))
    pending.append(Pending(step, ring_row, entries))
    return due


def ends(active: dict[int, Live], reason: str | None = None) -> list[SlotEnd]:
    """The live slots that end now: finished (``max_steps``) or stopped by the caller; with ``reason``, all of them."""
    out = []
    for s, a in sorted(active.items()):
        why = reason or ("finished" if a.steps >= a.job.spec.max_steps else "stopped" if a.stopped else None)
        if why is not None:
            out.append(SlotEnd(s, a.job, a.steps, why))
    return out


def end_slots(pm: PackedModel, active: dict[int, Live], ends: list[SlotEnd],
              on_end: Callable[[list[SlotEnd]], None] | None, result: TrainResult) -> None:
    """Hand the ending slots to ``on_end`` (their weights still exist), then free them."""
    if not ends:
        return
    if on_end is not None:
        on_end(ends)
    for e in ends:
        del active[e.slot]
        result.ended.append((e.job.key, e.steps, e.reason))
        pm.remove_slot(e.slot)
