"""The CPU evaluation benchmark runs (a tiny size; the real one is ``sweep bench --cpu-eval``)."""

from __future__ import annotations

from lora_sweep.benchmarks.cpu_eval_bench import cpu_eval_bench
from lora_sweep.benchmarks.timing import check_row


def test_cpu_eval_bench_reports_timings() -> None:
    lines: list[str] = []
    result = cpu_eval_bench(adapters=2, items=4, max_new_tokens=2, progress=lines.append)
    assert result.adapters == 2 and len(lines) == 6
    assert min(result.packed_loss_s, result.sequential_loss_s, result.packed_generation_s,
               result.sequential_generation_s, result.batched_loss_s, result.batched_generation_s) > 0
    assert "held-out loss" in result.table() and "generation" in result.table()
    assert len(result.rows()) == 6 and {r["way"] for r in result.rows()} == {"packed", "one at a time", "batched"}
    for row in result.rows():
        check_row(row, f"{row['evaluation']}, {row['way']}")
