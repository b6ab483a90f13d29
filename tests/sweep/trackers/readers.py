"""What each tracker wrote, read back through the tracker's own reader: one parent, its children by trial number,
each child's params, loss steps, end state and tags. Shared by the tracker tests."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class Child:
    run_id: str
    params: dict[str, Any]
    loss_steps: list[int]
    state: str
    tags: dict[str, str] = field(default_factory=dict)
    metrics: set[str] = field(default_factory=set)
    hparams: dict[str, Any] = field(default_factory=dict)
    """TensorBoard: the HParams tab's values and the metric tags it lists (``metrics:``), from the plugin's protos."""
    status: str = ""
    """MLflow: the run's status (FINISHED, FAILED, KILLED, RUNNING)."""
    name: str = ""


@dataclass
class Logged:
    parents: list[str]
    children: dict[int, list[Child]]
    """trial number -> its child runs (one, unless something was duplicated)."""
    parent_files: set[str] = field(default_factory=set)
    """Artifacts (MLflow) or text tags (TensorBoard) of the parent."""


def mlflow_logged(root: Path, experiment: str) -> Logged:
    """``mlflow.MlflowClient`` on the study's own store."""
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{root / 'mlflow.db'}")
    exp = client.get_experiment_by_name(experiment)
    runs = client.search_runs([exp.experiment_id], max_results=1000)
    parents = [r for r in runs if r.data.tags.get("lora_sweep.kind") == "study"]
    out = Logged([r.info.run_id for r in parents], {})
    for r in runs:
        if r.data.tags.get("lora_sweep.kind") != "trial":
            continue
        assert r.data.tags["mlflow.parentRunId"] in out.parents
        steps = [m.step for m in client.get_metric_history(r.info.run_id, "train/loss")]
        params = {k: json.loads(v) if v[:1] in "[{0123456789-tfn" else v for k, v in r.data.params.items()}
        child = Child(r.info.run_id, params, steps, r.data.tags.get("lora_sweep.state", ""), dict(r.data.tags),
                      set(r.data.metrics), status=r.info.status, name=r.info.run_name)
        out.children.setdefault(int(r.data.tags["lora_sweep.trial"]), []).append(child)
    if parents:
        out.parent_files = {a.path for a in client.list_artifacts(parents[0].info.run_id)}
    return out


def tensorboard_logged(root: Path) -> Logged:
    """TensorBoard's ``EventAccumulator`` on each run folder."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    def text(acc: EventAccumulator, tag: str) -> str:
        return acc.Tensors(f"{tag}/text_summary")[-1].tensor_proto.string_val[0].decode()

    logdir = root / "tensorboard"
    study = EventAccumulator(str(logdir / "study"))
    study.Reload()
    out = Logged(["study"], {}, {t.removesuffix("/text_summary") for t in study.Tags()["tensors"]})
    for folder in sorted(logdir.glob("trial-*")):
        acc = EventAccumulator(str(folder), purge_orphaned_data=True)
        acc.Reload()
        steps = [e.step for e in acc.Scalars("train/loss")] if "train/loss" in acc.Tags()["scalars"] else []
        number = int(folder.name.removeprefix("trial-"))
        state = text(acc, "state").split(":")[0] if "state/text_summary" in acc.Tags()["tensors"] else ""
        tags = dict(line.strip("| ").split(" | ") for line in text(acc, "tags").splitlines()[2:])
        out.children.setdefault(number, []).append(
            Child(folder.name, json.loads(text(acc, "params")), steps, state, tags, set(acc.Tags()["scalars"]),
                  _hparams(acc.PluginTagToContent("hparams"))))
    return out


def _hparams(content: dict[str, bytes]) -> dict[str, Any]:
    """The HParams plugin's session start (values by name) and experiment (``metrics:`` its metric tags)."""
    from google.protobuf.json_format import MessageToDict
    from tensorboard.plugins.hparams import metadata

    out: dict[str, Any] = {}
    if metadata.SESSION_START_INFO_TAG in content:
        start = metadata.parse_session_start_info_plugin_data(content[metadata.SESSION_START_INFO_TAG])
        out = {k: MessageToDict(v) for k, v in start.hparams.items()}
    if metadata.EXPERIMENT_TAG in content:
        experiment = metadata.parse_experiment_plugin_data(content[metadata.EXPERIMENT_TAG])
        out["metrics:"] = {m.name.tag for m in experiment.metric_infos}
    return out


def wandb_logged(root: Path) -> Logged:
    """The offline runs' ``.wandb`` files, their records as wandb's own protobufs (``offline_records``); a run
    reopened by a resumed study is a second folder with the same id, joined here as ``wandb sync`` joins it."""
    from lora_sweep.sweep.trackers._wandb import offline_records

    runs: dict[str, dict[str, Any]] = {}
    for file in sorted((root / "wandb").glob("offline-run-*/run-*.wandb")):
        run: dict[str, Any] = {}
        for rec in offline_records(file):
            kind = rec.WhichOneof("record_type")
            if kind == "run":
                run = runs.setdefault(rec.run.run_id, {"steps": [], "summary": {}, "config": {}, "tags": []})
                run.update(job=rec.run.job_type, name=rec.run.display_name)
                run["tags"] += [t for t in rec.run.tags if t not in run["tags"]]
                run["config"].update({i.key: json.loads(i.value_json) for i in rec.run.config.update})
            elif kind == "history":  # W&B keeps a step only past the run's last one (a reopened run's too)
                values = {i.key or "/".join(i.nested_key): i.value_json for i in rec.history.item}
                step = int(json.loads(values["_step"]))
                if "train/loss" in values and step > max(run["steps"], default=-1):
                    run["steps"].append(step)
            elif kind == "summary":
                run["summary"].update({i.key or "/".join(i.nested_key): json.loads(i.value_json)
                                       for i in rec.summary.update})
            elif kind == "config":
                run["config"].update({i.key: json.loads(i.value_json) for i in rec.config.update})
    parents = [i for i, r in runs.items() if r.get("job") == "study"]
    out = Logged(parents, {})
    for run_id, r in runs.items():
        if r.get("job") == "trial":
            tags = dict(t.split(":", 1) for t in r["tags"])
            child = Child(run_id, {k: v for k, v in r["config"].items() if not k.startswith("_")}, r["steps"],
                          r["summary"].get("state", ""), tags)
            out.children.setdefault(int(tags["trial"]), []).append(child)
    return out
