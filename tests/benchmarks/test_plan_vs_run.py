"""The plan-vs-run benchmark reads the plan's total from the plan's own table and reports the ratio."""

from __future__ import annotations

import pytest

from lora_sweep.benchmarks.plan_vs_run import PlanVsRun, predicted_seconds
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
