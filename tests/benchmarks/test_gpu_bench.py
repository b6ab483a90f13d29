"""``benchmarks.gpu_bench.table``: the printed summary of a GPU run (the run itself needs a GPU)."""

from __future__ import annotations

from lora_sweep.benchmarks.gpu_bench import table


def test_table_ratio_against_peft_of_the_same_shape() -> None:
    rows = [
        {"gpu": "H200", "gemm_tflops": 795},  # the environment line has no workload: not a table row
        {"shape": "s", "workload": "W1", "mode": "packed-triton", "slots": 32, "step_ms": 256.4, "tok_s": 63910,
         "mfu": 0.17, "peak_gib": 33.2, "rank": 16},
        {"shape": "s", "workload": "W1", "mode": "peft", "slots": 1, "step_ms": 217.0, "tok_s": 2360, "mfu": 0.006,
         "peak_gib": 3.8},
        {"shape": "t", "workload": "W1", "mode": "packed-triton", "slots": 4, "step_ms": 1.0, "tok_s": 10, "mfu": 0.5,
         "peak_gib": 1.0},
        {"workload": "W4", "shape": "4096->4096", "ratio": 1.193},
    ]
    lines = table(rows).splitlines()
    assert len(lines) == 5 and "x PEFT" in lines[0]
    assert lines[1].split()[:9] == ["W1", "s", "packed-triton", "32", "256.4", "63910", "17.0%", "33.2", "27.1"]
    assert lines[2].split()[8] == "1.0"
    assert lines[3].split()[7:] == ["1.0"]  # shape t has no PEFT row: no ratio
    assert '"ratio": 1.193' in lines[4]
