"""What every tracker is given: the ``Tracker`` protocol, the points of a trial's curve, and the flat params.

A tracker is one object per study run (``sweep run`` or ``api.run``), called from ``sweep.trackers.sync``'s
process only, in this order: ``find`` once (what it holds of the study already, read back by the ids it set
itself), ``study_started`` once there is a trial to log, then per trial ``trial_started``, ``log`` any number of
times with points in increasing step order, ``trial_finished`` once; ``study_finished`` when the budget ended
the run, and ``close`` always. Run ids come back from ``find``, ``study_started`` and ``trial_started`` and are
handed to the same calls of a resumed run, which reopens those runs instead of creating new ones.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from lora_sweep.store.api import TrialRecord

__all__ = ["Held", "Point", "Tracker", "StudyInfo", "flat_params", "trial_tags", "run_name", "study_uid"]


@dataclass(frozen=True)
class Point:
    """The values a trial logged at one of its own optimizer steps: ``train/loss``, ``train/lr``,
    ``train/grad_norm``, ``train/tokens``, and the intermediate metrics scored there (``rung/<metric>`` at a
    pruning rung, ``eval/<metric>`` every ``train.eval_every`` steps)."""

    step: int
    values: Mapping[str, float]


@dataclass(frozen=True)
class Held:
    """A trial's run as its tracker reads it back (``Tracker.find``)."""

    run: str
    ended: bool
    """Its end (state, reason, final metrics) was logged."""


def study_uid(name: str, created: Any) -> str:
    """The study's own id, from its name and the time its results.db was made (results.db meta ``created``): the
    same for every run of the study, another for a study made again under the same name or directory."""
    return hashlib.sha256(f"{name}\n{created}".encode()).hexdigest()[:16]


@dataclass(frozen=True)
class StudyInfo:
    """The study as the parent run shows it."""

    name: str
    root: Path
    """The study directory (the trackers' default folders are inside it)."""
    spec: Mapping[str, Any]
    """The resolved spec (results.db meta ``spec``)."""
    tags: Mapping[str, str]
    """``lora_sweep.study``, ``lora_sweep.objectives``, ``lora_sweep.model``, ``lora_sweep.version``."""
    uid: str = ""
    """``study_uid``: what a tracker finds its runs by (an MLflow tag, W&B's run ids)."""


class Tracker(Protocol):
    """One experiment tracker's view of a study (``sweep.trackers._mlflow``, ``_wandb``, ``_tensorboard``)."""

    name: str
    remote: bool
    """It talks to a server (its calls are given at most ``_guards.CALL_S`` each)."""

    def find(self, study: StudyInfo, parent: str | None,
             runs: Mapping[int, str]) -> tuple[str | None, dict[int, Held]] | None:
        """Read back, by the ids this tracker sets itself, the study's parent run and its trials' runs (``parent``,
        ``runs``: the ids trackers.json names, if any, which runs of earlier versions may need); writes nothing.
        Returns (the parent's id or None, trial number -> its run), or None when it cannot read them back (W&B
        online: trackers.json's ids are then kept)."""
        ...

    def study_started(self, study: StudyInfo, run_id: str | None) -> str:
        """Create the study's parent run, or reopen ``run_id``; returns its id."""
        ...

    def trial_started(self, trial: TrialRecord, run_id: str | None, logged: int) -> tuple[str, int]:
        """Create trial ``trial.number``'s child run with its params and tags, or reopen ``run_id`` whose points
        up to step ``logged`` were logged; returns (its id, the last step it holds: ``logged``, or what the
        tracker itself reads back)."""
        ...

    def log(self, number: int, points: list[Point]) -> None:
        """Log ``points`` (increasing steps, each after every step logged before) to the trial's run."""
        ...

    def trial_finished(self, trial: TrialRecord, final: Mapping[str, float]) -> None:
        """End the trial's run: its state (COMPLETE, PRUNED, FAIL) and reason, device seconds, steps, tokens and
        the ``final`` metrics."""
        ...

    def study_finished(self, report: Path | None, pareto: list[dict[str, Any]]) -> None:
        """Attach the HTML report and the Pareto table (one row per trial on the front) to the parent run."""
        ...

    def close(self, finished: bool) -> None:
        """Close every run still open (``finished``: the study's budget ended the run)."""
        ...


def flat_params(params: Mapping[str, Any] | None) -> dict[str, str]:
    """A trial's (or the spec's) parameters as flat ``a.b: text`` pairs, as trackers store params (strings)."""
    out: dict[str, str] = {}

    def walk(value: Any, key: str) -> None:
        if isinstance(value, Mapping) and value:
            for k, v in value.items():
                walk(v, f"{key}.{k}" if key else str(k))
        else:
            out[key] = value if isinstance(value, str) else json.dumps(value, default=str)

    walk(params or {}, "")
    return out


def trial_tags(trial: TrialRecord) -> dict[str, str]:
    """``lora_sweep.trial``, and ``lora_sweep.role`` (``default``, ``config baseline``) when it is one."""
    tags = {"lora_sweep.trial": str(trial.number)}
    if trial.role:
        tags["lora_sweep.role"] = trial.role.strip(" ()")
    return tags


def run_name(trial: TrialRecord) -> str:
    """``trial 3``, and the role of the community default (``trial 0 (default)``)."""
    return f"trial {trial.number}{trial.role}"
