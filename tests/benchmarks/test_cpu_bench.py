"""``sweep bench --cpu`` runs the CPU training benchmark from benchmarks/ (imported inside the command) and prints
its table (a tiny size: timings are the command's business, not the test's)."""

from __future__ import annotations

from click.testing import CliRunner

from lora_sweep.cli import cli


def test_sweep_bench_cpu_runs_the_benchmark() -> None:
    result = CliRunner().invoke(cli, ["bench", "--cpu", "--adapters", "2", "--steps", "2", "--no-peft"])
    assert result.exit_code == 0, result.output
    assert "2 adapters x 2 steps" in result.output
    assert "packed (1 run, N slots)" in result.output and "sequential, engine 1 slot" in result.output
