"""A study with gradient accumulation (searched) and sample packing trains on the one training step (eagerly on the
CPU), and says so: in the log, on the pack's row of results.db, in ``sweep status`` and in the HTML report."""

from __future__ import annotations

from lora_sweep.reports.html import build_report
from lora_sweep.store.api import ResultsStore, StudyDir
from lora_sweep.sweep.config.loader import load_study
from lora_sweep.sweep.status import study_status
from lora_sweep.sweep.study import run_study
from tests.conftest import write_study


def test_accumulating_sample_packed_study_says_which_step_it_ran(tiny_dirs, tmp_path) -> None:
    search = {"rank": [2, 4], "lr": {"low": 1e-3, "high": 3e-2, "log": True},
              "gradient_accumulation_steps": [1, 2, 3]}
    path = write_study(tmp_path, tiny_dirs("llama"), name="static", search=search,
                       train={"max_steps": 8, "micro_batch": 2, "sample_packing": True},
                       pruning={"kind": "none"}, budget={"trials": 4})
    spec = load_study(path)
    logged: list[str] = []
    summary = run_study(spec, log=logged.append)
    assert [m for m in logged if "trained on the" in m] == [
        "pack 1: trained on the eager step (fixed shapes, eagerly)"]
    assert summary.complete == 4 and summary.steps > 0 and summary.tokens > 0
    root = StudyDir(spec.out_dir).root
    with ResultsStore(StudyDir(root).results_db, create=False) as store:
        assert [(p.status, p.step) for p in store.packs()] == [("finished", "eager")]
        assert [len(c) for c in store.curves().values()] == [8] * 4  # every trial's 8 optimizer steps
    assert [p["step"] for p in study_status(root)["packs"]] == ["eager"]
    assert "Training step: pack 1: eager" in build_report(root)
