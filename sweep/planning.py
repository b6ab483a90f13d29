"""How many slots a pack gets, and what a study will cost, before any training: ``sweep plan``.

The memory model (``packer.plan.MemoryModel``) is calibrated on the study's own model and device by the packer
(``Packer.calibrate``, its probes sized for the space by ``Packer.probe_options``); the worst-case slot of the search
space (largest rank and micro-batch, widest target set, full sequence length) decides how many fit, and the packer
says how many that is (``MemoryModel.slots_for``) and what their step's peak is (``MemoryModel.pack_peak``), on one
GPU of a sharded base too, and what a sharded base's load holds (``Packer.sharded_load_peak``).

A calibration is cached (``sweep.calibration``) per (model files, device, shape and training options, torch and
threads) with the base's shape beside it: a second ``sweep plan``, or a ``pack: auto`` run after it, reads them
back instead of probing again, and ``plan_report`` plans from them without the model. What it is worth: the memory
terms are exact for the probed shapes (on CUDA the allocator's peak, on the CPU counted tensor bytes) and linear
between them; the step time is measured on the pack the plan sized (``sweep.pack_step``: a few real steps of its
slots, rows and step length, cached too), as the host is while it runs (a loaded shared CPU skews it: the plan's
time is a guide, its slots are not); the probes' time line only carries it to the run's mean step. The time
counts the pack's expected steps under the rungs (``sweep.schedule``: backfill, cohort SHA's cumulative cohorts), the
evaluations that schedule runs (``eval_seconds``: a forward costs a base forward's measured fixed time and a third of
the step's per-token time, scaled through a batch of each evaluator scored on the sized pack), the pack's start and
every trial's slot turnover (measured on the sized pack), the storage of the trial budget (``sweep.bookkeeping``) and
the start-up (imports, load, the data's tokenizing) measured where the calibration ran.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from lora_sweep.errors import ConfigError
from lora_sweep.packer.api import AdapterSpec, BaseShape, MemoryModel, Packer, data
from lora_sweep.sweep.bookkeeping import storage_seconds
from lora_sweep.sweep.calibration import SHARD_WORLDS, cache_dir, cached_calibration, calibrated, calibration_key
from lora_sweep.sweep.config.spec import StudySpec
from lora_sweep.sweep.pack_step import (
    PackStep,
    PackTimer,
    padded_mean_length,
    step_mean_length,
    timed_model,
    turnover_seconds,
)
from lora_sweep.sweep.schedule import Schedule, eval_rows, eval_seconds, expected_schedule

__all__ = ["check_targets", "largest_rank", "PlanReport", "plan_pack", "plan_report", "trial_micro_steps",
           "target_sets", "MEMORY_FRACTION", "MAX_AUTO_SLOTS", "calibrated", "cached_calibration", "cache_dir",
           "calibration_key", "train_lengths", "load_and_calibrate", "eval_seconds", "eval_rows",
           "pack_schedule", "padded_mean_length", "step_mean_length", "turnover_seconds"]

MEMORY_FRACTION = 0.85
"""Share of the device's available memory a pack may plan for (the rest: fragmentation, evaluation)."""
MAX_AUTO_SLOTS = 64


@dataclass(frozen=True)
class PlanReport:
    """What ``sweep plan`` prints."""

    device: str
    slots: int
    worst_rank: int
    worst_micro_batch: int
    seq_len: int
    available_bytes: int
    predicted_peak_bytes: int
    memory: MemoryModel
    predicted_step_s: float
    predicted_total_s: float | None
    pack_steps: int | None
    step_range_s: tuple[float, float] | None = None
    """(fastest, slowest) predicted step over the calibrations; None after a single one."""
    calibrations: int = 1
    quantize: str | None = None
    """``model.quantize`` (``nf4``: the base part is the NF4 base, measured as such)."""
    calibration: str = ""
    """Where the memory model came from: measured (how long it took) or the cache (its file)."""
    gpus: int = 1
    """GPUs the base is sharded over (``pack.shard: fsdp``); the memory rows are then per GPU."""
    base_bytes: int = 0
    """The base's part of the peak on one GPU: the whole base, or with a shard one rank's share of it."""
    load_peak_bytes: int = 0
    """With a shard: the most base bytes one GPU holds while the base loads (its share and one chunk read by rows,
    ``packer.model.shard_load``; the whole base where it loads whole first)."""
    load_note: str = ""
    """How a sharded base loads: by rows, or whole on every rank and why."""
    predicted_eval_s: float | None = None
    """Seconds of evaluation for the trial budget (``eval_seconds``): final scores, rungs, ``eval_every``."""
    eval_note: str = ""
    """What the evaluation estimate counts, and the evaluators it cannot model."""
    schedule: Schedule | None = None
    """The pack's expected schedule under the rungs (``sweep.schedule``); None without a trial budget."""
    startup_s: float = 0.0
    """Seconds before the first step: a run's imports and the base's load, as measured where it was calibrated."""
    pruning_note: str = ""
    """How the rungs cut the budget, or that the study does not prune."""
    timed: PackStep | None = None
    """The sized pack's own step, timed (``sweep.pack_step``); None: the calibration's line alone."""
    turnover_s: float = 0.0
    """Seconds of the pack's start and its slots' turnover for the trial budget (``turnover_seconds``)."""
    turnover_note: str = ""
    """What the turnover counts (the pack's start, per trial), or why it is not counted."""
    storage_s: float = 0.0
    """Seconds of the run's storage for the trial budget: asks, rows and tells (``sweep.bookkeeping``)."""
    storage_note: str = ""
    """How the storage was had, or why it is not counted."""

    def table(self) -> str:
        gib = 1024**3
        around = self.startup_s + self.turnover_s + self.storage_s
        total = "-" if self.predicted_total_s is None else \
            f"{self.predicted_total_s + (self.predicted_eval_s or 0) + around:.0f} s " \
            f"({self.pack_steps} pack steps: training {self.predicted_total_s:.0f} s, " \
            f"evaluation {self.predicted_eval_s or 0:.0f} s, slot turnover {self.turnover_s:.0f} s, " \
            f"storage {self.storage_s:.0f} s, " \
            + (f"start-up {self.startup_s:.0f} s)" if self.startup_s else
               "start-up not counted: the cached calibration was measured inside a run, which does not time it)")
        per_gpu = f" per GPU ({self.gpus} GPUs, FSDP)" if self.gpus > 1 else ""
        base = "one rank's FSDP share of the base" if self.gpus > 1 else "base model"
        rows = [
            ("device", self.device),
            ("slots per pack", str(self.slots)),
            ("worst-case slot", f"rank {self.worst_rank}, micro-batch {self.worst_micro_batch}, seq {self.seq_len}"),
            ("memory available (planned share)", f"{self.available_bytes / gib:.2f} GiB ({MEMORY_FRACTION:.0%})"),
            ("predicted peak of a full pack" + per_gpu, f"{self.predicted_peak_bytes / gib:.3f} GiB"),
            (f"frozen ({base}" + (f", {self.quantize} projections" if self.quantize else "") + ")",
             f"{(self.base_bytes or self.memory.base_bytes) / gib:.3f} GiB"),
            ("per token / per token x rank", f"{self.memory.bytes_per_token / 1024:.1f} KiB / "
                                             f"{self.memory.bytes_per_token_rank:.0f} B"),
            ("per adapter parameter", f"{self.memory.bytes_per_param:.1f} B"),
            ("predicted step", self._step_text()),
            ("calibration", self.calibration or "-"),
        ]
        if self.timed is not None:
            rows.append(("sized pack's step", self.timed.where))
        timed = self.timed is not None and self.timed.step_s is not None
        rows.append(("accuracy", "memory: measured at the probed sizes, linear between them (the slots); time: " + (
            "the sized pack's own steps, timed on the host as it is (a busy host skews it)" if timed else
            "two timed probes extrapolated to the pack, as noisy as the host is busy (a guide)")))
        if self.gpus > 1:
            rows.append(("peak while loading the base, per GPU",
                         f"{self.load_peak_bytes / gib:.3f} GiB ({self.load_note})"))
            rows.append(("replicated on every GPU", "each slot's adapter, gradient and AdamW state; activations"))
        rows += [
            ("pruning", self.pruning_note or "-"),
            ("predicted evaluation", self.eval_note or "-"),
            ("predicted slot turnover", self.turnover_note or "-"),
            ("predicted storage", self.storage_note or "-"),
            ("predicted time for the trial budget", total),
        ]
        width = max(len(k) for k, _ in rows)
        return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)

    def _step_text(self) -> str:
        text = f"{self.predicted_step_s * 1000:.0f} ms"
        t = self.timed
        if t is not None and t.step_s is not None:
            return (f"{text} (a mean step of {t.slots} slots x {t.rows} rows x {t.mean_length:.1f} tokens; the "
                    f"timed {t.length} tokens: {t.step_s * 1000:.0f} ms)")
        if self.step_range_s is None:
            return text
        low, high = self.step_range_s
        spread = f"{high / low:.1f}x" if low > 0 else "unbounded"
        return (f"{text} (median of {self.calibrations} calibrations; range {low * 1000:.0f}-{high * 1000:.0f} ms, "
                f"spread {spread})")


def check_targets(spec: StudySpec, packer: Packer) -> None:
    """Every target set the study can train names projections the base has, each as wide as the study's largest
    rank (as ``sweep run`` requires: ``PackedModel.add_slot`` refuses a rank above a layer's ``min(D_in, D_out)``,
    which a PiSSA / OLoRA decomposition cannot give either); called before the study creates a trial.

    Raises:
        ConfigError: ``search.targets.<set>`` (or ``train.targets``) names a module the model lacks, or
            ``search.rank`` (``train.rank``) holds a rank larger than a layer one of them targets.
    """
    searched = any(p.name == "targets" for p in spec.search.params)
    rank = _largest(spec, "rank")
    for name, modules in target_sets(spec).items():
        try:
            shapes = packer.targets(modules)
        except ConfigError as err:
            key = f"search.targets.{name}" if searched else "train.targets"
            raise ConfigError(f"{key}: {str(err).removeprefix('targets: ')}") from None
        for path, shape in shapes.items():
            if shape is not None and rank > min(shape):
                key = "search.rank" if any(p.name == "rank" for p in spec.search.params) else "train.rank"
                where = f"search.targets.{name}" if searched else "train.targets"
                raise ConfigError(f"{key}: rank {rank} is larger than layer {path} ({shape[0]} -> {shape[1]}) of "
                                  f"{where}, whose largest rank is {min(shape)}")


def target_sets(spec: StudySpec) -> dict[str, tuple[str, ...]]:
    """The target sets the study can train, by name (``search.targets``; ``""``: the fixed ``train.targets``)."""
    searched = any(p.name == "targets" for p in spec.search.params)
    return {k: tuple(v) for k, v in spec.search.target_sets.items()} if searched else {"": tuple(spec.train.targets)}


def _largest(spec: StudySpec, name: str) -> int:
    """The largest value of setting ``name`` over the space (its ``train`` value when it is not searched)."""
    return int(max(spec.setting_values(name, ranged=True)))


def largest_rank(spec: StudySpec) -> int:
    """The most rank rows a trial of the space can have: what a pack is planned for and sized by. A PiSSA / OLoRA
    trial has twice its rank (``AdapterSpec.rows``: the frozen principal correction beside the trained rows), which
    its forward reads and the pack's buffers hold."""
    rank = _largest(spec, "rank")
    return max(AdapterSpec(rank=rank, init=str(init)).rows for init in spec.setting_values("init"))


def trial_micro_steps(spec: StudySpec, micro: int, examples: Sequence[data.Example] | None = None) -> int:
    """Pack steps (micro-batches) the longest trial takes: its optimizer steps times its accumulation.

    Optimizer steps: the largest ``max_steps`` of the space, or with ``train.epochs`` (``max_steps`` not searched)
    and the ``examples``, the epochs' steps at micro-batch ``micro`` as a trial counts them
    (``packer.data.stream.epoch_steps``: ``ceil(epochs * ceil(micro-batches per epoch / accumulation))``, each
    epoch capped at ``max_steps_per_epoch``)."""
    steps, accum = _trial_steps(spec, micro, examples)
    return steps * accum


def _trial_steps(spec: StudySpec, micro: int, examples: Sequence[data.Example] | None = None) -> tuple[int, int]:
    """(optimizer steps, accumulation) of the longest trial, as ``trial_micro_steps`` counts them."""
    train = spec.train
    accum = _largest(spec, "gradient_accumulation_steps")
    searched = {p.name for p in spec.search.params}
    if train.epochs is not None and "max_steps" not in searched and examples:
        widest = AdapterSpec(micro_batch=micro, gradient_accumulation_steps=accum, sample_packing=train.sample_packing)
        steps = data.epoch_steps(examples, widest, train.epochs, spec.data.max_length, spec.seed,
                                 train.max_steps_per_epoch)
    else:
        steps = _largest(spec, "max_steps")
    return steps, accum


def plan_pack(spec: StudySpec, packer: Packer, *, mean_len: float | None = None,
              calibrations: int = 1, examples: Sequence[data.Example] | None = None,
              log: Callable[[str], None] | None = None, gpus: int = 1) -> PlanReport:
    """Calibrate the memory model (or read it from the cache) and size the pack; ``mean_len`` (tokens per row)
    sharpens the time. ``calibrations`` > 1 calibrates that many times and predicts with the median step (the report
    gives the range); ``gpus`` and the rest as ``plan_report``."""
    models, where, _ = calibrated(spec, packer, calibrations, log=log)
    sharded = spec.pack.shard == "fsdp" and gpus > 1  # else no FSDP share to compute (nor torch.distributed)
    base = dataclasses.replace(packer.shape((gpus,) if sharded else ()), forward_s=packer.forward_seconds())
    return plan_report(spec, models, where, base, str(packer.model.device), mean_len=mean_len, examples=examples,
                       gpus=gpus)


def plan_report(spec: StudySpec, models: list[MemoryModel], where: str, base: BaseShape, device: str, *,
                mean_len: float | None = None, examples: Sequence[data.Example] | None = None,
                gpus: int = 1, eval_len: float | None = None, timer: PackTimer | None = None) -> PlanReport:
    """Size the pack from calibrated ``models`` (the median step's one; ``where``: the calibration line) and the base's
    ``base`` shape: no model needed, so a plan from the cache loads no weights. The time counts every trial's
    micro-batches (``trial_micro_steps``: optimizer steps x accumulation; with ``train.epochs``, from ``examples``).
    ``eval_len``: the held-out rows' mean padded length where it differs from a training step's row (``mean_len``:
    sample packing packs training rows, not held-out ones). With ``pack.shard: fsdp`` over ``gpus`` > 1 the memory
    is per GPU: the base's share of one rank
    (``packer.model.shard.base_share``) in place of the whole base, beside the replicated slots. ``timer``: times the
    pack the plan sized (``sweep.pack_step``), whose step then replaces the calibration's line at the pack's size
    (``timed_model``: the evaluation's per-token time scaled alike) and whose mean step length replaces ``mean_len``.

    Raises:
        ConfigError: a sharded plan of a model ``packer.model.shard`` cannot shard.
    """
    rank, micro = largest_rank(spec), _largest(spec, "micro_batch")  # the worst slot, on every projection
    seq = spec.data.max_length
    mm = models[0]
    world = gpus if spec.pack.shard == "fsdp" else 1  # the memory is one GPU's (``MemoryModel.pack_peak``)
    if world > 1 and gpus not in base.shard_peak:
        raise ConfigError(f"pack.shard: fsdp over {gpus} GPUs: {spec.model.path} has no decoder layers and body "
                          f"to shard")
    available = int(Packer.free_memory(device) * MEMORY_FRACTION)
    fit = mm.slots_for(base, rank, micro * seq, available, limit=MAX_AUTO_SLOTS, gpus=world)
    if spec.pack.max_slots != "auto":
        slots = int(spec.pack.max_slots)
    else:
        slots = max(1, min(fit, spec.budget.trials or MAX_AUTO_SLOTS))
    timed = None if timer is None else timer(slots, rank, micro, models[0])  # (the line bounds the timing's cost)
    step_tokens = timed.mean_tokens if timed is not None else int(slots * micro * (mean_len or seq))
    lines = models if timed is None else [timed_model(m, timed) for m in models]
    times = [m.step_seconds(step_tokens) for m in lines]
    step_s = statistics.median_low(times)
    mm = lines[times.index(step_s)]
    opt_steps, accum = _trial_steps(spec, micro, examples)
    schedule = None if spec.budget.trials is None else pack_schedule(spec, slots, opt_steps)
    steps = None if schedule is None else math.ceil(schedule.pack_steps * accum)
    load_peak, note = Packer.sharded_load_peak(base, world, spec.model.path, spec.model.gguf_file,
                                               spec.model.quantize) if world > 1 else (0, "")
    peak = mm.pack_peak(base, slots, rank, micro * seq, gpus=world)
    evals, eval_note = (None, "") if schedule is None else eval_seconds(
        spec, mm, base.forward_s, schedule, eval_rows(spec), eval_len or mean_len or seq,
        timed.eval_batch_s if timed is not None else None, timed.eval_slots if timed is not None else 0,
        timed.eval_first_s if timed is not None else None)
    turnover, turnover_note = (0.0, "") if spec.budget.trials is None else turnover_seconds(timed, spec.budget.trials)
    # the run's storage: measured where the plan times its pack (sweep plan), not in a ``pack: auto`` run's sizing
    storage, storage_note = (0.0, "") if spec.budget.trials is None else \
        storage_seconds(spec, spec.budget.trials, slots, steps=steps or 0, report=timer.report, device=device) \
        if timer else \
        (0.0, "not counted: measured only where the plan times its pack (sweep plan)")
    return PlanReport(device, slots, rank, micro, seq, available, max(peak, load_peak), mm, step_s,
                      None if steps is None else steps * step_s, steps,
                      (min(times), max(times)) if len(models) > 1 else None, len(models), spec.model.quantize,
                      where, world, mm.base_on(base, world), load_peak, note, evals, eval_note,
                      schedule, _startup(spec, base), _pruning_note(spec, schedule, opt_steps), timed,
                      turnover, turnover_note, storage, storage_note)


def _startup(spec: StudySpec, base: BaseShape) -> float:
    """A run's seconds before its first step, where the calibration measured them (0: not measured): the imports and
    the base's load (``base``), then reading and tokenizing the data (``train_lengths``, kept with the lengths)."""
    from lora_sweep.sweep.calibration import tokenize_seconds

    measured = base.imports_s + base.load_s
    return measured + tokenize_seconds(spec) if measured else 0.0


def pack_schedule(spec: StudySpec, slots: int, trial_steps: int) -> Schedule:
    """The expected schedule of the study's trial budget in a pack of ``slots`` (``sweep.schedule``): trials of
    ``trial_steps`` optimizer steps, cut at the rungs when the study prunes; the community default and the config
    baseline, when the study has them, are never pruned."""
    from lora_sweep.sweep.config.space import baseline_params, community_default

    assert spec.budget.trials is not None
    default, _ = community_default(spec.search, spec.train)
    baseline = baseline_params(spec.search, spec.baseline)[0] if spec.baseline else None
    spared = (default is not None) + (baseline is not None and baseline != default)
    prunes = spec.pruning.kind == "cohort_sha"
    return expected_schedule(spec.budget.trials, slots, trial_steps, spec.pruning.rungs if prunes else (),
                             spec.pruning.reduction_factor, spared=spared, eval_every=spec.train.eval_every)


def _pruning_note(spec: StudySpec, schedule: Schedule | None, trial_steps: int) -> str:
    """The plan's pruning line: the rungs, and how many trials the schedule expects at each and at the end."""
    if spec.pruning.kind != "cohort_sha":
        return "none (every trial trains to its last step)"
    text = (f"cohort SHA keeping 1/{spec.pruning.reduction_factor} at steps "
            f"{', '.join(map(str, spec.pruning.rungs))} of {trial_steps}")
    if schedule is None:
        return text
    reached = ", ".join(f"{n:.1f} reach step {r}" for r, n in zip(spec.pruning.rungs, schedule.reached, strict=True))
    return (f"{text}: of {spec.budget.trials} trials {reached}, {schedule.finished:.1f} train to the end (expected, "
            f"rung values in random order)")


def train_lengths(spec: StudySpec, tokenizer: Any) -> tuple[list[int], list[data.Example] | None]:
    """Token lengths of the training rows, and the rows themselves where the plan counts them (``train.epochs``):
    from the cache when the tokenizer is not loaded and the lengths suffice, else tokenized (and cached)."""
    from lora_sweep.sweep.calibration import cache_lengths, cached_lengths

    lengths = cached_lengths(spec) if tokenizer is None and spec.train.epochs is None else None
    if lengths is not None:
        return lengths, None
    if tokenizer is None:
        tokenizer = Packer.read_tokenizer(spec.model.path, spec.model.gguf_file)
    d = spec.data
    t0 = time.perf_counter()
    examples = data.load_examples(d.train, tokenizer, fmt=d.format, max_length=d.max_length,
                                  train_on_prompt=d.train_on_prompt, max_line_bytes=d.line_bytes)
    # a run tokenizes the held-out rows too (its split's load:data): at the training rows' measured pace
    seconds = (time.perf_counter() - t0) * (1 + eval_rows(spec) / max(1, len(examples)))
    lengths = [len(e.input_ids) for e in examples]
    cache_lengths(spec, lengths, seconds)
    return lengths, examples


def load_and_calibrate(spec: StudySpec, device: str, calibrations: int, gpus: int, *,
                       log: Callable[[str], None] | None = None
                       ) -> tuple[list[MemoryModel], str, BaseShape, Any, Packer]:
    """Load the study's model and calibrate it (announced through ``log``; or read the calibration from the cache):
    memory models, their line, the base's shape (with its FSDP share over ``gpus`` too), tokenizer, and the packer
    (what ``sweep.pack_step`` times the sized pack on).

    Raises:
        UserError, ConfigError: as ``load_base`` and ``check_targets``.
    """
    import optuna  # noqa: F401  (what a run imports beyond a plan before its model: timed as its start-up)

    import lora_sweep.evaluators.registry  # noqa: F401
    from lora_sweep.packer.api import open_base
    from lora_sweep.sweep.timing import process_started

    # from the process's start, as a run's split counts its imports (``sweep.timing``): the interpreter's own too
    imports_s, t0 = time.time() - process_started()[0], time.perf_counter()
    packer = open_base(spec.model.path, gguf_file=spec.model.gguf_file, dtype=spec.model.dtype, device=device,
                       quantize=spec.model.quantize, kernels=spec.pack.kernels,
                       fused_base_ops=spec.pack.fused_base_ops, log=log)
    load_s = time.perf_counter() - t0
    check_targets(spec, packer)
    base = packer.shape({*SHARD_WORLDS, gpus} - {1})
    models, where, kept = calibrated(spec, packer, calibrations, log=log, load_s=load_s, imports_s=imports_s)
    # the times as the cache keeps them, so the next plan (from the cache) prints what this one does
    base = dataclasses.replace(base, forward_s=kept.forward_s, load_s=kept.load_s, imports_s=kept.imports_s)
    return models, where, base, packer.tokenizer, packer

