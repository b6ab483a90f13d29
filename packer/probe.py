"""Measure a packed model's memory and time per token, to calibrate ``packer.plan.MemoryModel``.

The probe runs real packed steps (forward, backward, AdamW) on random tokens at two sizes and fits
the line through them; it trains nothing that is kept (its slot is removed afterwards). Memory is
what tensors hold, as ``torch.cuda.max_memory_allocated`` counts it: on CUDA that function; on CPU,
where PyTorch keeps no such statistic, a dispatch mode that adds up every tensor storage created
while the step runs and subtracts it when the storage is freed (deterministic, unlike the resident
set, which the C allocator's caching blurs by tens of percent).
"""

from __future__ import annotations

import dataclasses
import statistics
import time
import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from lora_sweep.errors import ConfigError
from lora_sweep.kernels.ops import PackLayout
from lora_sweep.packer.data.packing import PackedRow
from lora_sweep.packer.data.rows import Example
from lora_sweep.packer.loss import chunked_slot_losses
from lora_sweep.packer.model.inject import linear_shape, projection_names
from lora_sweep.packer.model.packed import PackedModel
from lora_sweep.packer.model.store import rank_bucket_for
from lora_sweep.packer.plan import (
    ADAPTER_BYTES_PER_PARAM,
    AdapterSpec,
    BaseShape,
    MemoryModel,
    adapter_param_count,
)
from lora_sweep.packer.step.train import FixedBatch, SlotEnd, SlotJob, chunk_tokens_of, train

if TYPE_CHECKING:
    from lora_sweep.packer.model.shard import BaseShare

__all__ = ["peak_memory", "calibrate", "available_memory", "model_bytes", "plain_param_bytes", "PROBE_STEPS",
           "base_shape", "forward_seconds", "PackTiming", "time_pack"]


def _proc_status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


class _TensorBytes(TorchDispatchMode):
    """Live bytes of CPU tensor storages created while the mode is active, and their peak."""

    def __init__(self, existing: set[int]) -> None:
        super().__init__()
        self.existing = existing  # ids of storages alive before (model weights): views of them are not new memory
        self.live: dict[int, int] = {}
        self.current = 0
        self.peak = 0

    def _free(self, key: int) -> None:
        self.current -= self.live.pop(key, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                storage = t.untyped_storage()
                key = id(storage)
                if key not in self.live and storage.nbytes() > 0 and key not in self.existing:
                    self.live[key] = storage.nbytes()
                    self.current += storage.nbytes()
                    weakref.finalize(storage, self._free, key)  # storage objects live as long as their data
        self.peak = max(self.peak, self.current)
        return out


def _model_storages(model: torch.nn.Module) -> dict[int, int]:
    return {id(t.untyped_storage()): t.untyped_storage().nbytes()
            for p in list(model.parameters()) + list(model.buffers()) for t in _plain_tensors(p)}


def _plain_tensors(t: torch.Tensor) -> list[torch.Tensor]:
    """The tensors holding ``t``'s memory: a tensor subclass (an NF4 weight, ``packer.model.quant``) is a wrapper whose
    own
    storage is a placeholder of the dequantised size; its data are the inner tensors ``__tensor_flatten__`` names."""
    flatten = getattr(type(t), "__tensor_flatten__", None)
    if flatten is None:
        return [t]
    names, _ = t.__tensor_flatten__()
    return [inner for name in names for inner in _plain_tensors(getattr(t, name))]


def plain_param_bytes(model: torch.nn.Module) -> int:
    """Bytes of ``model``'s parameters (distinct storages; an NF4 weight's inner tensors), without its buffers."""
    storages = {id(t.untyped_storage()): t.untyped_storage().nbytes()
                for p in model.parameters() for t in _plain_tensors(p)}
    return sum(storages.values())


def model_bytes(pm: PackedModel) -> int:
    """Bytes of the model's parameters and buffers (distinct storages)."""
    return sum(_model_storages(pm.model).values())


def peak_memory(fn: Callable[[], object], pm: PackedModel) -> int:
    """Peak bytes held by tensors on the model's device while ``fn`` runs, the model's own included."""
    device = pm.device
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        fn()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device)
    existing = _model_storages(pm.model)
    with _TensorBytes(set(existing)) as mode:
        fn()
    return sum(existing.values()) + mode.peak


def available_memory(device: torch.device) -> int:
    """Bytes a pack may use on ``device``: free GPU memory, or the machine's available RAM."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free + torch.cuda.memory_allocated(device)
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024 + _proc_status("VmRSS")
    raise RuntimeError("MemAvailable not in /proc/meminfo")


def base_shape(model: torch.nn.Module, worlds: Iterable[int] = ()) -> BaseShape:
    """What a plan needs of ``model`` (wrapped by a pack or not): its adaptable projections, its parameter bytes, and
    for each world size in ``worlds`` what one rank of an FSDP shard holds (``packer.model.shard.base_share``; none
    for a model it cannot shard)."""
    projections = []
    for path, leaf in projection_names(model).items():
        shape = linear_shape(model.get_submodule(path))
        if shape is not None:
            projections.append((leaf, int(shape[0]), int(shape[1])))
    shares: dict[int, BaseShare] = {}
    try:
        if worlds := tuple(worlds):
            from lora_sweep.packer.model.shard import base_share  # torch.distributed: only for a sharded plan

            shares = {w: base_share(model, w) for w in worlds}
    except ConfigError:
        pass  # no decoder layers or body to shard: a sharded plan of this model says so
    return BaseShape(tuple(projections), plain_param_bytes(model), {w: s.peak for w, s in shares.items()},
                     {w: s.load_peak for w, s in shares.items()})


def forward_seconds(pm: PackedModel, tokens: int = 8, repeats: int = 5) -> float:
    """The fastest of ``repeats`` base forwards (no adapter, no gradient) over one row of ``tokens`` tokens, after one
    to warm up: an evaluation forward's fixed time (launches, Python), which the training step's fixed time overstates
    several-fold (it holds the backward and the optimizer too)."""
    ids = torch.full((1, tokens), 3, dtype=torch.long, device=pm.device)
    mask = torch.ones_like(ids)
    times = []
    with torch.no_grad():
        for _ in range(repeats + 1):
            t0 = time.perf_counter()
            pm.forward(ids, mask, None)
            if pm.device.type == "cuda":
                torch.cuda.synchronize(pm.device)
            times.append(time.perf_counter() - t0)
    return min(times[1:])


@dataclass(frozen=True)
class PackTiming:
    """What ``time_pack`` measured of one pack shape."""

    step_s: float
    """Seconds of one step: the median of the timed steps on the CPU, their mean on CUDA (pipelined, as a run)."""
    steps: int
    """Steps timed (after the warm-up and the turnover)."""
    wall_s: float
    """Seconds the whole measurement took: the slots' set-up, the warm-up (on CUDA the graph's capture), the steps."""
    step: str
    """How the step ran (``STEP_NAMES``): the run's own path on this device and options."""
    setup_s: float = 0.0
    """Seconds the pack's start adds to its first step: from the call to the first step's end, less one step (the
    slots' store and set-up, the first step's warm-up; on CUDA the kernels' compile and the graph's capture)."""
    turnover_s: float | None = None
    """Seconds one slot's end and a new slot's start add, per slot (``turnover``: every slot ends at once, the caller's
    ``on_end`` called on them, and new slots of the same adapters start at the next step); None: not measured."""


class _Marks:
    """A ``train`` profiler keeping the time at the end of every global step, and the timed window's end.

    The window opens at the end of step ``start``. On the CPU it closes (``enough``, ``train``'s ``should_stop``,
    read back every step) once it holds ``steps`` steps and as many as ``min_s`` seconds hold of its fastest step,
    whichever is later, or ``most`` steps: at the read-back of the step that makes it enough, before its slots end.
    On CUDA it holds ``steps`` steps and only the window's ends are synchronised (and the warm-up's end, where the
    turnover starts), so the steps between run pipelined, as in a run."""

    def __init__(self, device: torch.device, warmup: int, start: int, steps: int, min_s: float = 0.0,
                 most: int | None = None) -> None:
        self.device, self.start, self.steps, self.min_s, self.most = device, start, steps, min_s, most or steps
        self.syncs = {warmup, start, start + steps}
        self.stamps: list[float] = []
        self.cut: tuple[int, float] | None = None
        """(stamps before it, the time) where the CPU's window closed."""

    def step(self) -> None:
        if self.device.type == "cuda" and len(self.stamps) + 1 in self.syncs:
            torch.cuda.synchronize(self.device)
        self.stamps.append(time.perf_counter())

    def enough(self, report: object = None) -> bool:
        """True once the window holds enough steps (the class docstring), then for every slot after."""
        if self.cut is not None:
            return True
        if len(self.stamps) < self.start:  # the warm-up or the turnover: the window is not open yet
            return False
        now = time.perf_counter()
        ends = [*self.stamps[self.start - 1:], now]  # the step being read back has done its work: it counts
        timed = [b - a for a, b in zip(ends, ends[1:], strict=False)]
        # the seconds as its fastest step counts them: a step descheduled by another process, however long, does
        # not close the window early (so a moment's load is outvoted in the median)
        if len(timed) >= self.most or (len(timed) >= self.steps and len(timed) * min(timed) >= self.min_s):
            self.cut = (len(self.stamps), now)
        return self.cut is not None

    def durations(self) -> list[float]:
        """Seconds of each timed step, from one step's end to the next."""
        ends = self.stamps[self.start - 1:self.start + self.steps] if self.cut is None else \
            [*self.stamps[self.start - 1:self.cut[0]], self.cut[1]]
        return [b - a for a, b in zip(ends, ends[1:], strict=False)]


def time_pack(pm: PackedModel, specs: Sequence[AdapterSpec], rows: int, length: int, *, steps: int = 3,
              warmup: int = 1, min_s: float = 0.0, max_steps: int | None = None, pad_id: int = 0,
              vocab: int | None = None, max_rows: int | None = None, turnover: bool = False,
              on_end: Callable[[list[SlotEnd]], None] | None = None, **options: Any) -> PackTiming:
    """Time real steps of a pack of ``len(specs)`` slots (slot i trains ``specs[i]``), each slot ``rows`` rows of
    ``length`` random tokens (a sample-packed slot's rows hold one example each): the pack a plan has sized, on the
    step a run of it takes (``packer.step.train.train`` with ``options``: ``cuda_graphs``, ``chunked_ce``,
    ``activation_checkpointing``, ``optimizer_in_backward``; ``max_rows``: the rank bucket held from the first step).
    ``warmup`` steps first, untimed; what the pack's start (slots, their store and optimizer state; on CUDA the
    kernels' compile and the graph's capture) adds to the first of them is ``setup_s``. A step is timed from one
    step's end to the next. On the CPU the timed steps go on until there are ``steps`` of them and as many as
    ``min_s`` seconds hold of the fastest of them, whichever is later, at most ``max_steps`` (default ``steps``),
    and the step is their median: a short step is timed by many, so the steps another process slowed, however
    long, move it little. On
    CUDA exactly ``steps``, pipelined as a run's, and their mean. The slots are removed afterwards; nothing is kept.

    ``turnover``: after the warm-up every slot ends (at its first optimizer step after it; ``on_end`` is handed them
    as a run's callback is, their weights still in place: a caller saves their adapters there) and a new slot of the
    same adapter starts at the next step, as a run's backfill does; those steps' time beyond as many timed steps,
    per slot, is ``turnover_s``. The timed steps are the new slots' once every one has started.

    Raises:
        ValueError: no slot, or ``steps`` / ``warmup`` < 1.
    """
    if not specs or steps < 1 or warmup < 1:
        raise ValueError(f"time_pack: needs a slot, a warm-up step and a timed step (got {len(specs)} slots, "
                         f"{warmup} warm-up, {steps} timed)")
    cuda = pm.device.type == "cuda"
    most = steps if cuda or max_steps is None else max(steps, max_steps)
    # on the CPU the window closes at a slot's read-back, which an accumulating slot has every k steps
    window = steps if cuda else most + max(s.gradient_accumulation_steps for s in specs)
    jobs, refills, start = _pack_jobs(pm, specs, rows, length, warmup, window, turnover, vocab)
    marks = _Marks(pm.device, warmup, start, steps, min_s, most)

    def next_job(slot: int) -> SlotJob | None:  # the slots in order, then each its own successor (its graph's key)
        return jobs.pop(0) if jobs else refills.pop(slot, None)

    def ended(ends: list[SlotEnd]) -> None:  # the turnover's ends; not the timed slots' at the window's end
        done = [e for e in ends if e.reason == "finished"]
        if done and on_end is not None:
            on_end(done)

    if not cuda:  # the CPU's read-back costs nothing: every step's, so the window closes at the step it is enough
        options = {"readback_every": 1, **options}
    t0 = time.perf_counter()
    result = train(pm, len(specs), next_job, pad_id=pad_id, max_global_steps=start + window,
                   max_rows=max_rows, profiler=marks, should_stop=None if cuda else marks.enough,
                   on_end=ended if turnover else None, **options)
    wall = time.perf_counter() - t0
    durations = marks.durations()
    step_s = statistics.fmean(durations) if cuda else statistics.median(durations)
    stamps = marks.stamps
    setup_s = max(0.0, stamps[0] - t0 - step_s)
    swap = None if not turnover else \
        max(0.0, stamps[start - 1] - stamps[warmup - 1] - (start - warmup) * step_s) / len(specs)
    return PackTiming(step_s, len(durations), wall, result.step, setup_s, swap)


def _pack_jobs(pm: PackedModel, specs: Sequence[AdapterSpec], rows: int, length: int, warmup: int, steps: int,
               turnover: bool, vocab: int | None) -> tuple[list[SlotJob], dict[int, SlotJob], int]:
    """``time_pack``'s jobs: the first slot's of each spec, the successor each slot starts after the turnover (none
    without one), and the step after which every slot timed has started (the timed window's start). A slot timed
    has more optimizer steps than the window's ``steps`` and whatever precedes it: it never ends inside it. With a
    turnover each first slot ends at the first step after the warm-up that closes its accumulation (its optimizer
    steps count k pack steps each)."""
    vocab = vocab or pm.model.get_input_embeddings().num_embeddings
    gen = torch.Generator().manual_seed(0)
    jobs, refills, ends = [], dict[int, SlotJob](), [warmup]
    # a successor starts by step warmup + 2k (the longest accumulation k): its steps to the window's end are fewer
    span = 2 * (warmup + max(s.gradient_accumulation_steps for s in specs)) + steps + 2
    for slot, spec in enumerate(specs):
        ids = [tuple(r) for r in torch.randint(3, vocab, (rows, length), generator=gen).tolist()]
        batch = [PackedRow(r, r, tuple(range(length)), 1) if spec.sample_packing else Example(r, r) for r in ids]
        accum = spec.gradient_accumulation_steps
        first = -(-(warmup + 1) // accum)
        ends.append(first * accum)
        timed = dataclasses.replace(spec, max_steps=-(-span // accum))
        if turnover:
            jobs.append(SlotJob(dataclasses.replace(spec, max_steps=first), FixedBatch(batch)))
            refills[slot] = SlotJob(timed, FixedBatch(batch))
        else:
            jobs.append(SlotJob(timed, FixedBatch(batch)))
    return jobs, refills, (max(ends) + 1 if turnover else warmup)


PROBE_STEPS = 2
"""Steps of each probe run: the second step's backward is where AdamW's state exists beside the activations."""
PROBE_SLOTS = 1
"""Slots of each probe pack. The training step's store holds every slot's weights, gradients and moments at the pack's
rank bucket and gives every slot the same rows (a free slot's are padding), so one slot measures the per-token and
per-parameter costs a pack of any size repeats; a second slot would double every probe's tokens for nothing."""


def _step(pm: PackedModel, spec: AdapterSpec, rows: list[Example], pad_id: int, steps: int,
          options: dict[str, Any]) -> float:
    """Seconds of one step of the probe pack as a run takes it: from the first step's report to the last's (each
    read back at once), without ``train``'s set-up of the slots, their store and their optimizer state, which a run
    pays once per pack and which, spread over a probe's two steps, made a CPU plan's step 2.5x the run's. The whole
    call over ``steps`` where a single step leaves no interval."""
    jobs = [SlotJob(spec, FixedBatch(rows))] + [SlotJob(spec, FixedBatch([])) for _ in range(PROBE_SLOTS - 1)]
    stamps: list[float] = []
    t0 = time.perf_counter()
    train(pm, PROBE_SLOTS, lambda slot: jobs.pop(0) if jobs else None, pad_id=pad_id, readback_every=1,
          on_step=lambda reports: stamps.append(time.perf_counter()), **options)
    if pm.device.type == "cuda":
        torch.cuda.synchronize(pm.device)
    if len(stamps) >= 2:
        return (stamps[-1] - stamps[0]) / (len(stamps) - 1)
    return (time.perf_counter() - t0) / steps


def calibrate(pm: PackedModel, seq_len: int, *, rows: tuple[int, int] = (1, 2), vocab: int | None = None,
              pad_id: int = 0, steps: int = PROBE_STEPS, chunked_ce: bool | int = False,
              activation_checkpointing: bool = False, optimizer_in_backward: bool = False,
              dora: bool = False, dropout: float = 0.0) -> MemoryModel:
    """Fit ``MemoryModel`` from four probe packs of ``PROBE_SLOTS`` slots (one of them without rows):
    ``rows[0]`` and ``rows[1]`` sequences of ``seq_len`` tokens, with rank-8 and with rank-40 adapters
    (both ranks shrink to fit the narrowest layer). The four corners separate the per-token slope, the
    per-token-and-rank slope and the bytes per adapter parameter (the optimizer's fp32 state, and the
    per-layer gathered weights and gradients the packed layers keep beside it: measured, as they depend
    on the dtype and path). Each adapter covers every linear projection. ``chunked_ce``,
    ``activation_checkpointing`` and ``optimizer_in_backward`` are the pack's own training options (the first two
    change the per-token slope several-fold, the last the bytes per parameter; its probes do not clip). ``dora``:
    the probes' adapters are DoRA adapters, so the slopes and the time are a DoRA slot's (its magnitudes, the
    norm per step and, on the Triton kernels, each projection's output kept for the rescale's backward): the plan of
    a space that can train DoRA sizes every slot as the dearer one. ``dropout``: the probes' LoRA dropout (a DoRA slot
    with dropout also keeps ``W (x - drop(x))`` per projection for the backward).

    Each probe runs ``steps`` steps through ``packer.step.train.train`` once (on CUDA after a warm-up run): its peak
    memory is counted and the same run is timed, so the time line comes from the two low-rank probes without a
    run of its own. The first probe (one of the high-rank ones, which the time does not use) warms the process.
    """
    options: dict[str, Any] = {"chunked_ce": chunked_ce, "activation_checkpointing": activation_checkpointing,
                               "optimizer_in_backward": optimizer_in_backward}
    vocab = vocab or pm.model.get_input_embeddings().num_embeddings
    gen = torch.Generator().manual_seed(0)
    base = torch.cuda.memory_allocated(pm.device) if pm.device.type == "cuda" else model_bytes(pm)
    from lora_sweep.packer.model.inject import linear_shape, projection_names

    narrowest = min(min(linear_shape(pm.model.get_submodule(p)) or (1 << 30,)) for p in projection_names(pm.model))
    r_hi = min(40, narrowest)
    r_lo = min(8, max(1, r_hi // 4))
    probes = {}
    for n, rank in ((rows[0], r_hi), (rows[0], r_lo), (rows[1], r_lo), (rows[1], r_hi)):
        ids = torch.randint(3, vocab, (n, seq_len), generator=gen).tolist()
        examples = [Example(tuple(r), tuple(r)) for r in ids]
        spec = AdapterSpec(rank=rank, targets=("all-linear",), max_steps=steps, lr=1e-4,
                           max_grad_norm=None if optimizer_in_backward else 1.0, dora=dora, dropout=dropout)
        if pm.device.type == "cuda":  # allocator pools and kernel selection depend on the shape
            _step(pm, spec, examples, pad_id, steps, options)
        timed: list[float] = []
        peak = peak_memory(lambda: timed.append(_step(pm, spec, examples, pad_id, steps, options)), pm)  # noqa: B023
        # the step's store holds every slot at the pack's rank bucket (``store.rank_bucket_for``)
        params = PROBE_SLOTS * adapter_param_count([(layer.in_features, layer.out_features)
                                                    for layer in pm.layers.values()], rank_bucket_for(rank))
        # per token, one column per row of its slot's rank bucket (the Triton kernels' h, the torch path's batched h)
        width = rank_bucket_for(rank)
        # the training step gives every slot the same rows (the idle one padding): a probe computes PROBE_SLOTS x n
        probes[(PROBE_SLOTS * n * seq_len, rank)] = (peak, params, width, timed[0])
    return _fit(pm, probes, rows, seq_len, (r_lo, r_hi), vocab, base, chunked_ce, optimizer_in_backward)


def _fit(pm: PackedModel, probes: dict[tuple[int, int], Probe], rows: tuple[int, int], seq_len: int,
         ranks: tuple[int, int], vocab: int, base: int, chunked_ce: bool | int,
         optimizer_in_backward: bool) -> MemoryModel:
    """``MemoryModel`` from the four probes of ``calibrate``, keyed by (tokens, rank)."""
    r_lo, r_hi = ranks
    chunk = chunk_tokens_of(chunked_ce)
    ce = _ce_chunk_bytes(pm, chunk, vocab) if chunk else 0
    if chunk:  # the chunked loss saturates at one chunk: take it out before fitting the linear slopes
        probes = {(t, r): (m - ce * min(t, chunk) / chunk, *rest) for (t, r), (m, *rest) in probes.items()}
    # the training step gives every slot the same rows (the idle one padding): a probe computes PROBE_SLOTS x n rows
    t1, t2 = PROBE_SLOTS * rows[0] * seq_len, PROBE_SLOTS * rows[1] * seq_len
    fit = _fit_memory(probes[(t1, r_lo)], probes[(t2, r_lo)], probes[(t2, r_hi)], probes[(t1, r_hi)], t1, t2,
                      ADAPTER_BYTES_PER_PARAM)  # optimizer_in_backward keeps the gradient buffer too
    per_token, per_token_rank, per_param, intercept = fit
    s1, s2 = probes[(t1, r_lo)][3], probes[(t2, r_lo)][3]
    sec_per_token = max(0.0, (s2 - s1) / (t2 - t1))
    return MemoryModel(base_bytes=max(base, int(intercept)), bytes_per_token=per_token,
                       bytes_per_token_rank=per_token_rank, seconds_per_token=sec_per_token,
                       seconds_per_step=max(0.0, s1 - sec_per_token * t1),
                       ce_chunk_bytes=int(ce), ce_chunk_tokens=chunk or 0, bytes_per_param=per_param,
                       optimizer_in_backward=optimizer_in_backward)


Probe = tuple[float, int, int, float]
"""(peak bytes, adapter parameters, rank width, seconds) of one probe."""


def _fit_memory(p1: Probe, p2: Probe, p3: Probe, p4: Probe, t1: int, t2: int,
                floor: float = ADAPTER_BYTES_PER_PARAM) -> tuple[float, float, float, float]:
    """Solve ``peak = c + a t + b t w + q P`` from the probes at (t1, low rank), (t2, low), (t2, high),
    (t1, high); returns (a, b, q, c). ``q`` is at least ``floor``, the least bytes an adapter parameter costs (its fp32
    weight, the step's fp32 gradient buffer, kept with ``optimizer_in_backward`` too, and AdamW's two moments)."""
    (m1, par_lo, w_lo, _), (m2, _, _, _), (m3, par_hi, w_hi, _), (m4, _, _, _) = p1, p2, p3, p4
    low, high = (m2 - m1) / (t2 - t1), (m3 - m4) / (t2 - t1)  # per-token slopes at each rank width
    b = max(0.0, (high - low) / (w_hi - w_lo)) if w_hi != w_lo else 0.0
    a = max(0.0, low - b * w_lo)
    q = float(floor)
    if par_hi != par_lo:
        q = max(q, (m4 - m1 - b * t1 * (w_hi - w_lo)) / (par_hi - par_lo))
    return a, b, q, m1 - a * t1 - b * t1 * w_lo - q * par_lo


def _ce_chunk_bytes(pm: PackedModel, chunk: int, vocab: int) -> int:
    """Peak transient memory of the chunked loss over one full chunk (forward and backward), measured."""
    head = pm.output_head()
    dtype = next(head.parameters()).dtype
    hidden = torch.randn(1, chunk + 1, head.in_features, dtype=dtype, device=pm.device, requires_grad=True)
    labels = torch.randint(0, vocab, (1, chunk + 1), device=pm.device)
    layout = PackLayout((0,), (0,), (1,), (chunk + 1,), (0.0,), (0,))
    held = hidden.numel() * hidden.element_size()  # hidden's gradient: the body's activations count it already

    def run() -> None:
        chunked_slot_losses(hidden, head, labels, layout, chunk_tokens=chunk)[0].sum().backward()

    run()  # warm-up: allocator pools
    before = peak_memory(lambda: None, pm)
    return max(0, peak_memory(run, pm) - before - held)
