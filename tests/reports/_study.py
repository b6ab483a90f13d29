"""The fixture study shared by the report and export tests: built once per test session, in-process.

A tiny Llama, 8 trials of 12 steps packed 3 at a time: the community default, pruning at step 6 (so pruned
trials and backfills), ranks 2..20 in steps of 2 (most not a rank vLLM accepts, so exports get padded), rsLoRA
on and off, two objectives (held-out loss and adapter size: a Pareto front).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import write_study

ROOT = Path(__file__).resolve().parents[2]
_BUILT: dict[Path, Path] = {}


def fixture_study(tmp_path_factory: pytest.TempPathFactory, tiny_dirs) -> Path:
    """The study directory (run once per session; later calls return the same directory)."""
    key = tmp_path_factory.getbasetemp()
    if key not in _BUILT:
        from lora_sweep.sweep.config.loader import load_study
        from lora_sweep.sweep.study import run_study

        root = tmp_path_factory.mktemp("fixture-study")
        path = write_study(root, tiny_dirs("llama"), "fixture", output=str(root / "runs"), budget={"trials": 8},
                           search={"rank": {"low": 2, "high": 20, "step": 2}, "rslora": [False, True],
                                   "lr": {"low": 1e-4, "high": 3e-2, "log": True},
                                   "targets": {"attn": ["q_proj", "v_proj"], "all": "all-linear"}},
                           evaluators=[{"name": "heldout_loss"}])
        run_study(load_study(path), log=lambda m: None)
        _BUILT[key] = root / "runs"
    return _BUILT[key]
