"""MLflow: the study a parent run, each trial a nested child run (tag ``mlflow.parentRunId``), through
``mlflow.MlflowClient`` alone (no active-run globals: the trackers' process owns every run).

Default store: ``sqlite:///<study dir>/mlflow.db`` with the artifacts in ``<study dir>/mlruns``. (MLflow 3 refuses
a plain ``./mlruns`` file store unless ``MLFLOW_ALLOW_FILE_STORE`` is set: its file backend is in maintenance
mode; a SQLite file is MLflow's own local default.) ``mlflow ui --backend-store-uri sqlite:///<study dir>/mlflow.db``
shows the sweep; any ``tracking_uri`` (a server's included) works the same way.

A new study's store starts as a copy of an empty one at the installed MLflow's schema, kept in the user's cache
(``<cache>/mlflow/<version>.db``, made once per MLflow version): MLflow makes a new SQLite store by running its
migrations, about 1.3 CPU seconds the trackers' process would take from training at every study; the copy's
``Default`` experiment is pointed at this study's ``mlruns/0`` (MLflow writes the folder it was made in).

The runs are found again by ids set here, whatever ``trackers.json`` holds (``find``): the study's run by its tag
``lora_sweep.study_id`` (``StudyInfo.uid``), each trial's by ``mlflow.parentRunId`` and ``lora_sweep.trial``; a
trial whose ``lora_sweep.state`` tag is set has ended. A pruned trial's run ends FINISHED (it ran as asked: a rung
stopped it) with the state in its tag, its name (``trial 3 (pruned)``) and its description.

MLflow's own output is kept from the run's: no "View run ... at" line (its URL would hold a ``tracking_uri``'s
password), and a server's requests fail within seconds (1 retry, 5 s each) rather than minutes, unless the
environment sets MLflow's ``MLFLOW_HTTP_REQUEST_*`` variables itself.
"""

from __future__ import annotations

import contextlib
import csv
import importlib
import io
import logging
import os
import shutil
import sqlite3
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import mlflow
from mlflow import MlflowClient
from mlflow.entities import Metric, Param, RunTag

from lora_sweep.store.api import TrialRecord, cache_dir
from lora_sweep.sweep.trackers.base import Held, Point, StudyInfo, flat_params, run_name, trial_tags

__all__ = ["MlflowTracker", "default_uri", "prepare", "seed_store"]

_STATUS = {"COMPLETE": "FINISHED", "PRUNED": "FINISHED", "FAIL": "FAILED"}
"""Optuna's end states as MLflow run statuses: a pruned trial ran as the study asked (its rung stopped it), not a
failure or a kill; the state itself is the ``lora_sweep.state`` tag, the run's name and its description."""
_ENV = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
        "MLFLOW_HTTP_REQUEST_TIMEOUT": "5"}
"""A tracking server that is down or never answers fails a request in about 1 s (refused) or 10 s (silent), not
after MLflow's 7 retries of up to 120 s each; the environment's own values win."""
for _key, _value in _ENV.items():
    os.environ.setdefault(_key, _value)
os.environ["MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT"] = "true"  # its URL holds the tracking URI, password included
_BATCH = 1000
"""MLflow's ``log_batch`` takes at most 1000 metrics, 100 params and 100 tags per call."""


# the store's first open creates its tables and says so at INFO on stderr, in the middle of the run's own lines
logging.getLogger("mlflow.store.db.utils").setLevel(logging.WARNING)
logging.getLogger("alembic").setLevel(logging.WARNING)


def default_uri(root: Path) -> str:
    """The tracking URI of a study directory's own MLflow store."""
    return f"sqlite:///{(root / 'mlflow.db').resolve()}"


def prepare(options: Mapping[str, Any]) -> None:
    """What MLflow needs that no study directory holds, done before the run has trials (``Syncer.prepare``): with
    the default store, the cache's empty store made if missing, and MLflow's SQL store imported (SQLAlchemy and
    MLflow's tables, the first client's cost)."""
    if not options.get("tracking_uri"):
        _empty_store()
    importlib.import_module("mlflow.store.tracking.sqlalchemy_store")


def _empty_store() -> Path:
    """The cache's empty store of this MLflow version, made when missing (appearing whole: made aside, renamed)."""
    template = cache_dir() / "mlflow" / f"{mlflow.__version__}.db"
    if not template.is_file():
        template.parent.mkdir(parents=True, exist_ok=True)
        aside = template.with_name(f".{template.name}.{os.getpid()}")
        aside.unlink(missing_ok=True)
        MlflowClient(tracking_uri=f"sqlite:///{aside}").search_experiments(max_results=1)  # runs the migrations
        os.replace(aside, template)
    return template


def seed_store(path: Path) -> None:
    """Create the SQLite store ``path`` (if absent) as a copy of the cache's empty store of this MLflow version,
    made first when missing, its ``Default`` experiment's artifacts in ``mlruns/0`` beside ``path`` (the cache's
    names the folder it was made in); every file appears whole (written aside, then renamed)."""
    if path.exists():
        return
    template = _empty_store()
    aside = path.with_name(f".{path.name}.{os.getpid()}")
    shutil.copyfile(template, aside)
    with contextlib.closing(sqlite3.connect(aside)) as db, db:
        db.execute("PRAGMA secure_delete = ON")  # the old path's bytes overwritten, not left in a free block
        db.execute("UPDATE experiments SET artifact_location = ? WHERE experiment_id = 0",
                    [str((path.parent / "mlruns" / "0").resolve())])
    os.replace(aside, path)


class MlflowTracker:
    """The ``mlflow`` tracker (``sweep.trackers.base.Tracker``)."""

    name = "mlflow"

    def __init__(self, options: Mapping[str, Any], root: Path, study: str) -> None:
        self.root = root
        if not options.get("tracking_uri"):
            seed_store(root / "mlflow.db")
        uri = options.get("tracking_uri") or default_uri(root)
        self.remote = not uri.startswith(("sqlite:", "file:", "/")) and "://" in uri
        self.client = MlflowClient(tracking_uri=uri)
        self.experiment = options.get("experiment") or study
        self.parent: str | None = None
        self.experiment_id = ""  # the parent's, asked once: a query of MLflow's store per trial otherwise
        self.runs: dict[int, str] = {}
        self.ran = False  # the parent set RUNNING by a trial this run trains: its end is this run's to say
        self.created = False

    def _experiment_id(self) -> str:
        found = self.client.get_experiment_by_name(self.experiment)
        if found is not None:
            return found.experiment_id
        location = (self.root / "mlruns").resolve().as_uri() if self.client.tracking_uri.startswith("sqlite:") else None
        return self.client.create_experiment(self.experiment, artifact_location=location)

    def _search(self, query: str) -> list[Any]:
        runs, token = [], None
        while True:
            page = self.client.search_runs([self.experiment_id], query, max_results=1000, page_token=token,
                                           order_by=["attributes.start_time ASC"])
            runs += list(page)
            token = page.token
            if not token:
                return runs

    def find(self, study: StudyInfo, parent: str | None,
             runs: Mapping[int, str]) -> tuple[str | None, dict[int, Held]]:
        found = self.client.get_experiment_by_name(self.experiment)
        if found is None:
            return None, {}
        self.experiment_id = found.experiment_id
        mine = self._search(f"tags.`lora_sweep.study_id` = '{study.uid}'")
        if not mine and parent is not None:  # a run of a version that set no such tag, named by trackers.json
            mine = self._search(f"attributes.run_id = '{parent}'")
        if not mine:
            return None, {}
        self.parent = mine[0].info.run_id
        held: dict[int, Held] = {}
        for run in self._search(f"tags.`mlflow.parentRunId` = '{self.parent}'"):
            number = run.data.tags.get("lora_sweep.trial")
            if number is not None and int(number) not in held:
                held[int(number)] = Held(run.info.run_id, "lora_sweep.state" in run.data.tags)
        return self.parent, held

    def study_started(self, study: StudyInfo, run_id: str | None) -> str:
        if run_id is not None:  # its status is left as it is until a trial trains (``trial_started``)
            self.parent, self.experiment_id = run_id, self.client.get_run(run_id).info.experiment_id
            self.client.set_tag(run_id, "lora_sweep.study_id", study.uid)
            return run_id
        self.experiment_id = self._experiment_id()
        run = self.client.create_run(self.experiment_id, run_name=study.name,
                                     tags={**study.tags, "lora_sweep.kind": "study", "lora_sweep.study_id": study.uid})
        self.parent, self.created = run.info.run_id, True
        self._batch(self.parent, params=flat_params(study.spec))
        return self.parent

    def trial_started(self, trial: TrialRecord, run_id: str | None, logged: int) -> tuple[str, int]:
        assert self.parent is not None
        if trial.state == "RUNNING" and not self.ran:  # the study trains again: its run is RUNNING until the end
            self.client.update_run(self.parent, status="RUNNING")
            self.ran = True
        if run_id is not None:  # reopened: what it holds is what MLflow says, not the cursor
            self.client.update_run(run_id, status="RUNNING")
            self.runs[trial.number] = run_id
            self._batch(run_id, params=flat_params(trial.params))  # a run killed as it was created may lack them
            history = self.client.get_metric_history(run_id, "train/loss")
            return run_id, max([m.step for m in history], default=-1)
        tags = {**trial_tags(trial), "lora_sweep.kind": "trial", "mlflow.parentRunId": self.parent}
        run = self.client.create_run(self.experiment_id, run_name=run_name(trial), tags=tags)
        self.runs[trial.number] = run.info.run_id
        self._batch(run.info.run_id, params=flat_params(trial.params))
        return run.info.run_id, -1

    def log(self, number: int, points: list[Point]) -> None:
        now = int(time.time() * 1000)
        metrics = [Metric(k, v, now, p.step) for p in points for k, v in p.values.items()]
        self._batch(self.runs[number], metrics=metrics)

    def trial_finished(self, trial: TrialRecord, final: Mapping[str, float]) -> None:
        run = self.runs.pop(trial.number)
        now, step = int(time.time() * 1000), trial.steps_done or 0
        values = {**{f"final/{k}": v for k, v in final.items()}, "device_seconds": trial.device_seconds or 0.0,
                  "steps": float(step), "tokens": float(trial.tokens or 0)}
        state = trial.state or ""
        tags = {"lora_sweep.state": state, "lora_sweep.reason": trial.reason or "",
                "mlflow.note.content": f"{state}: {trial.reason}" if trial.reason else state}
        self._batch(run, metrics=[Metric(k, float(v), now, step) for k, v in values.items()], tags=tags)
        if state == "PRUNED":  # FINISHED as a complete trial's: the name says it stopped at a rung
            self.client.update_run(run, name=f"{run_name(trial)} (pruned)")
        self.client.set_terminated(run, _STATUS.get(state, "FAILED"))

    def study_finished(self, report: Path | None, pareto: list[dict[str, Any]]) -> None:
        assert self.parent is not None
        if report is not None and report.is_file():
            self.client.log_artifact(self.parent, str(report))
        if pareto:
            self.client.log_text(self.parent, _csv(pareto), "pareto.csv")

    def close(self, finished: bool) -> None:
        """The trials still training KILLED (a resumed run reopens them); the study's run FINISHED when the budget
        ended the run, KILLED when it trained and was stopped, FINISHED when made here to hold ended trials only, else
        left as it was (a rerun of a finished study keeps it FINISHED)."""
        for run in self.runs.values():
            self.client.set_terminated(run, "KILLED")
        self.runs.clear()
        if self.parent is not None and (finished or self.ran or self.created):
            self.client.set_terminated(self.parent, "KILLED" if self.ran and not finished else "FINISHED")

    def _batch(self, run: str, *, metrics: list[Metric] = (), params: Mapping[str, str] = {},  # type: ignore[assignment]
               tags: Mapping[str, str] = {}) -> None:
        """``log_batch`` in chunks of MLflow's limits; param values cut to its 6000 characters."""
        ps = [Param(k, v[:6000]) for k, v in params.items()]
        ts = [RunTag(k, v) for k, v in tags.items()]
        for i in range(0, max(len(metrics), 10 * len(ps), 10 * len(ts), 1), _BATCH):  # 100 params, tags a call
            self.client.log_batch(run, metrics=metrics[i:i + _BATCH], params=ps[i // 10:i // 10 + 100],
                                  tags=ts[i // 10:i // 10 + 100])


def _csv(rows: list[dict[str, Any]]) -> str:
    """The Pareto table as CSV (its columns: every key of any row, in first-seen order)."""
    columns = list(dict.fromkeys(k for r in rows for k in r))
    out = io.StringIO()
    writer = csv.DictWriter(out, columns)
    writer.writeheader()
    writer.writerows(rows)
    return out.getvalue()
