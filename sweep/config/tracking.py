"""``trackers:``: the experiment trackers a study logs to (MLflow, Weights & Biases, TensorBoard), and how an
Axolotl config's ``wandb_*`` / ``mlflow_*`` keys and torchtune's ``metric_logger`` name them.

A tracker is one entry of the list: a bare name takes the defaults, a mapping names it and sets its options
(``{name: wandb, mode: online, project: p}``). The defaults keep everything in the study directory and offline;
what each tracker receives is ``sweep.trackers``' business. A tracker whose package is not installed is refused
here, at load, with the extra that installs it.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from lora_sweep.errors import ConfigError
from lora_sweep.sweep.config._params import _check
from lora_sweep.sweep.config.settings import table

__all__ = ["TrackerSpec", "TRACKERS", "axolotl_trackers", "torchtune_trackers"]

_ROWS: dict[str, dict[str, dict[str, str]]] = table("foreign.yaml")["trackers"]
OPTIONS = [(t, o, row.get("axolotl", ""), row.get("torchtune", "")) for t, rows in _ROWS.items()
           for o, row in rows.items()]
"""(tracker, option, Axolotl's key, torchtune's ``metric_logger`` arguments), one per row of ``foreign.yaml``'s
``trackers``."""
TRACKERS = {t: list(_ROWS[t]) for t in ("mlflow", "wandb", "tensorboard")}
"""Tracker name -> its options."""
WANDB_MODES = ("offline", "online", "disabled")


@dataclass(frozen=True)
class TrackerSpec:
    """One experiment tracker the study's trials are logged to."""

    name: str
    options: Mapping[str, Any] = field(default_factory=dict, hash=False)

    def __post_init__(self) -> None:
        _check(self.name in TRACKERS, "name", f"must be one of {', '.join(TRACKERS)}", self.name)
        _check(isinstance(self.options, Mapping), "options", "must be a mapping", self.options)
        known = TRACKERS[self.name]
        for key, value in self.options.items():
            _check(key in known, key, f"is not an option of {self.name} (its options: {', '.join(known)})", key)
            _check(isinstance(value, str) and value.strip() != "", key, "must be a non-empty string", value)
        if self.name == "wandb":
            mode = self.options.get("mode", "offline")
            _check(mode in WANDB_MODES, "mode", f"must be one of {', '.join(WANDB_MODES)}", mode)
            _check(mode != "online" or "project" in self.options, "mode",
                   "online needs a project (wandb_project in an Axolotl config)", mode)
        if importlib.util.find_spec(self.name) is None:
            raise ConfigError(f"name: {self.name} is not installed: pip install 'lora-sweep[{self.name}]' "
                              f"(got {self.name!r})")


def axolotl_trackers(data: Mapping[str, Any]) -> tuple[list[dict[str, Any]], list[str]]:
    """(``trackers:`` entries, the keys they used) of an Axolotl config: W&B when ``wandb_project`` or
    ``use_wandb`` is set (as Axolotl decides), MLflow when ``use_mlflow`` or ``mlflow_tracking_uri`` is set. A
    ``wandb_mode: disabled`` turns W&B off; the other ``wandb_*`` / ``mlflow_*`` keys are left to be named as
    ignored."""
    options: dict[str, dict[str, Any]] = {"wandb": {}, "mlflow": {}}
    used = []
    for tracker, option, key, _ in OPTIONS:
        if key and data.get(key) not in (None, ""):
            options[tracker][option] = str(data[key])
            used.append(key)
    on = {"wandb": bool(data.get("use_wandb")) or "project" in options["wandb"],
          "mlflow": bool(data.get("use_mlflow")) or "tracking_uri" in options["mlflow"]}
    used += [k for k in ("use_wandb", "use_mlflow") if k in data]
    if options["wandb"].get("mode") == "disabled":
        on["wandb"] = False
    return [{"name": t, **options[t]} for t in ("mlflow", "wandb") if on[t]], used


_TT_LOGGERS: dict[str, str] = table("foreign.yaml")["torchtune_loggers"]


def torchtune_trackers(value: Any) -> tuple[list[dict[str, Any]], list[str]]:
    """(``trackers:`` entries, the ``metric_logger`` keys ignored) of torchtune's ``metric_logger``: its W&B,
    MLflow and TensorBoard loggers map onto ours; the disk and stdout loggers log nothing here (the study's
    results.db holds what they would)."""
    if not isinstance(value, Mapping):
        return [], ["metric_logger"]
    component = str(value.get("_component_", "")).rsplit(".", 1)[-1]
    name = _TT_LOGGERS.get(component)
    if name is None:
        return [], ["metric_logger"]
    entry: dict[str, Any] = {"name": name}
    ours = {tt: option for tracker, option, _, names in OPTIONS if tracker == name for tt in names.split()}
    ignored = []  # W&B's log_dir and MLflow's run_id say where torchtune's own run went
    for key, v in value.items():
        if key == "_component_" or v in (None, ""):
            continue
        if key in ours:
            entry[ours[key]] = str(v)
        else:
            ignored.append(f"metric_logger.{key}")
    return [entry], ignored
