"""TensorBoard: one run folder per trial (``trial-0003``) beside the study's (``study``), under
``<study dir>/tensorboard`` by default, written with ``torch.utils.tensorboard.SummaryWriter``.

A trial's folder holds its curve as scalars (``train/loss`` per optimizer step, ``rung/<metric>``,
``eval/<metric>``, ``final/<metric>``), its params and tags as text, its end (state, reason) as text and its
params against its final metrics in the HParams tab. A reopened run is written with ``purge_step`` one past what
it logged: TensorBoard drops whatever a killed run wrote after that, so no step shows twice.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from torch.utils.tensorboard import SummaryWriter
from torch.utils.tensorboard.summary import hparams

from lora_sweep.sweep.store import TrialRecord
from lora_sweep.sweep.trackers.base import Point, StudyInfo, flat_params, run_name, trial_tags

__all__ = ["TensorBoardTracker"]


def _table(values: Mapping[str, Any]) -> str:
    """A markdown table (TensorBoard's text dashboard renders markdown)."""
    return "| key | value |\n|---|---|\n" + "\n".join(f"| {k} | {v} |" for k, v in values.items())


class TensorBoardTracker:
    """The ``tensorboard`` tracker (``sweep.trackers.base.Tracker``)."""

    name = "tensorboard"

    def __init__(self, options: Mapping[str, Any], root: Path, study: str) -> None:
        self.dir = Path(options.get("log_dir") or root / "tensorboard")
        self.study: SummaryWriter | None = None
        self.writers: dict[int, SummaryWriter] = {}

    def study_started(self, study: StudyInfo, run_id: str | None) -> str:
        self.study = SummaryWriter(str(self.dir / "study"))
        if run_id is None:
            self.study.add_text("spec", _table(flat_params(study.spec)))
            self.study.add_text("tags", _table(study.tags))
        return "study"

    def trial_started(self, trial: TrialRecord, run_id: str | None, logged: int) -> tuple[str, int]:
        name = run_id or f"trial-{trial.number:04d}"
        writer = SummaryWriter(str(self.dir / name), purge_step=logged + 1 if run_id is not None else None)
        if run_id is None:
            writer.add_text("params", json.dumps(trial.params or {}, sort_keys=True))
            writer.add_text("tags", _table({"run": run_name(trial), **trial_tags(trial)}))
        self.writers[trial.number] = writer
        return name, logged

    def log(self, number: int, points: list[Point]) -> None:
        writer = self.writers[number]
        for p in points:
            for key, value in p.values.items():
                writer.add_scalar(key, value, p.step)

    def trial_finished(self, trial: TrialRecord, final: Mapping[str, float]) -> None:
        writer = self.writers.pop(trial.number)
        step = trial.steps_done or 0
        metrics = {**{f"final/{k}": v for k, v in final.items()}, "device_seconds": trial.device_seconds or 0.0}
        for key, value in metrics.items():
            writer.add_scalar(key, value, step)
        writer.add_text("state", f"{trial.state}: {trial.reason}" if trial.reason else str(trial.state), step)
        params = {k: v if isinstance(v, int | float | str | bool) else json.dumps(v)
                  for k, v in (trial.params or {}).items()}
        for summary in hparams(params, metrics):  # the HParams tab: params against final metrics
            writer.file_writer.add_summary(summary)
        writer.close()

    def study_finished(self, report: Path | None, pareto: list[dict[str, Any]]) -> None:
        assert self.study is not None
        if report is not None:
            self.study.add_text("report", f"HTML report: {report}")
        if pareto:
            columns = list(dict.fromkeys(k for r in pareto for k in r))
            rows = "\n".join("| " + " | ".join(str(r.get(c, "")) for c in columns) + " |" for r in pareto)
            self.study.add_text("pareto", f"| {' | '.join(columns)} |\n|{'---|' * len(columns)}\n{rows}")

    def close(self, finished: bool) -> None:
        for writer in self.writers.values():
            writer.close()
        self.writers.clear()
        if self.study is not None:
            self.study.close()
