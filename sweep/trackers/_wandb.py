"""Weights & Biases: the study one run (job type ``study``), each trial one run (job type ``trial``), grouped by the
study's name, as W&B groups the runs of a sweep.

Default ``mode: offline``: runs are written under ``<study dir>/wandb/offline-run-*`` and uploaded, whenever
wanted, by ``wandb sync <study dir>/wandb/offline-run-*``; nothing leaves the machine until then. ``mode: online``
with a ``project`` logs as it goes. The run ids are kept (``sweep.trackers.sync``), so a resumed study reopens each
run with ``resume="allow"``: offline, W&B writes the reopened run to a new folder with the same id, and ``wandb
sync`` joins them into one run. The ids are the study's (``StudyInfo.uid``): ``<uid>-study`` and
``<uid>-trial-<n>``, so that a run is found again offline (``find`` reads the run files back) whatever
``trackers.json`` holds, and online reopened rather than made twice.
"""

from __future__ import annotations

import importlib
import json
import os
import struct
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import wandb

from lora_sweep.store.api import TrialRecord
from lora_sweep.sweep.trackers.base import Held, Point, StudyInfo, run_name, trial_tags

__all__ = ["WandbTracker", "offline_records", "prepare"]

_BLOCK = 32768


def prepare(options: Mapping[str, Any]) -> None:
    """What W&B needs that no study directory holds, done before the run has trials (``Syncer.prepare``): its core
    process started, and the module every first ``wandb.init`` imports for W&B Launch's staged inputs (W&B's launch
    agent and public API come with it) imported."""
    wandb.setup()
    importlib.import_module("wandb.sdk.launch.inputs.internal")


def offline_records(file: Path) -> Iterator[Any]:
    """The records of an offline run's ``.wandb`` file as wandb's own protobufs (``wandb_internal_pb2.Record``).

    The file is a 7-byte header (``:W&B``, magic 0xBEE1, version 0), then LevelDB's log format: 32 KiB blocks of
    records, each behind a 7-byte header (CRC32C, length, type FULL/FIRST/MIDDLE/LAST). wandb 0.31 reads it in
    its Go core only. A killed writer's torn last record ends the iteration.
    """
    from wandb.proto import wandb_internal_pb2

    data = file.read_bytes()
    if data[:4] != b":W&B" or struct.unpack("<H", data[4:6])[0] != 0xBEE1:
        raise ValueError(f"{file}: not a W&B run file")
    pos, parts = 7, b""
    while pos + 7 <= len(data):
        if _BLOCK - pos % _BLOCK < 7:  # a block's tail too short for a header is padding
            pos += _BLOCK - pos % _BLOCK
            continue
        length, kind = struct.unpack("<HB", data[pos + 4:pos + 7])
        if (length == 0 and kind == 0) or pos + 7 + length > len(data):
            return
        parts += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST: a whole record
            record = wandb_internal_pb2.Record()
            record.ParseFromString(parts)
            yield record
            parts = b""


def _last_step(folder: Path, run_id: str) -> int:
    """The last step the offline run ``run_id`` holds on disk, over every folder it was written to (-1: none)."""
    last = -1
    for file in folder.glob(f"offline-run-*-{run_id}/run-{run_id}.wandb"):
        for record in offline_records(file):
            if record.WhichOneof("record_type") == "history":
                step = next((i.value_json for i in record.history.item if i.key == "_step"), None)
                last = max(last, int(json.loads(step))) if step is not None else last
    return last


def _run_of(file: Path) -> tuple[str, int | None, bool]:
    """(job type, trial number, whether its end was logged: a ``state`` in its summary) of an offline run file."""
    job, number, ended = "", None, False
    for record in offline_records(file):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            job = record.run.job_type or job
            number = next((int(t.split(":", 1)[1]) for t in record.run.tags if t.startswith("trial:")), number)
        elif kind == "summary":
            ended = ended or any(i.key == "state" for i in record.summary.update)
    return job, number, ended


class WandbTracker:
    """The ``wandb`` tracker (``sweep.trackers.base.Tracker``)."""

    name = "wandb"

    def __init__(self, options: Mapping[str, Any], root: Path, study: str) -> None:
        self.mode = options.get("mode", "offline")
        self.common = {"project": options.get("project", "lora-sweep"), "entity": options.get("entity"),
                       "mode": self.mode, "dir": str(root), "group": study}
        self.study_name = options.get("name") or study
        self.folder = root / "wandb"
        (root / "wandb").mkdir(parents=True, exist_ok=True)  # wandb.init's dir must exist; it writes wandb/ in it
        self.remote = self.mode == "online"
        self.uid = ""  # the study's (``find``)
        self.study: Any = None
        self.runs: dict[int, Any] = {}

    def _init(self, run_id: str, requirements: bool = False, **kwargs: Any) -> Any:
        # create_new: one process holds the study's run and every training trial's at once; no console capture, no
        # system-metrics sampler (a thread per run polling the GPU and CPU), no code or git snapshot; the installed
        # packages on the study's run only (W&B reads every package's metadata for it: 0.38 CPU s a run on the demo)
        settings = wandb.Settings(silent=True, console="off", x_disable_stats=True, save_code=False,
                                  disable_git=True, disable_job_creation=True, x_save_requirements=requirements)
        return wandb.init(**self.common, **kwargs, id=run_id, resume="allow", reinit="create_new", settings=settings)

    def find(self, study: StudyInfo, parent: str | None,
             runs: Mapping[int, str]) -> tuple[str | None, dict[int, Held]] | None:
        self.uid = study.uid
        if self.mode != "offline":
            return None
        known = {parent, *runs.values()} - {None}
        found: str | None = None
        held: dict[int, Held] = {}
        for file in sorted(self.folder.glob("offline-run-*/run-*.wandb")):
            run_id = file.stem.removeprefix("run-")
            if not (run_id.startswith(f"{study.uid}-") or run_id in known):
                continue
            job, number, ended = _run_of(file)
            if job == "study":
                found = found or run_id
            elif job == "trial" and number is not None:
                ended = ended or (number in held and held[number].ended)
                held[number] = Held(run_id, ended)
        return found, held

    def study_started(self, study: StudyInfo, run_id: str | None) -> str:
        self.study = self._init(run_id or f"{study.uid}-study", requirements=True, name=self.study_name,
                                job_type="study", config=dict(study.spec),
                                tags=[f"{k.removeprefix('lora_sweep.')}:{v}"[:64] for k, v in study.tags.items()])
        return str(self.study.id)

    def trial_started(self, trial: TrialRecord, run_id: str | None, logged: int) -> tuple[str, int]:
        tags = [f"{k.removeprefix('lora_sweep.')}:{v}"[:64] for k, v in trial_tags(trial).items()]
        run = self._init(run_id or f"{self.uid}-trial-{trial.number}", name=run_name(trial), job_type="trial",
                         tags=tags, config=dict(trial.params or {}))  # again when reopened: a killed run may lack it
        self.runs[trial.number] = run
        # what the runs of the id wrote, not what they were handed (a killed core writes behind); -1 when new
        logged = _last_step(self.folder, str(run.id)) if self.mode == "offline" else run.step - 1
        return str(run.id), logged

    def log(self, number: int, points: list[Point]) -> None:
        run = self.runs[number]
        for p in points:
            run.log(dict(p.values), step=p.step)

    def trial_finished(self, trial: TrialRecord, final: Mapping[str, float]) -> None:
        run = self.runs.pop(trial.number)
        run.log({f"final/{k}": v for k, v in final.items()}, step=trial.steps_done or 0)
        run.summary.update({"state": trial.state, "reason": trial.reason or "", "device_seconds": trial.device_seconds,
                            "steps": trial.steps_done, "tokens": trial.tokens})
        run.finish(exit_code=0 if trial.state != "FAIL" else 1)

    def study_finished(self, report: Path | None, pareto: list[dict[str, Any]]) -> None:
        if pareto:
            columns = list(dict.fromkeys(k for r in pareto for k in r))
            self.study.log({"pareto": wandb.Table(columns=columns, data=[[r.get(c) for c in columns] for r in pareto])})
        if report is not None and report.is_file():
            artifact = wandb.Artifact(f"{self.common['group']}-report", type="report")
            artifact.add_file(os.fspath(report))
            self.study.log_artifact(artifact)

    def close(self, finished: bool) -> None:
        for run in self.runs.values():  # trials still training: a resumed run reopens them
            run.finish(exit_code=1)
        self.runs.clear()
        if self.study is not None:
            self.study.finish(exit_code=0 if finished else 1)
