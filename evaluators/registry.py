"""The evaluators a study can name, and the calls that check and run its ``evaluators: [{name, options}]`` entries.

``EVALUATORS`` lists the built-in ``Evaluator`` objects (``evaluators._core.Evaluator``: name, options dataclass,
the metrics it reports with their directions, the call that scores a set of slots); a new built-in evaluator is
one more object in the list. A study names a user's own evaluator object as ``path/to/file.py:OBJECT`` or
``package.module:OBJECT`` (``find``; docs/guides/extending.md). Besides what the evaluators report, every trial
has the cost metrics of ``evaluators.cost`` (``adapter_params``, ``train_tokens``, ``device_seconds``,
``peak_memory_mb``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from lora_sweep.errors import ConfigError
from lora_sweep.evaluators._core import (
    MC_FORMAT,
    EvalData,
    EvalResult,
    Evaluator,
    Score,
    SlotEvalError,
    load_eval_data,
)
from lora_sweep.evaluators.choice import MULTIPLE_CHOICE
from lora_sweep.evaluators.cost import COST_METRICS
from lora_sweep.evaluators.custom import CUSTOM, load_object
from lora_sweep.evaluators.generation import GENERATION
from lora_sweep.evaluators.heldout_loss import HELDOUT_LOSS
from lora_sweep.evaluators.lm_eval import LM_EVAL
from lora_sweep.packer.api import PackedModel

__all__ = ["Evaluator", "Score", "EVALUATORS", "MC_FORMAT", "EvalData", "EvalResult", "SlotEvalError",
           "load_eval_data", "find", "validate", "metrics_of", "metric_direction", "evaluate"]

EVALUATORS: list[Evaluator] = [HELDOUT_LOSS, GENERATION, MULTIPLE_CHOICE, LM_EVAL, CUSTOM]
"""The built-in evaluators, in the order the study-file reference lists them."""

Entry = tuple[str, Mapping[str, Any] | None]
"""One ``evaluators:`` entry of a study: ``(name, options)``."""


def find(name: str) -> Evaluator:
    """The evaluator a study names: a built-in's name, or ``file.py:OBJECT`` / ``module:OBJECT`` (an ``Evaluator``).

    Raises:
        ConfigError: unknown name, a module that cannot be imported, or an object that is not an ``Evaluator``
            (one line).
    """
    for evaluator in EVALUATORS:
        if evaluator.name == name:
            return evaluator
    if ":" not in name:
        raise ConfigError(f"evaluators: unknown evaluator {name!r} (expected one of: "
                          f"{', '.join(e.name for e in EVALUATORS)}, or file.py:OBJECT naming an Evaluator)")
    try:
        obj = load_object(name)
    except ConfigError as err:
        raise ConfigError(f"evaluators: name: {name}: {str(err).removeprefix('function: ')}") from None
    if not isinstance(obj, Evaluator):
        raise ConfigError(f"evaluators: name: {name} is a {type(obj).__name__}, not an "
                          "lora_sweep.evaluators.registry.Evaluator")
    return obj


def validate(name: str, options: Mapping[str, Any] | None = None) -> Any:
    """Check one ``evaluators:`` entry of a study file; returns its options object.

    Raises:
        ConfigError: unknown evaluator, unknown option or metric name, a missing task file or data file,
            a custom function that cannot be imported (one line).
    """
    return find(name).load(options)


def metrics_of(name: str, options: Mapping[str, Any] | None = None) -> dict[str, str]:
    """Metric name -> direction that an evaluator entry reports (names known only when it runs: ``{}``)."""
    evaluator = find(name)
    return dict(evaluator.metrics(evaluator.load(options)))


def metric_direction(metric: str, entries: Iterable[Entry]) -> str:
    """Direction of an objective's metric, given the study's evaluator entries ``(name, options)``.

    Known: the cost metrics, what each entry's evaluator reports (``Evaluator.direction``).

    Raises:
        ConfigError: no configured evaluator reports ``metric``.
    """
    if metric in COST_METRICS:
        return COST_METRICS[metric]
    reported = list(COST_METRICS)
    for name, options in entries:
        evaluator = find(name)
        opts = evaluator.load(options)
        direction = evaluator.direction(metric, opts)
        if direction is not None:
            return direction
        reported += [*evaluator.metrics(opts), *(f"{p}<metric>" for p in evaluator.families(opts))]
    raise ConfigError(f"metric: unknown metric {metric!r} (reported: {', '.join(sorted(reported))})")


def evaluate(model: PackedModel, slots: Sequence[int], data: EvalData, entries: Iterable[Entry],
             timings: Callable[[str, float], None] | None = None) -> EvalResult:
    """Run several evaluator entries ``(name, options)`` on the same slots and merge their results.

    ``timings``: called with each entry's name and its wall seconds (the sweep's wall-time split).
    """
    result = EvalResult()
    for name, options in entries:
        evaluator = find(name)
        evaluator.load(options)
        t0 = time.perf_counter()
        result.merge(evaluator.score(model, slots, data, **dict(options or {})))
        if timings is not None:
            timings(name, time.perf_counter() - t0)
    return result
