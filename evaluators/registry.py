"""The evaluators a study can name, and the calls that check and run its ``evaluators: [{name, options}]`` entries.

``EVALUATORS`` lists the built-in ``Evaluator`` objects (``evaluators._core.Evaluator``: name, options dataclass,
the metrics it reports with their directions, the call that scores a set of slots); a new built-in evaluator is
one more object in the list. A study names a user's own evaluator object as ``path/to/file.py:OBJECT`` or
``package.module:OBJECT`` (``find``; docs/guides/extending.md). Besides what the evaluators report, every trial
has the cost metrics of ``evaluators.cost`` (``adapter_params``, ``train_tokens``, ``device_seconds``,
``peak_memory_mb``).

User code (a ``file.py:OBJECT`` evaluator, or ``custom``'s function) is contained: it runs in a watchdog thread
(``evaluate``), and what it raises, returns wrongly (``check_result``) or the time it overruns
(``EvalSpec.timeout``, ``budget.wall_time``) fails the trials it was scoring with a one-line reason. A thread cannot
be killed, and the evaluator cannot move to another process (it reads the packed model's adapters in this process's
device memory): a hung one is abandoned (``abandoned``) and ``EvaluatorHung`` stops the run, because that thread may
still be using the model; the command line then leaves with ``os._exit`` once the run has written everything.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lora_sweep.errors import ConfigError, UserError
from lora_sweep.evaluators._core import (
    MC_FORMAT,
    EvalData,
    EvalResult,
    Evaluator,
    Score,
    SlotEvalError,
    check_result,
    load_eval_data,
    make_options,
)
from lora_sweep.evaluators.choice import MULTIPLE_CHOICE
from lora_sweep.evaluators.cost import COST_METRICS, EvalCost
from lora_sweep.evaluators.custom import CUSTOM, check_target, deferred_user_code, load_object, user_code_deferred
from lora_sweep.evaluators.generation import GENERATION
from lora_sweep.evaluators.heldout_loss import HELDOUT_LOSS
from lora_sweep.evaluators.lm_eval import LM_EVAL

if TYPE_CHECKING:  # torch and the model are imported where an evaluation runs: a study file is checked without them
    from lora_sweep.packer.api import PackedModel

__all__ = ["Evaluator", "Score", "EVALUATORS", "MC_FORMAT", "EvalData", "EvalCost", "EvalResult", "SlotEvalError",
           "load_eval_data", "find", "validate", "metrics_of", "metric_direction", "evaluate", "is_user_code",
           "user_code", "needing_eval_data", "plan_cost", "curve_entry", "DEFAULT", "DEFAULT_METRIC",
           "deferred_user_code", "Limits", "EvaluatorHung", "abandoned", "DEFAULT_TIMEOUT"]

DEFAULT_TIMEOUT = 600.0
"""Seconds a user's evaluator may take on one set of slots (``EvalSpec.timeout``'s default): generous for a
judge over a few hundred generations, short enough that a hung one costs minutes, not a night."""

EVALUATORS: list[Evaluator] = [HELDOUT_LOSS, GENERATION, MULTIPLE_CHOICE, LM_EVAL, CUSTOM]
"""The built-in evaluators, in the order the study-file reference lists them."""
DEFAULT = HELDOUT_LOSS
"""The evaluator a study runs when its file lists none (``StudySpec.evaluators``' default)."""
DEFAULT_METRIC: tuple[str, str] = (str(DEFAULT.curve), DEFAULT.metrics(DEFAULT.load())[str(DEFAULT.curve)])
"""(metric, direction) of a study that names no objective, and ranked at pruning rungs when several objectives and no
``pruning.proxy`` are set: the metric ``DEFAULT`` records as a curve (``eval_loss``, minimized)."""

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
    if user_code_deferred():
        return _unimported(name)
    try:
        obj = load_object(name)
    except ConfigError as err:
        raise ConfigError(f"evaluators: name: {name}: {str(err).removeprefix('function: ')}") from None
    if not isinstance(obj, Evaluator):
        raise ConfigError(f"evaluators: name: {name} is a {type(obj).__name__}, not an "
                          "lora_sweep.evaluators.registry.Evaluator")
    _FOUND[name] = obj
    return obj


_FOUND: dict[str, Evaluator] = {}
"""The users' evaluators ``find`` imported in this process, by the name a study gives them, the latest kept
(``plan_cost`` reads a declaration only from one imported already: it never runs a study's code itself)."""


def needing_eval_data(names: Iterable[str]) -> list[str]:
    """The evaluators among ``names`` that declare they score the study's held-out rows (``Evaluator.needs_eval_data``;
    a user's evaluator in ``deferred_user_code()`` is not imported, so not among them: the run checks it)."""
    return [name for name in names if find(name).needs_eval_data]


def plan_cost(name: str, options: Mapping[str, Any] | None = None) -> EvalCost | None:
    """What an entry declares one evaluation of a slot costs (``Evaluator.cost``), for ``sweep plan``; None: not timed.

    Runs none of the study's code: a user's evaluator is timed only once this process has imported it (``find``;
    ``sweep plan`` does not), and its options are read without the entry's ``check`` (``custom`` imports its function
    there).
    """
    evaluator = next((e for e in EVALUATORS if e.name == name), None) or _FOUND.get(name)
    if evaluator is None:
        return None
    return evaluator.cost(make_options(evaluator.options, dict(options or {}), evaluator.name))


def curve_entry(entries: Iterable[Entry]) -> tuple[Entry, str]:
    """The entry that scores ``train.eval_every``'s learning curve, and the curve's metric: the first entry whose
    evaluator serves one (``Evaluator.curve``), else the first built-in evaluator that does, with its default
    options (a study scored by generation alone still gets a held-out-loss curve)."""
    for name, options in entries:
        metric = find(name).curve
        if metric is not None:
            return (name, options), metric
    default = next(e for e in EVALUATORS if e.curve is not None)
    return (default.name, {}), default.curve  # type: ignore[return-value]


def is_user_code(name: str) -> bool:
    """Whether an ``evaluators:`` entry runs a user's code: ``file.py:OBJECT`` / ``module:OBJECT``, or ``custom``."""
    return name == CUSTOM.name or all(e.name != name for e in EVALUATORS)


def user_code(name: str, options: Mapping[str, Any] | None = None) -> str | None:
    """The user's code an ``evaluators:`` entry runs, as its study file names it (``custom``'s ``function``, else the
    entry's own ``file.py:OBJECT`` / ``module:OBJECT``); None for a built-in evaluator."""
    if not is_user_code(name):
        return None
    return str((options or {}).get("function", name)) if name == CUSTOM.name else name


def _unimported(name: str) -> Evaluator:
    """A user's evaluator inside ``deferred_user_code()``: its file looked for, not imported; any options and any
    metric name accepted (they are checked when the run imports it)."""
    try:
        check_target(name)
    except ConfigError as err:
        raise ConfigError(f"evaluators: name: {name}: {str(err).removeprefix('function: ')}") from None

    return _Unimported(name, dict, _not_run, metrics=lambda opts: {}, reports="(not imported)",
                       families=lambda opts: {"": lambda metric: "maximize"}, needs_eval_data=False)


def _not_run(model: PackedModel, slots: Sequence[int], data: EvalData, **options: Any) -> EvalResult:
    raise AssertionError("an evaluator loaded in deferred_user_code() cannot score")


@dataclass(frozen=True)
class _Unimported(Evaluator):
    """A user's evaluator that ``deferred_user_code()`` did not import."""

    def load(self, options: Mapping[str, Any] | None = None) -> Any:
        """Any options: only the evaluator itself can check them."""
        return dict(options or {})


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


@dataclass(frozen=True)
class Limits:
    """How long the user code among the entries may run (``evaluate``)."""

    timeouts: Mapping[str, float] = field(default_factory=dict)
    """Entry name -> seconds (``EvalSpec.timeout``); an entry not listed: ``DEFAULT_TIMEOUT``."""
    deadline: float | None = None
    """``time.monotonic()`` at which ``budget.wall_time`` is spent; None: no wall-time budget."""
    timeout_keys: Mapping[str, str] = field(default_factory=dict)
    """Entry name -> the key that set its timeout (``evaluators.0.timeout``), for the reason."""
    grace: float = 10.0
    """Seconds an evaluation may always have, even one that starts after ``deadline`` or just before it: the trials
    training when the wall-time budget ends run on to their end (``budget``), and are still scored."""


class EvaluatorHung(UserError):
    """A user's evaluator ran past its timeout or the wall-time budget; its thread is abandoned (``abandoned``).

    Attributes:
        result: the evaluation so far, every slot of the hung entry in ``errors`` with the reason.
    """

    def __init__(self, reason: str, result: EvalResult) -> None:
        super().__init__(reason)
        self.result = result


_ABANDONED: list[threading.Thread] = []


def abandoned() -> list[threading.Thread]:
    """The threads of hung evaluators this process left running (a process holding one should end with
    ``os._exit`` once its results are written: the interpreter's teardown would run beside that code)."""
    return [t for t in _ABANDONED if t.is_alive()]


def evaluate(model: PackedModel, slots: Sequence[int], data: EvalData, entries: Iterable[Entry],
             timings: Callable[[str, float], None] | None = None, limits: Limits | None = None) -> EvalResult:
    """Run several evaluator entries ``(name, options)`` on the same slots and merge their results.

    ``timings``: called with each entry's name and its wall seconds (the sweep's wall-time split). User code
    (``is_user_code``) runs under ``limits`` in a watchdog thread; what it raises or returns wrongly becomes each
    slot's error (``EvalResult.errors``) and the next entry runs.

    Raises:
        EvaluatorHung: a user's evaluator ran past its timeout or ``limits.deadline`` (the entries after it are not
            run; the exception holds the result so far).
    """
    result = EvalResult()
    for name, options in entries:
        evaluator = find(name)
        evaluator.load(options)
        t0 = time.perf_counter()
        if is_user_code(name):
            part = _contained(name, evaluator, model, slots, data, dict(options or {}), limits or Limits(), result)
        else:
            part = evaluator.score(model, slots, data, **dict(options or {}))
        result.merge(part)
        if timings is not None:
            timings(name, time.perf_counter() - t0)
    return result


def _contained(entry: str, evaluator: Evaluator, model: PackedModel, slots: Sequence[int], data: EvalData,
               options: dict[str, Any], limits: Limits, so_far: EvalResult) -> EvalResult:
    """One user evaluator in a watchdog thread: its result checked, or every slot failed with the reason.

    The thread runs with the caller's grad mode and CUDA stream (both are per thread in torch), so the evaluator sees
    the model as an evaluator in the main thread would; the caller waits, so the model is never used by two threads.
    """
    import torch

    target, _, obj = entry.rpartition(":")
    name = f"{Path(target).name}:{obj}" if target else entry  # the file's name: the study gives its whole path
    box: dict[str, Any] = {}
    grad = torch.is_grad_enabled()
    stream = torch.cuda.current_stream(model.device) if model.device.type == "cuda" else None

    def run() -> None:
        try:
            with torch.set_grad_enabled(grad), torch.cuda.stream(stream) if stream is not None else nullcontext():
                box["result"] = evaluator.score(model, slots, data, **options)
        except BaseException as err:  # the user's code may raise anything; its trials fail with it
            box["error"] = err

    thread = threading.Thread(target=run, name=f"evaluator {name}", daemon=True)
    timeout = limits.timeouts.get(entry, DEFAULT_TIMEOUT)
    wait = timeout if limits.deadline is None else min(timeout, max(limits.grace, limits.deadline - time.monotonic()))
    thread.start()
    try:
        thread.join(wait)
    finally:
        if thread.is_alive():  # past the limit, or a Ctrl-C / SIGTERM while waiting: it cannot be stopped
            _ABANDONED.append(thread)
    if thread.is_alive():
        if wait < timeout:
            why = f"budget.wall_time was reached while evaluator {name} ran ({wait:.0f} s)"
        else:
            why = f"evaluator {name} did not return within {timeout:g} s ({limits.timeout_keys.get(entry, 'timeout')})"
        failed = _failed(slots, why)
        raise EvaluatorHung(f"{why}; its trials failed and the run stops (the evaluator's thread cannot be stopped "
                            f"and may still use the model)", so_far.merge(failed))
    if "error" in box:
        err = box["error"]
        if isinstance(err, KeyboardInterrupt):  # a Ctrl-C or SIGTERM landed in its thread: the run's, not the trial's
            raise err
        return _failed(slots, f"evaluator {name} raised {type(err).__name__}: {err}")
    return check_result(box["result"], slots, f"evaluator {name}")


def _failed(slots: Sequence[int], reason: str) -> EvalResult:
    return EvalResult(errors={s: SlotEvalError(s, reason) for s in slots})
