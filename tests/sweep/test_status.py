"""``sweep status``: a pack whose CUDA-graph capture failed says so, with its configuration and cause."""

from __future__ import annotations

from pathlib import Path

import pytest

from lora_sweep.store.api import ResultsStore, StudyDir
from lora_sweep.sweep.status import render, study_status

WHY = ("FalconForCausalLM (sdpa attention, base ops eager, dropout): RuntimeError: Cannot copy between CPU and CUDA "
       "tensors during CUDA graph capture unless the CPU tensor is pinned. (at falcon/modeling_falcon.py:283 in "
       "_split_heads)")


def test_a_packs_capture_fallback_is_recorded_and_shown(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    sdir = StudyDir(tmp_path / "s").create()
    sdir.write_study_yaml("name: s\n")
    with ResultsStore(sdir.results_db) as store:
        store.set_meta(name="s", objectives=["eval_loss"], directions=["minimize"])
        captured, eager = store.start_pack(slots=2, device="cuda:0"), store.start_pack(slots=2, device="cuda:0")
        store.finish_pack(captured, steps=3, step="cuda-graph")
        store.finish_pack(eager, steps=3, step="eager", fallback=WHY)
        assert [p.fallback for p in store.packs()] == [None, WHY]
    info = study_status(sdir.root)
    assert [(p["step"], p["fallback"]) for p in info["packs"]] == [("cuda-graph", None), ("eager", WHY)]
    render(info)
    lines = [line for line in capsys.readouterr().out.splitlines() if "capture failed" in line]
    assert lines == [f"pack {eager}: CUDA graph capture failed, trained eagerly: {WHY}"]
