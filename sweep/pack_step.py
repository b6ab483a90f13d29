"""The plan's step time, measured on the pack it sized: ``sweep plan`` times a few real steps of that pack.

The calibration's time line (``packer.probe.calibrate``) comes from two probes of one and two rows, each timed over a
single step, and a plan extrapolated it to a pack of 10-20x their tokens: the same plan on the same idle host gave
2.7x apart step times. Once the plan has sized the pack (its slots, rows per slot and step length for the study's
space), ``PackTimer`` runs that pack (``packer.probe.time_pack``: one warm-up step, every slot's turnover, then at
least ``PACK_STEPS`` timed, on the CPU as many more as ``PACK_TIMED_S`` holds, on the step the run takes, CUDA graph
included) and the plan predicts with the measured step; the memory still comes from the probes.

What the timed pack is: ``slots`` slots whose adapters are drawn at random from the space (``slot_specs``: each
categorical value, target set and range as the sampler's random start-up draws them, so a pack mixes DoRA and plain
slots, attention and MLP targets, as a run's does), every slot the plan's rows per slot (the space's largest
micro-batch, as the memory plan), at the step length that holds a run's mean step (``step_length``: a run pads every
row of a step to the length, among the pack's few, that holds the longest row of all its slots). The prediction then
goes through the measured point along the calibration's line (``timed_model``), to the run's mean length exactly,
and the evaluation's per-token time is scaled alike.

It is bounded: the probes' line says what the timed steps would cost, and a pack whose warm-up and first timed step
would pass ``PACK_BUDGET_S`` is not timed (the plan says so and keeps the probes' line). The measurement is cached
beside the calibration (``sweep.calibration.cached_pack_step``), keyed by the calibration's key and the pack.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
import random
import statistics
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lora_sweep.packer.api import AdapterSpec, Packer, data
from lora_sweep.sweep.calibration import cache_pack_step, cached_pack_step

if TYPE_CHECKING:
    from lora_sweep.packer.api import MemoryModel
    from lora_sweep.sweep.config.spec import Param, StudySpec

__all__ = ["PackStep", "PackTimer", "EVAL_REPEATS", "EVAL_TIMED_S", "EVAL_MAX_REPEATS", "timed_repeats", "PACK_STEPS",
           "PACK_MAX_STEPS", "PACK_TIMED_S", "PACK_WARMUP", "PACK_BUDGET_S", "slot_specs", "step_length",
           "step_mean_length", "padded_mean_length", "bucket_lengths", "timed_model", "turnover_seconds"]

PACK_STEPS = 3
"""Steps of the sized pack timed after its warm-up, at least (their median on the CPU, their mean on CUDA)."""
PACK_TIMED_S = 3.0
"""Seconds of timed steps aimed at: on the CPU the steps are timed until as many as this holds of the fastest of
them (``packer.probe.time_pack``'s ``min_s``), up to ``PACK_MAX_STEPS``, so a moment's load on a shared host, or a
short pack's three steps of a fraction of a second, no longer decide the plan; on CUDA, whose steps are steady, as
many as the probes' line says it holds."""
PACK_MAX_STEPS = 60
"""Timed steps at most, however short."""
PACK_WARMUP = 1
"""Untimed steps first: the slots' first step (on CUDA the kernels' compile and the graph's capture)."""
PACK_BUDGET_S = 60.0
"""Seconds the timing may take, as the probes' line predicts it: fewer timed steps where all would pass it, none
(the probes' line kept) where the warm-up and one step would."""
EVAL_REPEATS = 3
"""Timed batches of each evaluator on the sized pack's ending slots, after one warm-up, at least: their median is
kept."""
EVAL_TIMED_S = 1.0
"""Seconds of timed batches aimed at: a short batch (tens of milliseconds) is timed until as many as this holds of
the fastest of them, up to ``EVAL_MAX_REPEATS``, as the steps are (``PACK_TIMED_S``): three batches of 40 ms put a
plan's evaluation at 1x in one pass and 3.4x in the next on a shared host."""
EVAL_MAX_REPEATS = 25
"""Timed batches at most, however short."""
_SAMPLES = 512
"""Simulated steps whose padded length ``step_length`` averages."""


@dataclass(frozen=True)
class PackStep:
    """The sized pack and its step, as ``PackTimer`` timed it (or why it did not)."""

    slots: int
    rows: int
    """Rows per slot of a step."""
    length: int
    """Padded length of the timed steps' rows (one of the run's step lengths)."""
    mean_length: float
    """The run's mean padded step length (``step_length``): what the prediction is for."""
    step_s: float | None
    """Seconds of one timed step; None: not timed (``where`` says why)."""
    where: str
    """How the step time was had: measured (steps, cost, cache file), cached (the file) or not timed (why)."""
    setup_s: float = 0.0
    """Seconds the pack's start adds to its first step (the slots' store and set-up, the first step's warm-up)."""
    turnover_s: float = 0.0
    """Seconds per slot that ends and is refilled: its end, its adapter saved as a run saves it, a new slot's
    start (``packer.probe.time_pack``'s ``turnover``)."""
    eval_batch_s: dict[str, float] = dataclasses.field(default_factory=dict)
    """Per evaluator (by name): seconds of one batch of its held-out rows scored for ``eval_slots`` slots of the pack
    as they ended (``sweep.schedule.eval_seconds`` scales its estimate through it); empty: not measured."""
    eval_slots: int = 0
    """Slots ``eval_batch_s`` scored at once (the first slots to end)."""
    eval_first_s: dict[str, float] = dataclasses.field(default_factory=dict)
    """Per evaluator: seconds its first batch took beyond ``eval_batch_s`` (what a run pays once: the held-out rows'
    tokenizing, the evaluator's own set-up)."""

    @property
    def tokens(self) -> int:
        """Padded tokens of a timed step."""
        return self.slots * self.rows * self.length

    @property
    def mean_tokens(self) -> float:
        """Padded tokens of the run's mean step."""
        return self.slots * self.rows * self.mean_length


def timed_model(mm: MemoryModel, timed: PackStep) -> MemoryModel:
    """``mm`` with its time line scaled through the measured point (``timed``'s tokens, its step seconds): both
    terms by the measured step over the line's, so the line holds the measured step at the timed size and keeps its
    shape (fixed part against per-token part) elsewhere; ``mm`` itself when nothing was timed."""
    line = mm.step_seconds(timed.tokens)
    if timed.step_s is None or line <= 0:
        return mm
    factor = timed.step_s / line
    return dataclasses.replace(mm, seconds_per_token=mm.seconds_per_token * factor,
                               seconds_per_step=mm.seconds_per_step * factor)


def turnover_seconds(timed: PackStep | None, trials: int) -> tuple[float, str]:
    """Seconds a run spends around its steps on its pack's start and its slots' turnover, and the plan's line: the
    pack's start once (its store and first slots' set-up, the first step's warm-up), then for each of ``trials``
    trials its slot's end with its adapter saved and a new slot's start; both measured on the sized pack
    (``sweep.pack_step``, ``packer.probe.time_pack``'s ``turnover``). Not counted (0) where the pack was not timed."""
    if timed is None or timed.step_s is None:
        return 0.0, "not counted: the sized pack was not timed"
    total = timed.setup_s + trials * timed.turnover_s
    return total, (f"{total:.0f} s: the pack's start {timed.setup_s:.1f} s, then {timed.turnover_s * 1000:.0f} ms per "
                   f"trial (its slot's end, its adapter saved, a new slot's start) x {trials} trials, measured on the "
                   f"sized pack")


def bucket_lengths(spec: StudySpec, lengths: Sequence[int], capacity: int) -> tuple[int, ...]:
    """The padded lengths a pack of ``capacity`` slots steps at (``packer.step.shapes.length_buckets``) for training
    rows of ``lengths`` tokens: at most a few, fitted to the longest of ``capacity`` x the smallest micro-batch rows
    the space can draw (the most spread a step's longest row has); a pack that may sample-pack also gets its rows'
    length, ``data.max_length``."""
    micro = [spec.train.micro_batch]
    for p in spec.search.params:
        if p.name == "micro_batch":
            micro += [int(c) for c in p.choices] if p.choices else [int(p.low or 1)]
    packs = spec.train.sample_packing or any(p.name == "sample_packing" and True in p.choices
                                             for p in spec.search.params)
    return Packer.length_buckets([*lengths, *([spec.data.max_length] if packs else [])], capacity * max(1, min(micro)))


def _step_rows(spec: StudySpec, lengths: Sequence[int]) -> list[int]:
    """Token lengths of the rows a study's steps draw, from its training examples' ``lengths``: the examples, or
    with ``train.sample_packing`` the packed rows they make (``packer.data.row_lengths``)."""
    train = spec.train
    adapter = AdapterSpec(micro_batch=train.micro_batch, sample_packing=train.sample_packing)
    return data.row_lengths(lengths, adapter, spec.seed, spec.data.max_length)


def step_mean_length(spec: StudySpec, lengths: list[int]) -> float:
    """Mean padded length per row of one slot's micro-batch (``padded_mean_length`` of ``_step_rows``): a plan's
    step length where it times no pack (``step_length`` is a whole pack's)."""
    return padded_mean_length(_step_rows(spec, lengths), spec.train.micro_batch)


def padded_mean_length(lengths: list[int], rows: int, samples: int = 50, seed: int = 0) -> float:
    """Mean padded length per row of random batches of ``rows`` rows (what a step really computes)."""
    rng = random.Random(seed)
    if not lengths:
        return 0.0
    return sum(max(rng.choices(lengths, k=rows)) for _ in range(samples)) / samples


def step_length(spec: StudySpec, lengths: Sequence[int], slots: int, rows: int) -> tuple[int, float]:
    """(the step length to time, the run's mean padded step length) of a pack of ``slots`` slots of ``rows`` rows
    drawn from training rows of ``lengths`` tokens (with sample packing the packed rows they make): a step pads every
    row to the smallest of the pack's lengths (``bucket_lengths``) holding the longest of its ``slots * rows`` rows.
    The timed length is the smallest of them holding the mean."""
    drawn = _step_rows(spec, lengths) or [spec.data.max_length]
    buckets = bucket_lengths(spec, lengths or [spec.data.max_length], slots)

    def padded(longest: float) -> int:
        return buckets[min(bisect.bisect_left(buckets, longest), len(buckets) - 1)]

    rng = random.Random(spec.seed)
    mean = statistics.fmean(padded(max(rng.choices(drawn, k=slots * rows))) for _ in range(_SAMPLES))
    return padded(mean), mean


def slot_specs(spec: StudySpec, slots: int) -> list[AdapterSpec]:
    """One adapter per slot, drawn at random from the study's space (seeded by the study's seed): each searched
    value as a random start-up trial draws it (a categorical's choice, a range's uniform or log-uniform point), on top
    of the fixed ``train`` values (the study's checks have refused a space with a point the adapter refuses)."""
    from lora_sweep.sweep.config.space import adapter_spec  # Optuna's: only where a plan draws slots

    rng = random.Random(spec.seed)
    return [adapter_spec({p.name: _draw(p, rng) for p in spec.search.params}, spec.train, i, space=spec.search)
            for i in range(slots)]


def _draw(p: Param, rng: random.Random) -> object:
    """A random value of dimension ``p``."""
    if p.kind == "categorical":
        return rng.choice(p.choices)
    low, high = float(p.low or 0), float(p.high or 0)
    x = math.exp(rng.uniform(math.log(low), math.log(high))) if p.log and low > 0 else rng.uniform(low, high)
    if p.step:
        x = min(high, low + round((x - low) / p.step) * p.step)
    return round(x) if p.kind == "int" else x


def _describe(spec: AdapterSpec) -> dict[str, Any]:
    """What of a slot's adapter its step's time depends on (the cache key's part)."""
    return {"rank": spec.rank, "rows": spec.rows, "targets": list(spec.targets), "dropout": spec.dropout > 0,
            "dora": spec.dora, "sample_packing": spec.sample_packing, "accumulation": spec.gradient_accumulation_steps}


class PackTimer:
    """Times the pack a plan sizes (``planning.plan_report`` calls it with the slots it chose): from the cache, or
    measured on the model ``load`` returns (called only then: a plan whose timing is cached loads no model)."""

    def __init__(self, spec: StudySpec, device: str, lengths: Sequence[int], load: Callable[[], Packer], *,
                 log: Callable[[str], None] | None = None, budget_s: float = PACK_BUDGET_S, gpus: int = 1,
                 report: Callable[[Path], object] | None = None) -> None:
        self.spec, self.device, self.lengths, self.load, self.log, self.budget_s = \
            spec, device, lengths, load, log, budget_s
        self.gpus = gpus
        """GPUs a ``pack.shard: fsdp`` pack trains over: above one, its step (FSDP's collectives across processes)
        is not what one process can time, and the probes' line stands."""
        self.report = report
        """Writes a study directory's HTML report (``reports.html.write_report``, handed over by the command: the
        sweep does not import ``reports``): the plan times it on its scratch study (``sweep.bookkeeping``)."""

    def __call__(self, slots: int, rank: int, rows: int, mm: MemoryModel) -> PackStep:
        """The step of ``slots`` slots of ``rows`` rows each, rank bucket ``rank`` (the space's most rank rows);
        ``mm``: the calibration, whose line bounds the timing's cost."""
        spec = self.spec
        length, mean = step_length(spec, self.lengths, slots, rows)
        specs = slot_specs(spec, slots)
        options: dict[str, Any] = {
            "cuda_graphs": "off" if spec.pack.shard == "fsdp" else spec.pack.cuda_graphs,  # as the run's step
            "chunked_ce": spec.pack.chunked_ce, "activation_checkpointing": spec.pack.activation_checkpointing,
            "optimizer_in_backward": spec.train.optimizer_in_backward}
        shape = PackStep(slots, rows, length, mean, None, "")
        line = mm.step_seconds(shape.tokens)
        most = PACK_MAX_STEPS if line <= 0 else min(PACK_MAX_STEPS, math.floor(self.budget_s / line) - PACK_WARMUP)
        steps = min(PACK_STEPS, most)
        if self.device.startswith("cuda") and line > 0:  # the CPU's steps go on until they hold PACK_TIMED_S
            steps = min(max(PACK_STEPS, math.ceil(PACK_TIMED_S / line)), most)  # (``time_pack``); CUDA's: the line's
        pack = {"rows": rows, "length": length, "max_rows": rank, "warmup": PACK_WARMUP,
                "slots": [_describe(s) for s in specs], "options": options,
                "evaluators": [[name, opts] for name, opts in _timed_entries(spec)]}
        hit = cached_pack_step(spec, self.device, pack)
        if hit is not None:
            return dataclasses.replace(shape, step_s=float(hit[0]["step_s"]), setup_s=float(hit[0]["setup_s"]),
                                       turnover_s=float(hit[0]["turnover_s"]), where=f"cached ({hit[1]})",
                                       eval_batch_s={k: float(v) for k, v in hit[0]["eval_batch_s"].items()},
                                       eval_slots=int(hit[0]["eval_slots"]),
                                       eval_first_s={k: float(v) for k, v in hit[0]["eval_first_s"].items()})
        size = f"{slots} slots x {rows} rows x {length} tokens"
        if spec.pack.shard == "fsdp" and self.gpus > 1:
            return dataclasses.replace(shape, where=f"not timed: a pack sharded over {self.gpus} GPUs steps in "
                                                    f"{self.gpus} processes; the probes' line")
        if steps < 1:
            return dataclasses.replace(shape, where=f"not timed: its warm-up and one step of {size} would take about "
                                                    f"{(PACK_WARMUP + 1) * line:.0f} s on the probes' line, over "
                                                    f"{self.budget_s:.0f} s; the probes' line")
        return self._measure(shape, specs, rank, (steps, max(steps, most)), pack, size)

    def _measure(self, shape: PackStep, specs: list[AdapterSpec], rank: int, steps: tuple[int, int],
                 pack: dict[str, Any], size: str) -> PackStep:
        """``shape`` timed over at least ``steps[0]`` steps of ``specs``'s slots, on the CPU up to ``steps[1]`` until
        they hold ``PACK_TIMED_S`` (announced first), and cached as ``pack``."""
        import torch

        cuda = self.device.startswith("cuda")
        if self.log is not None:
            count = f"{steps[0]}" if cuda or steps[1] == steps[0] else \
                f"{steps[0]}-{steps[1]} (until {PACK_TIMED_S:.0f} s of them)"
            self.log(f"timing the sized pack on {self.device}: {PACK_WARMUP} + {count} steps of {size} (cached for "
                     f"the next plan)")
        packer = self.load()
        ended = _Ended(self.spec, packer)
        try:
            with tempfile.TemporaryDirectory(prefix="lora-sweep-plan-") as scratch:
                ended.scratch = Path(scratch)
                timing = packer.time_pack(specs, shape.rows, shape.length, steps=steps[0], warmup=PACK_WARMUP,
                                          min_s=0.0 if cuda else PACK_TIMED_S, max_steps=steps[1], max_rows=rank,
                                          turnover=True, on_end=ended, **pack["options"])
        except torch.OutOfMemoryError:
            return dataclasses.replace(shape, where=f"not timed: {size} ran out of device memory; the probes' line")
        # the evaluations ran inside the turnover's steps: a trial's turnover is what is left of them
        turnover = max(0.0, (timing.turnover_s or 0.0) - ended.spent_s / shape.slots)
        path = cache_pack_step(self.spec, self.device, pack, {
            "step_s": timing.step_s, "steps": timing.steps, "wall_s": round(timing.wall_s, 3), "step": timing.step,
            "setup_s": timing.setup_s, "turnover_s": turnover, "eval_batch_s": ended.eval_batch_s,
            "eval_slots": ended.eval_slots, "eval_first_s": ended.eval_first_s})
        how = "mean" if cuda else "median"  # as ``time_pack`` takes them
        return dataclasses.replace(shape, step_s=timing.step_s, setup_s=timing.setup_s, turnover_s=turnover,
                                   eval_batch_s=ended.eval_batch_s, eval_slots=ended.eval_slots,
                                   eval_first_s=ended.eval_first_s, where=(
            f"{how} of {timing.steps} steps of {size}, {timing.step} step, after {PACK_WARMUP} warm-up and a "
            f"turnover; measured in {timing.wall_s:.1f} s, cached in {path}"))


def _timed_entries(spec: StudySpec) -> list[tuple[str, dict[str, Any]]]:
    """The evaluator entries whose batch the timed pack scores: the study's built-in ones that declare a cost
    (``evaluators.registry.plan_cost``; a user's code is never run by a plan), and the one scoring the rungs and
    ``eval_every`` (``curve_entry``) where the study prunes or has a curve."""
    from lora_sweep.evaluators.registry import curve_entry, is_user_code, plan_cost

    if not spec.data.eval:
        return []
    entries = [(e.name, dict(e.options)) for e in spec.evaluators]
    curve, _ = curve_entry(entries)
    if spec.pruning.kind == "cohort_sha" or spec.train.eval_every:
        entries.append((curve[0], dict(curve[1])))
    named = {name: opts for name, opts in entries if not is_user_code(name) and plan_cost(name, opts) is not None}
    return list(named.items())


def timed_repeats(fn: Callable[[], object], least: int = EVAL_REPEATS, min_s: float = EVAL_TIMED_S,
                  most: int = EVAL_MAX_REPEATS) -> list[float]:
    """Seconds of each call of ``fn``, called ``least`` times and then until as many as ``min_s`` seconds hold of the
    fastest call, at most ``most`` (a short call is timed by many, so one another process slowed moves their median
    little; a long one by ``least``)."""
    import time

    times: list[float] = []
    while len(times) < most and (len(times) < least or len(times) * min(times) < min_s):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


class _Ended:
    """The timed pack's ``on_end``, as a run's: the ending slots' adapters saved under ``scratch`` (``Packer.save``:
    copied off the slots, written by the packer's writer, waited for), then each timed entry (``_timed_entries``)
    scoring one batch of the held-out rows on the first slots to end, a warm-up and then ``timed_repeats`` times,
    their median kept (``eval_batch_s``), and what the warm-up took beyond it (``eval_first_s``). An entry that
    fails here is left untimed (the run's own check says why)."""

    def __init__(self, spec: StudySpec, packer: Packer) -> None:
        self.spec, self.packer, self.scratch = spec, packer, Path()
        self.entries = _timed_entries(spec)
        self.eval_batch_s: dict[str, float] = {}
        self.eval_first_s: dict[str, float] = {}
        self.eval_slots = 0
        self.spent_s = 0.0
        """Seconds of the evaluations here in all (the held-out rows read, the warm-ups): not the turnover's."""

    def __call__(self, ends: list[Any]) -> None:
        import time

        for future in self.packer.save([(e.slot, self.scratch / f"slot-{e.slot}", None) for e in ends]):
            future.result()
        if not self.entries or self.eval_slots:  # scored once: by the first slots to end (with accumulation, not all)
            return
        self.eval_slots = len(ends)
        started = time.perf_counter()
        self._score(ends, self.entries)
        self.spent_s += time.perf_counter() - started

    def _score(self, ends: list[Any], entries: list[tuple[str, dict[str, Any]]]) -> None:
        """Each entry's batch, scored on the ending slots: a warm-up, then ``timed_repeats`` (``__call__``)."""
        import time

        from lora_sweep.evaluators.registry import evaluate, load_eval_data, plan_cost

        d = self.spec.data
        held_out = load_eval_data(d.eval, self.packer.tokenizer, fmt=d.format, max_length=d.max_length,
                                  train_on_prompt=d.train_on_prompt, work_dir=self.scratch, max_line_bytes=d.line_bytes)
        for name, opts in entries:
            cost = plan_cost(name, opts)
            assert cost is not None  # (``_timed_entries``)
            batch = dataclasses.replace(held_out, rows=held_out.rows[:cost.batch_size])
            slots = [e.slot for e in ends]
            try:  # the first untimed: it also pays what an evaluator does once in a run (a warm-up)
                t0 = time.perf_counter()
                evaluate(self.packer.model, slots, batch, [(name, opts)])
                times = [time.perf_counter() - t0, *timed_repeats(
                    lambda: evaluate(self.packer.model, slots, batch, [(name, opts)]))]  # noqa: B023
            except Exception:  # noqa: BLE001  (the plan's estimate stays the model's; the run reports the error)
                continue
            self.eval_batch_s[name] = statistics.median(times[1:])  # as the steps: one descheduled batch moves less
            self.eval_first_s[name] = max(0.0, times[0] - self.eval_batch_s[name])
