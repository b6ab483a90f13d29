"""The fixture study shared by the report and export tests: built once per test session, in-process.

A tiny Llama, 8 trials of 12 steps packed 3 at a time: the community default, pruning at step 6 (so pruned
trials and backfills), ranks 2..20 in steps of 2 (most not a rank vLLM accepts, so exports get padded), rsLoRA
on and off, two objectives (held-out loss and adapter size: a Pareto front).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "studies" / "data"
_BUILT: dict[Path, Path] = {}


def study_doc(model_dir: Path, out: Path, name: str = "fixture") -> dict:
    return {
        "name": name,
        "seed": 0,
        "model": {"path": str(model_dir), "device": "cpu"},
        "data": {"train": str(DATA / "arith-train.jsonl"), "eval": str(DATA / "arith-eval.jsonl"),
                 "format": "prompt_completion", "max_length": 48},
        "search": {"rank": {"low": 2, "high": 20, "step": 2}, "rslora": [False, True],
                   "lr": {"low": 1e-4, "high": 3e-2, "log": True},
                   "targets": {"attn": ["q_proj", "v_proj"], "all": "all-linear"}},
        "train": {"max_steps": 12, "micro_batch": 4},
        "objectives": [{"metric": "eval_loss", "direction": "minimize"},
                       {"metric": "adapter_params", "direction": "minimize"}],
        "budget": {"trials": 8},
        "pruning": {"kind": "cohort_sha", "rungs": [6], "reduction_factor": 2},
        "packing": {"max_slots": 3},
        "evaluators": [{"name": "heldout_loss"}],
        "output": str(out),
    }


def fixture_study(tmp_path_factory: pytest.TempPathFactory, tiny_dirs) -> Path:
    """The study directory (run once per session; later calls return the same directory)."""
    key = tmp_path_factory.getbasetemp()
    if key not in _BUILT:
        from sweep.spec import load_study
        from sweep.study import run_study

        root = tmp_path_factory.mktemp("fixture-study")
        path = root / "fixture.yaml"
        path.write_text(yaml.safe_dump(study_doc(tiny_dirs("llama"), root / "runs")))
        run_study(load_study(path), log=lambda m: None)
        _BUILT[key] = root / "runs"
    return _BUILT[key]
