"""``train.optimizer_in_backward`` at the study boundary: refused in one line with clipping or accumulation
(exit 2 through ``sweep run`` and ``sweep plan``), else trained on the one step (its gradient buffer kept, a
warning says so); torchtune's ``optimizer_in_bwd`` maps to it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from optuna.trial import TrialState

from lora_sweep.errors import ConfigError
from lora_sweep.sweep.config.loader import load_study
from lora_sweep.sweep.study import run_study
from tests.conftest import optuna_study, write_study
from tests.helpers import foreign_config

ROOT = Path(__file__).resolve().parents[2]


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lora_sweep", *args], capture_output=True, text=True, timeout=120,
                          cwd=ROOT)


REFUSED = {
    "clipping": ({"optimizer_in_backward": True, "max_steps": 12},
                 "train.optimizer_in_backward: needs train.max_grad_norm: null (clipping needs the whole gradient "
                 "before the step) (got 1.0)"),
    "accumulation": ({"optimizer_in_backward": True, "max_grad_norm": None, "gradient_accumulation_steps": 2},
                     "train.optimizer_in_backward: needs train.gradient_accumulation_steps: 1 (the step needs every "
                     "micro-batch's gradient first) (got 2)"),
}


@pytest.mark.parametrize("command", ["run", "plan"])
@pytest.mark.parametrize("case", list(REFUSED))
def test_clipping_or_accumulation_with_it_is_one_line_exit_2(tiny_dirs, tmp_path, case: str, command: str) -> None:
    train, message = REFUSED[case]
    path = write_study(tmp_path, tiny_dirs("llama"), f"refused-{case}", train=train)
    result = _cli(command, str(path))
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0] and str(path) in lines[0], result.stderr


def test_a_searched_clipping_is_refused(tiny_dirs, tmp_path) -> None:
    path = write_study(tmp_path, tiny_dirs("llama"), "searched",
                       train={"optimizer_in_backward": True, "max_steps": 12},
                       search={"rank": [2, 4], "max_grad_norm": [0.5, 1.0]})
    with pytest.raises(ConfigError, match="train.optimizer_in_backward: cannot be used with a searched max_grad_norm "
                                          r"\(it needs train.max_grad_norm: null, fixed\)") as e:
        load_study(path)
    assert "\n" not in str(e.value) and str(path) in str(e.value)


def test_a_study_with_it_trains_on_the_one_step_and_says_so(tiny_dirs, tmp_path) -> None:
    path = write_study(tmp_path, tiny_dirs("llama"), "inbwd", budget={"trials": 3},
                       train={"optimizer_in_backward": True, "max_grad_norm": None, "max_steps": 12,
                              "micro_batch": 4})
    spec = load_study(path)
    assert spec.train.optimizer_in_backward
    assert "optimizer_in_backward" not in spec.train.adapter_values()  # a loop option, not an adapter field
    logged: list[str] = []
    with pytest.warns(UserWarning, match="optimizer_in_backward: the training step keeps its preallocated fp32"):
        run_study(spec, log=logged.append)
    assert [m for m in logged if "trained on the" in m] == ["pack 1: trained on the eager step (fixed "
                                                            "shapes, eagerly)"]
    trials = optuna_study(spec.out_dir, spec.name).get_trials()
    assert len(trials) == 3 and all(tr.state in (TrialState.COMPLETE, TrialState.PRUNED) for tr in trials)
    assert any(tr.state == TrialState.COMPLETE for tr in trials)


def test_torchtune_optimizer_in_bwd_runs_a_small_study(tiny_dirs, tmp_path) -> None:
    path = foreign_config(tmp_path, tiny_dirs("llama"), "torchtune-1B-lora.yaml", optimizer_in_bwd=True,
                          gradient_accumulation_steps=1)
    spec = load_study(path)
    assert spec.train.optimizer_in_backward and spec.train.max_grad_norm is None  # torchtune: no clipping with it
    run_study(spec, log=lambda m: None)
    trials = optuna_study(spec.out_dir, spec.name).get_trials()
    assert len(trials) == 2 and all(tr.state == TrialState.COMPLETE for tr in trials)


def test_torchtune_clip_grad_norm_with_optimizer_in_bwd_is_refused(tiny_dirs, tmp_path) -> None:
    path = foreign_config(tmp_path, tiny_dirs("llama"), "torchtune-1B-lora.yaml", optimizer_in_bwd=True,
                          gradient_accumulation_steps=1, clip_grad_norm=1.0)
    result = _cli("run", str(path), "--quiet")
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "clip_grad_norm: must be null with optimizer_in_bwd: true" in result.stderr
