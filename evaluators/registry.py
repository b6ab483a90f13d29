"""Score every adapter slot of a pack: ``(model, slots, data, **options) -> EvalResult``.

``EVALUATORS`` maps the names a study file uses (``evaluators: [{name, options}]``) to the functions;
``validate(name, options)`` checks an entry at load time and ``metric_direction(metric, entries)`` checks an
objective's metric name against what the configured evaluators report. Metric names:

- ``heldout_loss``: ``eval_loss``, ``perplexity``;
- ``generation``: the chosen ``scorers`` (``exact_match``, ``contains``, ``numeric_match``);
- ``multiple_choice``: ``mc_acc``, ``mc_acc_norm``;
- ``lm_eval``: ``<task>.<metric>`` (``.<filter>`` appended unless the filter is ``none``);
- ``custom``: its ``metric`` option (default: the function's name);
- always (from the trainer's numbers, ``evaluators.cost``): ``adapter_params``, ``train_tokens``,
  ``device_seconds``, ``peak_memory_mb``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Protocol

from lora_sweep.errors import ConfigError
from lora_sweep.evaluators._core import MC_FORMAT, EvalData, EvalResult, SlotEvalError, load_eval_data, make_options
from lora_sweep.evaluators.choice import METRICS as _CHOICE_METRICS
from lora_sweep.evaluators.choice import ChoiceOptions, multiple_choice
from lora_sweep.evaluators.cost import COST_METRICS
from lora_sweep.evaluators.custom import CustomOptions, custom, load_option_function
from lora_sweep.evaluators.generation import METRICS as _GENERATION_METRICS
from lora_sweep.evaluators.generation import GenerationOptions, generation
from lora_sweep.evaluators.heldout_loss import METRICS as _HELDOUT_METRICS
from lora_sweep.evaluators.heldout_loss import HeldoutOptions, heldout_loss
from lora_sweep.evaluators.lm_eval import LmEvalOptions, run_lm_eval, task_names
from lora_sweep.evaluators.lm_eval import metric_direction as _lm_eval_direction
from lora_sweep.packer.api import PackedModel

__all__ = ["Evaluator", "EVALUATORS", "OPTIONS", "METRICS", "MC_FORMAT", "EvalData", "EvalResult", "SlotEvalError",
           "load_eval_data", "validate", "metrics_of", "metric_direction", "evaluate"]


class Evaluator(Protocol):
    """Scores slots of a packed model on the same items; returns ``EvalResult`` (``metrics[slot][name]``)."""

    def __call__(self, model: PackedModel, slots: Sequence[int], data: EvalData, **options: Any) -> EvalResult: ...


EVALUATORS: dict[str, Evaluator] = {
    "heldout_loss": heldout_loss,
    "generation": generation,
    "multiple_choice": multiple_choice,
    "lm_eval": run_lm_eval,
    "custom": custom,
}
"""Evaluator name (as in a study file) -> function."""

OPTIONS: dict[str, type] = {
    "heldout_loss": HeldoutOptions,
    "generation": GenerationOptions,
    "multiple_choice": ChoiceOptions,
    "lm_eval": LmEvalOptions,
    "custom": CustomOptions,
}
"""Evaluator name -> its options dataclass (field docstrings document the study-file options)."""

METRICS: dict[str, str] = {**_HELDOUT_METRICS, **_GENERATION_METRICS, **_CHOICE_METRICS, **COST_METRICS}
"""Fixed metric names -> ``minimize`` / ``maximize``. lm-eval and custom metric names depend on options."""


def validate(name: str, options: Mapping[str, Any] | None = None) -> Any:
    """Check one ``evaluators:`` entry of a study file; returns its options object.

    Raises:
        ConfigError: unknown evaluator, unknown option or metric name, a missing task file or data file,
            a custom function that cannot be imported (one line).
    """
    if name not in EVALUATORS:
        raise ConfigError(f"evaluators: unknown evaluator {name!r} (expected one of: {', '.join(EVALUATORS)})")
    opts = make_options(OPTIONS[name], dict(options or {}), name)
    if name == "custom":
        load_option_function(opts)
    return opts


def metrics_of(name: str, options: Mapping[str, Any] | None = None) -> dict[str, str]:
    """Metric name -> direction that an evaluator entry reports (lm-eval's depend on the tasks: ``{}``)."""
    opts = validate(name, options)
    if name == "heldout_loss":
        return dict(_HELDOUT_METRICS)
    if name == "generation":
        return {s: _GENERATION_METRICS[s] for s in opts.scorers}
    if name == "multiple_choice":
        return dict(_CHOICE_METRICS)
    if name == "custom":
        return {opts.metric_name: opts.direction}
    return {}


def metric_direction(metric: str, entries: Iterable[tuple[str, Mapping[str, Any] | None]]) -> str:
    """Direction of an objective's metric, given the study's evaluator entries ``(name, options)``.

    Known: the cost metrics, what ``metrics_of`` lists, and ``<task>.<...>`` for a task of an ``lm_eval`` entry.

    Raises:
        ConfigError: no configured evaluator reports ``metric``.
    """
    known = dict(COST_METRICS)
    tasks: list[str] = []
    for name, options in entries:
        known.update(metrics_of(name, options))
        if name == "lm_eval":
            tasks += task_names(validate(name, options))
    if metric in known:
        return known[metric]
    if any(metric.startswith(f"{t}.") for t in tasks):
        return _lm_eval_direction(metric)
    hint = f"; lm-eval metrics read <task>.<metric> for tasks {', '.join(tasks)}" if tasks else ""
    raise ConfigError(f"metric: unknown metric {metric!r} (reported: {', '.join(sorted(known))}{hint})")


def evaluate(model: PackedModel, slots: Sequence[int], data: EvalData,
             entries: Iterable[tuple[str, Mapping[str, Any] | None]],
             timings: Callable[[str, float], None] | None = None) -> EvalResult:
    """Run several evaluator entries ``(name, options)`` on the same slots and merge their results.

    ``timings``: called with each evaluator's name and its wall seconds (the sweep's wall-time split).
    """
    result = EvalResult()
    for name, options in entries:
        validate(name, options)
        t0 = time.perf_counter()
        result.merge(EVALUATORS[name](model, slots, data, **dict(options or {})))
        if timings is not None:
            timings(name, time.perf_counter() - t0)
    return result
