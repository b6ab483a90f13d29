"""A tracking URI's password reaches no output (store/urls.py, the one masking): a tracked run against a live
MLflow server on 127.0.0.1 with the password in the URL's user information logs there with it, and neither the
run's output, nor `sweep status`, nor any file of the study directory (study.yaml, results.db, trackers.json, the
report), nor a parameter or tag of the runs it made holds it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.conftest import need_module, write_study
from tests.sweep.trackers.servers import mlflow_server

ROOT = Path(__file__).resolve().parents[3]
SECRET = "PASSWORD-4f9c2e"


def test_a_tracking_uri_s_password_reaches_no_output_and_no_file(tiny_dirs, tmp_path) -> None:
    need_module("mlflow", "mlflow")
    need_module("tensorboard", "tensorboard")
    from mlflow import MlflowClient

    with mlflow_server(tmp_path / "server") as url:
        uri = url.replace("http://", f"http://alice:{SECRET}@")
        path = write_study(tmp_path, tiny_dirs("llama"), name="secret", budget={"trials": 2},
                           train={"max_steps": 4, "micro_batch": 4}, pruning={"kind": "none"}, pack={"max_slots": 2},
                           trackers=[{"name": "mlflow", "tracking_uri": uri, "experiment": "secret"}, "tensorboard"])
        out = tmp_path / "runs-secret"
        said = []
        for cmd in (["run", str(path)], ["status", str(out)], ["status", str(out), "--json"], ["report", str(out)]):
            done = subprocess.run([sys.executable, "-m", "lora_sweep", *cmd], capture_output=True, text=True,
                                  timeout=600, cwd=ROOT)
            assert done.returncode == 0, done.stderr
            said += (done.stdout + done.stderr).splitlines()
        client = MlflowClient(tracking_uri=uri)  # logged with the password: the runs are on the server
        runs = client.search_runs([client.get_experiment_by_name("secret").experiment_id])
    assert len([r for r in runs if r.data.tags.get("lora_sweep.kind") == "trial"]) == 2
    assert not [line for line in said if "warning" in line or "View run" in line], said
    assert not [line for line in said if SECRET in line]
    assert any("alice:***@127.0.0.1" in line for line in (out / "study.yaml").read_text().splitlines())
    held = [p for p in out.rglob("*") if p.is_file() and SECRET.encode() in p.read_bytes()]
    assert not held, held
    for run in runs:  # what the runs were given: the resolved spec as params, tags
        assert SECRET not in repr(run.data.params) + repr(run.data.tags)
