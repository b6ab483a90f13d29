"""A study with gradient accumulation (searched) and sample packing trains on the static-shape step, the one a CUDA
study runs (forced here: on the CPU the default is the dynamic step), and its trials train as on the dynamic one."""

from __future__ import annotations

import pytest

import lora_sweep.packer.train
import lora_sweep.sweep.study
from lora_sweep.sweep.loader import load_study
from lora_sweep.sweep.study import run_study
from tests.conftest import write_study


def _run(tmp_path, model_dir, name: str, static: bool, monkeypatch: pytest.MonkeyPatch):  # noqa: ANN001, ANN202
    train = lora_sweep.packer.train.train
    monkeypatch.setattr(lora_sweep.sweep.study, "train", lambda *a, **k: train(*a, **{**k, "static_shapes": static}))
    search = {"rank": [2, 4], "lr": {"low": 1e-3, "high": 3e-2, "log": True},
              "gradient_accumulation_steps": [1, 2, 3]}
    path = write_study(tmp_path, model_dir, name=name, search=search,
                       train={"max_steps": 8, "micro_batch": 2, "sample_packing": True},
                       pruning={"kind": "none"}, budget={"trials": 4})
    logged: list[str] = []
    summary = run_study(load_study(path), log=logged.append)
    return summary, [m for m in logged if "trained on the" in m]


def test_accumulating_sample_packed_study_on_the_static_step(tiny_dirs, tmp_path, monkeypatch) -> None:
    static, steps = _run(tmp_path, tiny_dirs("llama"), "static", True, monkeypatch)
    assert steps == ["pack 1: trained on the static-eager step (static shapes, eagerly)"]
    dynamic, _ = _run(tmp_path, tiny_dirs("llama"), "dynamic", False, monkeypatch)
    assert static.complete == dynamic.complete == 4
    assert static.steps == dynamic.steps and static.tokens == dynamic.tokens
