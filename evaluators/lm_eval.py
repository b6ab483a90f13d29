"""lm-evaluation-harness tasks on any slot, offline, without reloading the base model.

The only module that imports ``lm_eval`` (the optional extra ``lora-sweep[eval]``). A ``SlotView`` is an
``nn.Module`` (``evaluators.slot_view``) whose ``forward`` and ``generate`` run the shared base model with every
row routed to one slot's adapter; it is handed to lm-eval's ``HFLM`` as an already-built model (the pattern of
torchtune's ``recipes/eleuther_eval.py``), one ``simple_evaluate`` per slot with one ``TaskManager``.

Offline, as lm-eval runs without a hub: ``HF_HUB_OFFLINE``, ``HF_DATASETS_OFFLINE`` and ``HF_HOME``
(``<work_dir>/hf_home``) are set before ``datasets`` / ``lm_eval`` are imported (and ``datasets.config`` is
updated if ``datasets`` was imported earlier); ``TaskManager(include_defaults=False)`` unless asked;
``bootstrap_iters=0``; ``log_samples=True`` for per-item results. Task data files must be absolute paths:
lm-eval resolves ``data_files`` against the working directory, not the YAML's folder.

Metric names are ``<task>.<metric>`` (``tiny_mc.acc``), with ``.<filter>`` appended when the filter is not
``none`` (``gsm8k.exact_match.strict-match``).
"""

from __future__ import annotations

import os
import random
import re
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lora_sweep.errors import ConfigError, UserError
from lora_sweep.evaluators._core import EvalData, EvalResult, Evaluator, make_options

if TYPE_CHECKING:  # torch and the model are imported where an evaluation runs: a study file is checked without them
    from lora_sweep.packer.api import PackedModel

__all__ = ["LmEvalOptions", "run_lm_eval", "LM_EVAL", "task_names", "metric_direction", "INSTALL_HINT"]

INSTALL_HINT = "the lm_eval evaluator needs lm-eval: pip install 'lora-sweep[eval]'"
_LOWER_IS_BETTER = {"perplexity", "word_perplexity", "byte_perplexity", "bits_per_byte"}


@dataclass(frozen=True)
class LmEvalOptions:
    """Options of the ``lm_eval`` evaluator."""

    tasks: tuple[str, ...]
    """Task names (found under ``include_path``) or task YAML files."""
    include_path: tuple[str, ...] = ()
    """Folders of task YAMLs; a task file's own folder is added."""
    include_defaults: bool = False
    """Also index lm-eval's ~14k built-in tasks (7 s; their data must be in ``<work_dir>/hf_home``)."""
    batch_size: int = 8
    """HFLM batch size."""
    max_length: int | None = None
    """Context length HFLM truncates to; default: the model config's."""
    limit: int | None = None
    """Items per task (lm-eval ``limit``); default all."""
    num_fewshot: int | None = None
    """Few-shot examples; default the task's."""

    def __post_init__(self) -> None:
        tasks = (self.tasks,) if isinstance(self.tasks, str) else self.tasks
        if not (isinstance(tasks, list | tuple) and tasks and all(isinstance(t, str) and t for t in tasks)):
            raise ConfigError(f"tasks: must be a non-empty list of task names or YAML files (got {self.tasks!r})")
        inc = (self.include_path,) if isinstance(self.include_path, str) else tuple(self.include_path or ())
        object.__setattr__(self, "tasks", tuple(_resolve_task(t) for t in tasks))
        object.__setattr__(self, "include_path", tuple(str(Path(p).expanduser().resolve()) for p in inc))
        for p in self.include_path:
            if not Path(p).is_dir():
                raise ConfigError(f"include_path: folder not found: {p}")
        for key in ("batch_size", "max_length", "limit", "num_fewshot"):
            value = getattr(self, key)
            if value is not None and not (isinstance(value, int) and value >= (0 if key == "num_fewshot" else 1)):
                raise ConfigError(f"{key}: must be a positive integer (got {value!r})")
        if not self.include_defaults:
            _check_task_names(self.tasks, self.include_path)

    @property
    def paths(self) -> list[str]:
        """Folders the TaskManager indexes: ``include_path`` plus each task file's folder."""
        folders = list(self.include_path)
        for t in self.tasks:
            if _is_file_task(t) and str(Path(t).parent) not in folders:
                folders.append(str(Path(t).parent))
        return folders


def _is_file_task(task: str) -> bool:
    return task.endswith((".yaml", ".yml"))


def _resolve_task(task: str) -> str:
    if not _is_file_task(task):
        return task
    path = Path(task).expanduser().resolve()
    if not path.is_file():
        raise ConfigError(f"tasks: task file not found: {path}")
    _check_data_files(path)
    return str(path)


def _read_yaml(path: Path) -> Any:
    """A task YAML, with lm-eval's ``!function`` tags read as None (we only look at names and files)."""
    import yaml

    class Loader(yaml.SafeLoader):
        pass

    Loader.add_multi_constructor("!", lambda loader, suffix, node: None)
    try:
        return yaml.load(path.read_text(encoding="utf-8"), Loader=Loader)  # noqa: S506 - a SafeLoader subclass
    except (OSError, yaml.YAMLError) as err:
        raise ConfigError(f"tasks: cannot read {path}: {' '.join(str(err).split())}") from None


def _check_data_files(path: Path) -> None:
    cfg = _read_yaml(path)
    files = ((cfg or {}).get("dataset_kwargs") or {}).get("data_files") if isinstance(cfg, dict) else None
    values = files.values() if isinstance(files, dict) else [files]
    for value in values:
        for f in [value] if isinstance(value, str) else (value or []):
            if isinstance(f, str) and "://" not in f and not Path(f).expanduser().exists():
                raise ConfigError(f"tasks: {path}: data file not found: {f} (lm-eval resolves relative "
                                  "data_files against the working directory; write absolute paths)")


def _check_task_names(tasks: Sequence[str], include_path: Sequence[str]) -> None:
    names: set[str] = set()
    for folder in include_path:
        for f in sorted(Path(folder).glob("**/*.yaml")):
            cfg = _read_yaml(f)
            if isinstance(cfg, dict):
                for key in ("task", "group", "tag"):
                    value = cfg.get(key)
                    names.update([value] if isinstance(value, str) else value if isinstance(value, list) else [])
    for t in tasks:
        if not _is_file_task(t) and t not in names:
            known = ", ".join(sorted(n for n in names if isinstance(n, str))) or "none"
            raise ConfigError(f"tasks: unknown task {t!r} (tasks under include_path: {known}; "
                              "set include_defaults: true for lm-eval's built-in tasks)")


def task_names(opts: LmEvalOptions) -> list[str]:
    """The task (or group) names of ``opts.tasks``, a task file read for its ``task:`` key."""
    names = []
    for t in opts.tasks:
        cfg = _read_yaml(Path(t)) if _is_file_task(t) else None
        names.append(str(cfg.get("task") or cfg.get("group") or t) if isinstance(cfg, dict) else t)
    return names


def metric_direction(metric: str) -> str:
    """Direction of an lm-eval metric name ``<task>.<metric>[.<filter>]`` (perplexities go down)."""
    parts = metric.split(".")
    return "minimize" if len(parts) > 1 and parts[1] in _LOWER_IS_BETTER else "maximize"


def _offline_env(hf_home: Path) -> None:
    """Point datasets / the hub at ``hf_home`` and switch their network access off."""
    import sys

    hf_home.mkdir(parents=True, exist_ok=True)
    os.environ.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", HF_UPDATE_DOWNLOAD_COUNTS="0",
                      HF_HOME=str(hf_home), HF_DATASETS_CACHE=str(hf_home / "datasets"))
    config: Any = sys.modules.get("datasets.config")
    if config is not None:  # imported earlier: it read the environment then
        config.HF_HUB_OFFLINE = config.HF_DATASETS_OFFLINE = True
        config.HF_UPDATE_DOWNLOAD_COUNTS = False
        config.HF_DATASETS_CACHE = hf_home / "datasets"


def _import_lm_eval(hf_home: Path) -> Any:
    _offline_env(hf_home)
    try:
        import lm_eval
        from lm_eval.models.huggingface import HFLM  # noqa: F401 - fails here if its deps are missing
        from lm_eval.tasks import TaskManager  # noqa: F401
    except ImportError as err:
        raise UserError(f"{INSTALL_HINT} ({err})") from None
    return lm_eval


def run_lm_eval(model: PackedModel, slots: Sequence[int], data: EvalData, **options: Any) -> EvalResult:
    """Run lm-eval tasks on each slot through a ``SlotView``.

    Args:
        model: the packed model holding the slots.
        slots: slots to score.
        data: gives the tokenizer and ``work_dir`` (its rows are not used: the tasks bring their data).
        **options: ``LmEvalOptions`` fields.

    Returns:
        ``<task>.<metric>[.<filter>]`` per slot; per-item values from lm-eval's logged samples, in doc order;
        samples ``{task, doc_id, target, response, <metrics>}``.

    Raises:
        UserError: lm-eval is not installed (with the install hint).
        ConfigError: invalid options, a missing task file or an unknown task.
    """
    opts: LmEvalOptions = make_options(LmEvalOptions, options, "lm_eval")
    work = data.work_dir if data.work_dir is not None else Path(tempfile.gettempdir()) / "lora-sweep"
    lm_eval = _import_lm_eval(work / "hf_home")
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    from lora_sweep.evaluators.slot_view import SlotView

    manager = TaskManager(include_path=opts.paths or None, include_defaults=opts.include_defaults)
    result = EvalResult()
    for slot in slots:
        lm = HFLM(pretrained=SlotView(model, slot), tokenizer=data.tokenizer, batch_size=opts.batch_size,
                  max_length=opts.max_length, backend="causal")
        with _rng_kept():
            try:
                out = lm_eval.simple_evaluate(model=lm, tasks=list(opts.tasks), task_manager=manager,
                                              bootstrap_iters=0, log_samples=True, limit=opts.limit,
                                              num_fewshot=opts.num_fewshot, random_seed=0, numpy_random_seed=0,
                                              torch_random_seed=0, fewshot_random_seed=0)
            except KeyError as err:
                raise ConfigError(f"lm_eval.options.tasks: {err.args[0] if err.args else err}") from None
        _collect(out, slot, result)
    return result


def _task_families(opts: LmEvalOptions) -> dict[str, Any]:
    return {f"{task}.": metric_direction for task in task_names(opts)}


LM_EVAL = Evaluator("lm_eval", LmEvalOptions, run_lm_eval, metrics=lambda opts: {}, families=_task_families,
                    reports="`<task>.<metric>` (`.<filter>` appended unless the filter is `none`)")
"""The ``lm_eval`` evaluator: its metric names are known from its tasks when it runs."""


@contextmanager
def _rng_kept() -> Iterator[None]:
    """lm-eval seeds the global RNGs; give the caller (a training process) its own states back."""
    import numpy as np
    import torch

    py_state, np_state = random.getstate(), np.random.get_state()
    with torch.random.fork_rng(devices=[]):
        try:
            yield
        finally:
            random.setstate(py_state)
            np.random.set_state(np_state)


def _metric_name(task: str, key: str) -> str | None:
    """``acc,none`` of task t -> ``t.acc``; ``exact_match,strict-match`` -> ``t.exact_match.strict-match``."""
    metric, _, filt = key.partition(",")
    if not filt or metric.endswith("_stderr"):
        return None
    name = f"{task}.{metric}" if filt == "none" else f"{task}.{metric}.{filt}"
    return re.sub(r"[^A-Za-z0-9._-]", "_", name)


def _collect(out: dict[str, Any], slot: int, result: EvalResult) -> None:
    metrics: dict[str, float] = {}
    for task, values in out["results"].items():
        for key, value in values.items():
            name = _metric_name(task, key)
            if name is not None and isinstance(value, int | float) and not isinstance(value, bool):
                metrics[name] = float(value)
    per_item: dict[str, list[float]] = {}
    samples: list[dict[str, Any]] = []
    for task, logged in out.get("samples", {}).items():
        for s in sorted(logged, key=lambda s: (s.get("filter", "none"), s["doc_id"])):
            filt = s.get("filter", "none")
            scores = {m: float(s[m]) for m in s.get("metrics", []) if isinstance(s.get(m), int | float)}
            for m, v in scores.items():
                name = _metric_name(task, f"{m},{filt}")
                if name is not None:
                    per_item.setdefault(name, []).append(v)
            samples.append({"task": task, "doc_id": s["doc_id"], "filter": filt, "target": s.get("target"),
                            "response": s.get("filtered_resps"), **scores})
    result.metrics[slot] = metrics
    result.per_item[slot] = per_item
    result.samples[slot] = samples
