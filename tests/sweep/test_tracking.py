"""``trackers:`` in a study file (sweep/config/tracking.py): bare names and options, overrides, the refusals, a
missing package named with its extra, what Axolotl's tracker keys and torchtune's ``metric_logger`` become, and the
guess ``sweep run`` makes from the file before it loads."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

from lora_sweep.errors import ConfigError
from lora_sweep.sweep.config.loader import load_study
from lora_sweep.sweep.config.tracking import TrackerSpec, axolotl_trackers, torchtune_trackers
from tests.conftest import need_module

STUDY = """\
name: t
model: org/tiny-model
data: {train: train.jsonl, eval: eval.jsonl}
search: {rank: [4, 8]}
budget: {trials: 2}
"""


@pytest.fixture
def study(tmp_path: Path) -> Path:
    for name in ("train.jsonl", "eval.jsonl"):
        (tmp_path / name).write_text('{"instruction": "a", "output": "b"}\n')
    path = tmp_path / "t.yaml"
    path.write_text(STUDY)
    return path


@pytest.fixture(autouse=True)
def _packages() -> None:
    for module in ("mlflow", "wandb", "tensorboard"):
        need_module(module, module)


def test_bare_names_take_the_defaults_and_a_mapping_sets_options(study: Path) -> None:
    study.write_text(STUDY + "trackers: [mlflow, {name: wandb, mode: online, project: p}]\n")
    spec = load_study(study)
    assert spec.trackers == (TrackerSpec("mlflow"), TrackerSpec("wandb", {"mode": "online", "project": "p"}))
    assert load_study(study, ["trackers=[tensorboard]"]).trackers == (TrackerSpec("tensorboard"),)
    assert load_study(study, ["trackers=[]"]).trackers == ()
    study.write_text(STUDY)
    assert load_study(study).trackers == ()  # none unless named


@pytest.mark.parametrize(("value", "expected"), [
    ("[comet]", "trackers.0: must be one of mlflow, wandb, tensorboard (got 'comet')"),
    ("[{name: wandb, mode: online}]", "trackers.0.mode: online needs a project"),
    ("[{name: wandb, mode: loud}]", "trackers.0.mode: must be one of offline, online, disabled"),
    ("[{name: mlflow, uri: x}]", "trackers.0.uri: is not an option of mlflow (its options: tracking_uri, experiment)"),
    ("[{name: tensorboard, log_dir: 3}]", "trackers.0.log_dir: must be a non-empty string"),
    ("[mlflow, mlflow]", "trackers.1: is listed twice"),
    ("[{mode: offline}]", "trackers.0.name: is required"),
])
def test_a_bad_tracker_is_one_located_line(study: Path, value: str, expected: str) -> None:
    with pytest.raises(ConfigError, match="^" + re.escape(str(study)) + ".*" + re.escape(expected)):
        load_study(study, [f"trackers={value}"])


def test_a_tracker_without_its_package_is_refused_naming_the_extra(study: Path, monkeypatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(ConfigError, match=r"trackers\.0: wandb is not installed: pip install 'lora-sweep\[wandb\]'"):
        load_study(study, ["trackers=[wandb]"])


def test_axolotl_tracker_keys() -> None:
    assert axolotl_trackers({"wandb_project": "p", "wandb_mode": "offline", "wandb_watch": "all"}) == (
        [{"name": "wandb", "project": "p", "mode": "offline"}], ["wandb_project", "wandb_mode"])
    entries, used = axolotl_trackers({"use_mlflow": True, "mlflow_tracking_uri": "http://mlflow:5000",
                                      "mlflow_experiment_name": "e", "wandb_project": None})
    assert entries == [{"name": "mlflow", "tracking_uri": "http://mlflow:5000", "experiment": "e"}]
    assert sorted(used) == ["mlflow_experiment_name", "mlflow_tracking_uri", "use_mlflow"]
    assert axolotl_trackers({"wandb_project": "p", "wandb_mode": "disabled"})[0] == []  # Axolotl's off switch
    assert axolotl_trackers({"wandb_entity": "me"})[0] == []  # no project: Axolotl logs nowhere either


def test_torchtune_metric_logger() -> None:
    logger = {"_component_": "torchtune.training.metric_logging.WandBLogger", "project": "p", "log_dir": "/x"}
    assert torchtune_trackers(logger) == ([{"name": "wandb", "project": "p"}], ["metric_logger.log_dir"])
    logger = {"_component_": "torchtune.training.metric_logging.MLFlowLogger", "experiment_name": "e",
              "tracking_uri": "file:/m"}
    assert torchtune_trackers(logger)[0] == [{"name": "mlflow", "experiment": "e", "tracking_uri": "file:/m"}]
    logger = {"_component_": "torchtune.training.metric_logging.TensorBoardLogger", "log_dir": "/tb"}
    assert torchtune_trackers(logger)[0] == [{"name": "tensorboard", "log_dir": "/tb"}]
    disk = {"_component_": "torchtune.training.metric_logging.DiskLogger"}
    assert torchtune_trackers(disk) == ([], ["metric_logger"])  # logs nothing a study's results.db lacks


