"""A user's own metric: ``module:function`` or ``path/to/file.py:function`` scoring each slot's generations.

Every slot answers every held-out prompt (``evaluators.generation``, the training prompts, greedy); then

- ``per_item: true`` (default): ``function(generation: str, row: dict) -> float`` is called per item and
  the metric is the mean (per-item values are kept for paired statistics);
- ``per_item: false``: ``function(generations: list[str], rows: list[dict]) -> float`` scores the whole set.

When the function raises or returns something that is not a finite number, that slot gets a
``SlotEvalError`` with the reason in ``EvalResult.errors`` (its trial fails); the other slots are scored.

A study file naming ``file.py:function`` (here, or ``file.py:OBJECT`` as an evaluator) runs that file's code, as a
Python config would. It is imported once per process (``load_object`` keeps the module), when the study is
loaded for a run; inside ``deferred_user_code()`` (``sweep plan``) it is not imported at all, only looked for.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import re
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lora_sweep.errors import ConfigError
from lora_sweep.evaluators._core import EvalData, EvalResult, Evaluator, SlotEvalError, finite, make_options
from lora_sweep.evaluators.generation import GenerationOptions, build_prompts, generate_texts, generation_cost

if TYPE_CHECKING:
    from lora_sweep.packer.api import PackedModel

__all__ = ["CustomOptions", "custom", "CUSTOM", "load_object", "load_function", "load_option_function",
           "deferred_user_code", "user_code_deferred", "is_file_target"]

_DEFERRED: ContextVar[bool] = ContextVar("lora_sweep_user_code_deferred", default=False)


@contextmanager
def deferred_user_code() -> Iterator[None]:
    """Inside the block, a study's user code (``file.py:OBJECT`` evaluators, ``custom``'s ``function``) is not
    imported: a file it names must exist, and what only importing it can check (the object, its options and
    metrics) is left to the run. ``sweep plan`` loads its study this way."""
    token = _DEFERRED.set(True)
    try:
        yield
    finally:
        _DEFERRED.reset(token)


def user_code_deferred() -> bool:
    """Whether the caller is inside ``deferred_user_code()``."""
    return _DEFERRED.get()


def is_file_target(target: str) -> bool:
    """Whether the ``target`` of ``target:name`` is a file path (else an importable module name)."""
    return target.endswith(".py") or "/" in target or "\\" in target

_METRIC_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


@dataclass(frozen=True)
class CustomOptions:
    """Options of the ``custom`` evaluator."""

    function: str
    """``package.module:function`` (importable) or ``path/to/file.py:function`` (a relative path: from the study
    file's folder); the function runs in the sweep's process (docs/guides/extending.md)."""
    metric: str | None = None
    """Name of the reported metric; default: the function's name."""
    direction: str = "maximize"
    """``maximize`` or ``minimize``: how an objective on this metric is optimised."""
    per_item: bool = True
    """Call the function per item (mean reported) or once with all generations."""
    max_new_tokens: int = 32
    """Generation length, as in ``GenerationOptions``."""
    batch_size: int = 8
    """Prompts per slot in one batch."""
    stop: tuple[str, ...] = ()
    """Stop strings, as in ``GenerationOptions``."""

    def __post_init__(self) -> None:
        if not (isinstance(self.function, str) and re.fullmatch(r".+:[A-Za-z_][A-Za-z0-9_]*", self.function)):
            raise ConfigError(f"function: must read 'module:function' or 'file.py:function' (got {self.function!r})")
        if self.metric is not None and not (isinstance(self.metric, str) and _METRIC_NAME.fullmatch(self.metric)):
            raise ConfigError(f"metric: must be a metric name (got {self.metric!r})")
        if self.direction not in ("maximize", "minimize"):
            raise ConfigError(f"direction: must be maximize or minimize (got {self.direction!r})")
        if not isinstance(self.per_item, bool):
            raise ConfigError(f"per_item: must be true or false (got {self.per_item!r})")
        gen = GenerationOptions(max_new_tokens=self.max_new_tokens, batch_size=self.batch_size, stop=self.stop)
        object.__setattr__(self, "stop", gen.stop)

    @property
    def metric_name(self) -> str:
        """The reported metric name."""
        return self.metric or self.function.rpartition(":")[2]


def load_object(spec: str, kind: str = "") -> Any:
    """Import ``module:name`` or ``file.py:name`` and return that attribute (``kind`` names it in errors).

    Raises:
        ConfigError: the module or file cannot be imported, or has no such attribute (one line).
    """
    target, _, name = spec.rpartition(":")
    if user_code_deferred():
        raise AssertionError("load_object inside deferred_user_code(): check_target instead")
    try:
        if is_file_target(target):
            module = _import_file(Path(target))
        else:
            module = importlib.import_module(target)
    except ConfigError:
        raise
    except Exception as err:  # a user module can fail to import in any way; report it in one line
        raise ConfigError(f"function: cannot import {target!r}: {type(err).__name__}: {err}") from None
    obj = getattr(module, name, None)
    if obj is None:
        raise ConfigError(f"function: {target!r} has no {kind}{name!r}")
    return obj


def load_function(spec: str) -> Callable[..., Any]:
    """Import ``module:function`` or ``file.py:function`` (``load_object``, which must give a callable).

    Raises:
        ConfigError: the module or file cannot be imported, or has no such callable (one line).
    """
    fn = load_object(spec, "callable ")
    if not callable(fn):
        target, _, name = spec.rpartition(":")
        raise ConfigError(f"function: {target!r} has no callable {name!r}")
    return fn


def load_option_function(opts: CustomOptions) -> Callable[..., Any]:
    """``load_function(opts.function)`` with errors naming ``custom.options.function``."""
    try:
        return load_function(opts.function)
    except ConfigError as err:
        raise ConfigError(f"custom.options.{err}") from None


def check_target(spec: str) -> None:
    """What can be checked of ``file.py:name`` / ``module:name`` without running it: a file that exists.

    Raises:
        ConfigError: a file path that names no file (one line).
    """
    target = spec.rpartition(":")[0]
    if not is_file_target(target):
        return
    try:
        path = Path(target).expanduser().resolve()
        found = path.is_file()
    except (RuntimeError, ValueError, OSError) as err:  # ~user of no such user, a NUL byte, a name too long
        raise ConfigError(f"function: not a usable file path ({err}; got {target!r})") from None
    if not found:
        raise ConfigError(f"function: file not found: {path}")


def _check_option_function(opts: CustomOptions) -> None:
    """``CUSTOM``'s load-time check: the function imports (only its file is looked for in ``deferred_user_code``)."""
    if user_code_deferred():
        try:
            check_target(opts.function)
        except ConfigError as err:
            raise ConfigError(f"custom.options.{err}") from None
        return
    load_option_function(opts)


def _import_file(path: Path) -> Any:
    """The module of ``path``, executed once per process: a study names the file in its evaluators, objectives and
    rung evaluations, and a file that loads a judge model when imported must pay for it once."""
    path = path.expanduser().resolve()
    if not path.is_file():
        raise ConfigError(f"function: file not found: {path}")
    # A name per file, so two studies' metrics.py never shadow each other in sys.modules.
    mod_name = f"_lora_sweep_metric_{hashlib.sha1(str(path).encode()).hexdigest()[:12]}"
    if mod_name in sys.modules:
        return sys.modules[mod_name]
    spec = importlib.util.spec_from_file_location(mod_name, path)
    if spec is None or spec.loader is None:
        raise ConfigError(f"function: cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[mod_name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(mod_name, None)
        raise
    return module


def custom(model: PackedModel, slots: Sequence[int], data: EvalData, **options: Any) -> EvalResult:
    """Generate with every slot and score the generations with the user's function.

    Args:
        model: the packed model holding the slots.
        slots: slots to score.
        data: rows with a prompt and a response (alpaca, prompt_completion, chat).
        **options: ``CustomOptions`` fields.

    Returns:
        The metric per slot; slots whose scoring failed are in ``errors`` instead.

    Raises:
        ConfigError: invalid options or a function that cannot be imported (every slot is affected).
    """
    opts: CustomOptions = make_options(CustomOptions, options, "custom")
    fn = load_option_function(opts)
    texts = generate_texts(model, slots, build_prompts(data), data.tokenizer, max_new_tokens=opts.max_new_tokens,
                           stop=opts.stop, batch_size=opts.batch_size)
    result = EvalResult()
    for slot in slots:
        try:
            value, items = _score(fn, texts[slot], data.rows, opts)
        except Exception as err:  # the user's code failed: this trial fails, the others go on
            result.errors[slot] = SlotEvalError(slot, f"custom metric {opts.function}: {type(err).__name__}: {err}")
            continue
        result.metrics[slot] = {opts.metric_name: value}
        if items is not None:
            result.per_item[slot] = {opts.metric_name: items}
        result.samples[slot] = [{"generation": t} for t in texts[slot]]
    return result


CUSTOM = Evaluator("custom", CustomOptions, custom, metrics=lambda opts: {opts.metric_name: opts.direction},
                   reports="its `metric` option (default: the function's name)",
                   check=_check_option_function,
                   cost=lambda opts: generation_cost(opts.max_new_tokens, opts.batch_size, "custom's generation"))
"""The ``custom`` evaluator: a user's metric function over each slot's generations."""


def _score(fn: Callable[..., Any], texts: list[str], rows: list[dict[str, Any]],
           opts: CustomOptions) -> tuple[float, list[float] | None]:
    if not opts.per_item:
        return finite(fn(list(texts), list(rows)), f"{opts.function} result"), None
    items = [finite(fn(text, row), f"{opts.function} result of item {i}")
             for i, (text, row) in enumerate(zip(texts, rows, strict=True))]
    return sum(items) / len(items), items
