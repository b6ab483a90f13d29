"""TensorBoard: one run folder per trial (``trial-0003``) beside the study's (``study``), under
``<study dir>/tensorboard`` by default, written with TensorBoard's own event writer and summary protos (``_Writer``:
the events ``torch.utils.tensorboard.SummaryWriter`` writes, without importing torch into the trackers' process,
a second of CPU on the demo's machine).

A trial's folder holds its curve as scalars (``train/loss`` per optimizer step, ``rung/<metric>``,
``eval/<metric>``, ``final/<metric>``), its params and tags as text, its end (state, reason) as text and its
params against its final metrics in the HParams tab. A reopened run is written with ``purge_step`` one past what
it logged: TensorBoard drops whatever a killed run wrote after that, so no step shows twice. The folders are named
by trial number: ``find`` reads their events back (the last ``train/loss`` step, whether ``state`` was written)
whatever ``trackers.json`` holds.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
from tensorboard.compat.proto.event_pb2 import Event, SessionLog
from tensorboard.compat.proto.summary_pb2 import Summary
from tensorboard.compat.proto.tensor_pb2 import TensorProto
from tensorboard.compat.proto.tensor_shape_pb2 import TensorShapeProto
from tensorboard.plugins.hparams import api_pb2, plugin_data_pb2
from tensorboard.plugins.hparams import metadata as hp_metadata
from tensorboard.plugins.text import metadata as text_metadata
from tensorboard.summary.writer.event_file_writer import EventFileWriter

from lora_sweep.store.api import TrialRecord
from lora_sweep.sweep.trackers.base import Held, Point, StudyInfo, flat_params, run_name, trial_tags

__all__ = ["TensorBoardTracker"]


def _table(values: Mapping[str, Any]) -> str:
    """A markdown table (TensorBoard's text dashboard renders markdown)."""
    return "| key | value |\n|---|---|\n" + "\n".join(f"| {k} | {v} |" for k, v in values.items())


class _Writer:
    """One run folder's event file: scalars, text and the HParams tab's three summaries, as
    ``torch.utils.tensorboard.SummaryWriter`` writes them. ``purge_step``: a reopened run's first step, which tells
    TensorBoard to drop what a killed writer logged from there on."""

    def __init__(self, logdir: Path, purge_step: int | None = None) -> None:
        self.events = EventFileWriter(str(logdir))
        if purge_step is not None:
            self.events.add_event(Event(step=purge_step, file_version="brain.Event:2"))
            self.events.add_event(Event(step=purge_step, session_log=SessionLog(status=SessionLog.START)))

    def _add(self, summary: Summary, step: int) -> None:
        self.events.add_event(Event(summary=summary, wall_time=time.time(), step=step))

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        self._add(Summary(value=[Summary.Value(tag=tag, simple_value=float(value))]), step)

    def add_text(self, tag: str, text: str, step: int = 0) -> None:
        tensor = TensorProto(dtype="DT_STRING", string_val=[text.encode("utf-8")],
                             tensor_shape=TensorShapeProto(dim=[TensorShapeProto.Dim(size=1)]))
        meta = text_metadata.create_summary_metadata(display_name=None, description=None)
        self._add(Summary(value=[Summary.Value(tag=f"{tag}/text_summary", metadata=meta, tensor=tensor)]), step)

    def add_hparams(self, params: Mapping[str, int | float | str | bool], metrics: Iterable[str]) -> None:
        """The run's hyperparameters (numbers, strings, booleans) and the metric tags it reports against them."""
        start, infos = plugin_data_pb2.SessionStartInfo(), []
        for key, value in params.items():
            kind, field = (("DATA_TYPE_BOOL", "bool_value") if isinstance(value, bool)
                           else ("DATA_TYPE_STRING", "string_value") if isinstance(value, str)
                           else ("DATA_TYPE_FLOAT64", "number_value"))
            setattr(start.hparams[key], field, value)
            infos.append(api_pb2.HParamInfo(name=key, type=api_pb2.DataType.Value(kind)))
        experiment = api_pb2.Experiment(hparam_infos=infos, metric_infos=[
            api_pb2.MetricInfo(name=api_pb2.MetricName(tag=tag)) for tag in metrics])
        end = plugin_data_pb2.SessionEndInfo(status=api_pb2.Status.Value("STATUS_SUCCESS"))
        for tag, data in ((hp_metadata.EXPERIMENT_TAG, plugin_data_pb2.HParamsPluginData(experiment=experiment)),
                          (hp_metadata.SESSION_START_INFO_TAG, plugin_data_pb2.HParamsPluginData(
                              session_start_info=start)),
                          (hp_metadata.SESSION_END_INFO_TAG, plugin_data_pb2.HParamsPluginData(session_end_info=end))):
            self._add(Summary(value=[Summary.Value(tag=tag, metadata=hp_metadata.create_summary_metadata(data))]), 0)

    def close(self) -> None:
        self.events.close()


class TensorBoardTracker:
    """The ``tensorboard`` tracker (``sweep.trackers.base.Tracker``)."""

    name = "tensorboard"
    remote = False

    def __init__(self, options: Mapping[str, Any], root: Path, study: str) -> None:
        self.dir = Path(options.get("log_dir") or root / "tensorboard")
        self.study: _Writer | None = None
        self.writers: dict[int, _Writer] = {}
        self.steps: dict[int, int] = {}  # trial number -> the last train/loss step its folder holds (``find``)

    def find(self, study: StudyInfo, parent: str | None,
             runs: Mapping[int, str]) -> tuple[str | None, dict[int, Held]]:
        held: dict[int, Held] = {}
        for folder in sorted(self.dir.glob("trial-*")):
            if not folder.name.removeprefix("trial-").isdigit():
                continue
            number, last, ended = int(folder.name.removeprefix("trial-")), -1, False
            for file in sorted(folder.glob("events.out.tfevents.*")):
                for event in EventFileLoader(str(file)).Load():
                    for value in event.summary.value:
                        last = max(last, event.step) if value.tag == "train/loss" else last
                        ended = ended or value.tag == "state/text_summary"
            held[number], self.steps[number] = Held(folder.name, ended), last
        return ("study" if (self.dir / "study").is_dir() else None), held

    def study_started(self, study: StudyInfo, run_id: str | None) -> str:
        self.study = _Writer(self.dir / "study")
        if run_id is None:
            self.study.add_text("spec", _table(flat_params(study.spec)))
            self.study.add_text("tags", _table(study.tags))
        return "study"

    def trial_started(self, trial: TrialRecord, run_id: str | None, logged: int) -> tuple[str, int]:
        name = run_id or f"trial-{trial.number:04d}"
        if run_id is not None:  # what its folder holds (``find``): a killed writer may not have written all it had
            logged = self.steps.get(trial.number, -1)
        writer = _Writer(self.dir / name, purge_step=logged + 1 if run_id is not None else None)
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
        writer.add_hparams(params, metrics)  # the HParams tab: params against final metrics
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
