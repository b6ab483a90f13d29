"""The study file as frozen, validated config objects.

``sweep.config.loader.load_study("studies/demo.yaml", ["train.max_steps=50"])`` reads a study file (YAML),
maps the Axolotl / torchtune / PEFT key aliases and a W&B-style ``parameters:`` block onto these
dataclasses, applies dotted command-line overrides and validates everything once. Each dataclass
validates itself in ``__post_init__`` and raises ``ConfigError("key: rule (got value)")``; the
loader adds the file, the line and the full dotted key. Defaults live only here (the study's
strategy — objectives, constraints, budget, pruning, sampler — in ``sweep/config/strategy.py``, re-exported
here), the per-adapter ones only in ``packer.plan.AdapterSpec``; what each key means, and its aliases, in
``sweep/config/fields.yaml``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from lora_sweep.errors import ConfigError
from lora_sweep.evaluators import registry
from lora_sweep.packer.api import AdapterSpec, variants
from lora_sweep.sweep.config._params import SEARCHABLE, Param, SearchSpace, _check, _is_num, check_fields, rule
from lora_sweep.sweep.config.settings import NOT_IN_BACKWARD, TrainSpec, variant_specs, whole
from lora_sweep.sweep.config.sources import FORMATS, DataSpec, ModelSpec
from lora_sweep.sweep.config.strategy import _NAME, Budget, Constraint, Objective, PruningSpec, SamplerSpec
from lora_sweep.sweep.config.tracking import TrackerSpec

__all__ = [
    "Budget", "Constraint", "DataSpec", "EvalSpec", "ModelSpec", "Objective", "PackSpec", "Param", "PruningSpec",
    "SamplerSpec", "SearchSpace", "StudySpec", "TrackerSpec", "TrainSpec",
    "EVALUATORS", "FORMATS", "SEARCHABLE",
]  # fmt: skip

EVALUATORS = tuple(e.name for e in registry.EVALUATORS)
@dataclass(frozen=True)
class PackSpec:
    """How many trials share one training run."""

    max_slots: int | Literal["auto"] = rule(lambda v: v == "auto" or (isinstance(v, int) and 1 <= v <= 256),
                                            "must be auto or an int in 1..256", "auto")
    chunked_ce: bool | int = rule(lambda v: isinstance(v, bool) or (isinstance(v, int) and v >= 1),
                                  "must be true, false or a number of tokens >= 1", False)
    activation_checkpointing: bool = False
    kernels: Literal["auto", "triton", "torch"] = "auto"
    fused_base_ops: bool = True
    cuda_graphs: Literal["auto", "on", "off"] = "auto"
    shard: Literal["none", "fsdp"] = "none"

    def __post_init__(self) -> None:
        check_fields(self)
        _check(not (self.shard == "fsdp" and self.cuda_graphs == "on"), "shard",
               "fsdp runs the eager step (no CUDA graph under FSDP's collectives): needs cuda_graphs auto or off",
               self.shard)
        _check(not (self.shard == "fsdp" and self.max_slots == "auto"), "shard",
               "fsdp needs pack.max_slots set (the auto planner calibrates one process, not a sharded pack)",
               self.shard)


def _jsonlike(x: object) -> bool:
    if isinstance(x, Mapping):
        return all(isinstance(k, str) and _jsonlike(v) for k, v in x.items())
    if isinstance(x, list | tuple):
        return all(_jsonlike(v) for v in x)
    return x is None or isinstance(x, str | int | float | bool)


@dataclass(frozen=True)
class EvalSpec:
    """One evaluator run on every trial; its options are checked by the evaluator itself."""

    name: str = rule(lambda v: isinstance(v, str) and (v in EVALUATORS or ":" in v),
                     f"must be one of {', '.join(EVALUATORS)}, or file.py:OBJECT naming an Evaluator")
    options: Mapping[str, object] = field(default_factory=dict, hash=False, metadata={"rule": (
        lambda v: isinstance(v, Mapping) and _jsonlike(v), "must be a mapping of names to plain values")})
    timeout: float = rule(lambda v: _is_num(v) and v > 0, "must be a number of seconds > 0", registry.DEFAULT_TIMEOUT)

    def __post_init__(self) -> None:
        check_fields(self)
        try:
            registry.validate(self.name, self.options)
        except ConfigError as e:  # the evaluator owns its options; strip its "evaluators: " prefix
            raise ConfigError(str(e).removeprefix("evaluators: ")) from None


@dataclass(frozen=True)
class StudySpec:
    """A whole study: what to train, what to search, how to judge and when to stop."""

    name: str = rule(lambda v: bool(_NAME.fullmatch(v)), "must be letters, digits, '.', '_' or '-'")
    model: ModelSpec
    data: DataSpec
    search: SearchSpace
    budget: Budget
    train: TrainSpec = field(default_factory=TrainSpec)
    objectives: tuple[Objective, ...] = (Objective(*registry.DEFAULT_METRIC),)
    constraints: tuple[Constraint, ...] = ()
    sampler: SamplerSpec = field(default_factory=SamplerSpec)
    pruning: PruningSpec = field(default_factory=PruningSpec)
    pack: PackSpec = field(default_factory=PackSpec)
    evaluators: tuple[EvalSpec, ...] = (EvalSpec(registry.DEFAULT.name),)
    output: Path | None = None
    storage: str | None = rule(lambda v: v is None or re.match(r"[a-z][a-z0-9+]*://", v) is not None
                               or v.endswith(".log"), "must be an RDB URL such as sqlite:///study.db or a journal "
                               "file path ending in .log", None)
    artifacts: Path | None = None
    seed: int = rule(whole(0), "must be an int >= 0", 0)
    baseline: Mapping[str, Any] = field(default_factory=dict, hash=False)
    trackers: tuple[TrackerSpec, ...] = ()
    description: str = ""
    source: Path | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        check_fields(self)
        _check(len(self.objectives) > 0, "objectives", "must not be empty", self.objectives)
        names = [e.name for e in self.evaluators]
        unique = {"objectives.{}.metric": ([o.metric for o in self.objectives], "is already an objective"),
                  "evaluators.{}.name": (names, "is listed twice"),
                  "trackers.{}.name": ([t.name for t in self.trackers], "is listed twice")}
        for key, (values, text) in unique.items():
            for i, v in enumerate(values):
                _check(values.index(v) == i, key.format(i), text, v)
        entries = [(e.name, e.options) for e in self.evaluators]
        metrics = [(f"objectives.{i}.metric", o.metric) for i, o in enumerate(self.objectives)]
        metrics += [(f"constraints.{i}.metric", c.metric) for i, c in enumerate(self.constraints)]
        if self.pruning.kind == "cohort_sha" and self.pruning.proxy is not None:
            metrics.append(("pruning.proxy", self.pruning.proxy))
        for key, metric in metrics:
            try:
                registry.metric_direction(metric, entries)
            except ConfigError as e:  # "metric: rule": the evaluators' word for the key is ours here
                raise ConfigError(f"{key}: {str(e).removeprefix('metric: ')}") from None
        searched = {p.name for p in self.search.params}
        clash = [p.name for p in self.search.params if p.name in NOT_IN_BACKWARD]  # in file order: the first is named
        if self.train.optimizer_in_backward and clash:
            raise ConfigError(f"train.optimizer_in_backward: cannot be used with a searched {clash[0]} (it needs "
                              f"train.{clash[0]}: {NOT_IN_BACKWARD[clash[0]][0]}, fixed)")
        self._check_whole_base(variant_specs(lambda n: self.setting_values(n, ranged=True), searched,
                                             self.train.adapter_values()), searched)
        if self.data.eval is None and self.train.eval_every is not None:
            raise ConfigError("data.eval: is needed by train.eval_every")
        needs_eval = registry.needing_eval_data(names)
        if self.data.eval is None and needs_eval:
            raise ConfigError(f"data.eval: is needed by {', '.join(needs_eval)}")
        if self.sampler.name == "grid":
            try:
                self.search.grid()
            except ConfigError as e:
                raise ConfigError(f"search.{e}") from None
        if (self.pruning.kind == "cohort_sha" and "max_steps" not in searched
                and self.train.epochs is None):
            last = self.pruning.rungs[-1]
            _check(
                last < self.train.max_steps,
                "pruning.rungs",
                f"must be < train.max_steps ({self.train.max_steps})",
                last,
            )

    def _check_whole_base(self, specs: list[AdapterSpec], searched: set[str]) -> None:
        """Refuse a variant that needs the whole float base weight (``Variant.whole_base``: PiSSA's decomposition,
        DoRA's norms) of any adapter the study can propose (``specs``) over a base that no process holds whole and
        in float: an NF4 base, an FSDP shard. ``searched``: the searched settings' names (the key an error names)."""
        part = "model.quantize: nf4" if self.model.quantize else "pack.shard: fsdp" if self.pack.shard != "none" \
            else None
        needs = [(spec, v) for spec in specs for v in variants.of(spec) if v.whole_base] if part else []
        if needs:
            spec, v = needs[0]
            value = getattr(spec, v.fields[0])
            section = "search" if v.fields[0] in searched else "train"
            raise ConfigError(f"{section}.{v.fields[0]}: {value if isinstance(value, str) else v.name} "
                              f"{v.whole_base}, which {part} does not keep on one process")

    def setting_values(self, name: str, ranged: bool = False) -> set[Any]:
        """The values train setting ``name`` takes over the study: its choices or range ends (``ranged``) if searched,
        else the fixed value."""
        p = next((p for p in self.search.params if p.name == name), None)
        if p is None:
            return {getattr(self.train, name)}
        return set(p.choices) if p.kind == "categorical" else {p.low, p.high} if ranged else set()

    @property
    def directions(self) -> list[str]:
        """Objective directions, for ``optuna.create_study(directions=...)``."""
        return [o.direction for o in self.objectives]

    @property
    def out_dir(self) -> Path:
        """``output``, or ``runs/<name>``."""
        return self.output if self.output is not None else Path("runs") / self.name

    def prune_metric(self) -> tuple[str, str]:
        """(metric, direction) ranked at pruning rungs: ``pruning.proxy``, the single objective, or the default
        evaluator's metric (``evaluators.registry.DEFAULT_METRIC``: eval_loss)."""
        by_metric = {o.metric: o.direction for o in self.objectives}
        if self.pruning.proxy is not None:
            return self.pruning.proxy, by_metric.get(self.pruning.proxy, self.pruning.proxy_direction)
        if len(self.objectives) == 1:
            return self.objectives[0].metric, self.objectives[0].direction
        return registry.DEFAULT_METRIC

