"""The sweep finds a better adapter than the community default on the real model (the README demo's task).

A shortened ``studies/demo.yaml`` (overrides only: fewer trials and steps, the model from the session
fixture): the default trial (r=16, alpha=32, lr=2e-4) is enqueued first, and the best trial by held-out
loss must beat it with a 95% paired bootstrap interval over the held-out items that excludes zero, as
``sweep status`` reports it.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from lora_sweep.sweep.config.loader import load_study
from lora_sweep.sweep.status import study_status
from lora_sweep.sweep.study import run_study

pytestmark = pytest.mark.real_model

DEMO = Path(__file__).resolve().parents[2] / "studies" / "demo.yaml"


def test_best_trial_beats_the_default_on_the_demo_task(smollm2_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "runs-demo"
    spec = load_study(DEMO, [f"model.path={smollm2_dir}", "model.device=cpu", f"output={out}", "budget.trials=4",
                             "train.max_steps=16", "pruning.rungs=[8]"])
    run_study(spec)
    info = study_status(out)
    assert sum(info["counts"].values()) == 4 and info["counts"].get("COMPLETE", 0) >= 2, info["counts"]
    vs = info["vs_default"]
    assert vs is not None and vs["best"] != vs["default"], vs
    loss = next(r for r in vs["rows"] if r["metric"] == "eval_loss")
    assert loss["items"] == 32 and loss["best"] < loss["default"], loss
    assert loss["high"] < 0, f"the paired interval must exclude zero: {loss}"
