"""The plan-vs-run benchmark reads the plan's total from the plan's own table and reports the ratio."""

from __future__ import annotations

import pytest

from lora_sweep.benchmarks.plan_vs_run import PlanVsRun, plan_row, plan_total, predicted_seconds, run_steps
from lora_sweep.sweep.planning import PlanReport


def test_it_reads_the_total_the_plan_prints() -> None:
    from lora_sweep.packer.plan import MemoryModel

    mm = MemoryModel(base_bytes=0, bytes_per_token=0, bytes_per_token_rank=0, bytes_per_param=16)
    report = PlanReport("cpu", 8, 32, 8, 64, 1 << 30, 1 << 20, mm, 0.1, 46.7, 467, predicted_eval_s=12.0,
                        startup_s=9.0)
    assert predicted_seconds(report.table()) == round(46.7 + 12.0 + 9.0)
    with pytest.raises(ValueError, match="no predicted time"):
        predicted_seconds(PlanReport("cpu", 8, 32, 8, 64, 1 << 30, 1 << 20, mm, 0.1, None, None).table())


def test_a_row_gives_the_ratio_of_predicted_to_measured() -> None:
    row = PlanVsRun("tiny-demo.yaml", 90.0, 100.0, 1.5, 2.0)
    assert row.ratio == pytest.approx(0.9)
    assert row.row() == "| tiny-demo.yaml | 90 | 100 | 0.90 | 1.5 / 2.0 |"


def test_the_split_puts_the_plans_parts_beside_the_runs_phases() -> None:
    """``--split``: what the plan's total counts (its line's parenthesis, the turnover and storage among them) beside
    the run's own split, so a gap can be read part by part."""
    from lora_sweep.packer.plan import MemoryModel

    mm = MemoryModel(base_bytes=0, bytes_per_token=0, bytes_per_token_rank=0, bytes_per_param=16)
    report = PlanReport("cpu", 8, 32, 8, 64, 1 << 30, 1 << 20, mm, 0.1, 46.7, 467, predicted_eval_s=12.0,
                        startup_s=9.0, turnover_s=2.0, storage_s=3.0)
    total, parts = plan_total(report.table())
    assert total == round(46.7 + 12.0 + 9.0 + 2.0 + 3.0)
    assert parts == ("467 pack steps: training 47 s, evaluation 12 s, slot turnover 2 s, storage 3 s, start-up 9 s")
    row = PlanVsRun("tiny-demo.yaml", total, 80.0, 1.0, 1.1, parts, {"import": 4.0, "train": 50.0, "other": 0.01},
                    "median of 12 steps", 467, "3.0 s: 24 trials")
    assert row.split() == (f"tiny-demo.yaml: plan: {parts}\ntiny-demo.yaml: plan's step: median of 12 steps\n"
                           f"tiny-demo.yaml: plan's storage: 3.0 s: 24 trials\n"
                           f"tiny-demo.yaml: run (467 pack steps): import 4.0 s, train 50.0 s")


def test_it_reads_the_plans_rows_and_the_runs_pack_steps() -> None:
    """The plan's ``sized pack's step`` row (how many steps it timed), its storage row, and the run's summary line's
    pack steps, to read a step's seconds on both sides."""
    from lora_sweep.packer.plan import MemoryModel
    from lora_sweep.sweep.pack_step import PackStep

    mm = MemoryModel(base_bytes=0, bytes_per_token=0, bytes_per_token_rank=0, bytes_per_param=16)
    timed = PackStep(8, 4, 64, 60.0, 0.1, "median of 31 steps of 8 slots x 4 rows x 64 tokens, eager step")
    table = PlanReport("cpu", 8, 32, 8, 64, 1 << 30, 1 << 20, mm, 0.1, 46.7, 467, timed=timed, storage_s=2.5,
                       storage_note="2.5 s: 24 trials asked").table()
    assert plan_row(table, "sized pack's step") == "median of 31 steps of 8 slots x 4 rows x 64 tokens, eager step"
    assert plan_row(table, "predicted storage") == "2.5 s: 24 trials asked"
    assert plan_row("predicted time for the trial budget  60 s", "sized pack's step") == ""
    run = "tiny-demo: 20 complete, 4 pruned, 0 failed in 61.2 s (480 packed steps); study in runs/tiny-demo\n"
    assert run_steps(run) == 480 and run_steps("") == 0
