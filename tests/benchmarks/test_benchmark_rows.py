"""Every row the CPU-capable benchmarks print at their CPU shapes passes ``timing.check_row``: a positive, finite
time and throughput, tokens/s no faster than the CPU's measured GEMM rate allows at the model's FLOPs a token.
(``shard_bench --device cpu``, ``gpu_makespan --tiny`` and ``cpu_eval_bench`` rows are checked in their own tests.)"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest

from lora_sweep.benchmarks import packing_bench
from lora_sweep.benchmarks.cpu_bench import cpu_bench
from lora_sweep.benchmarks.timing import check_row, counted_params, gemm_tflops, step_flops
from lora_sweep.packer.model.load import load_base
from lora_sweep.packer.step.shapes import MAX_BUCKETS
from lora_sweep.packer.tiny.models import build_tiny_model


@pytest.fixture(scope="module")
def tiny_llama_ceiling() -> dict:
    """``check_row``'s ceiling for the benchmarks' tiny Llama on this CPU: its FLOPs a token and the GEMM rate."""
    with tempfile.TemporaryDirectory() as tmp:
        model, _ = load_base(str(build_tiny_model("llama", Path(tmp) / "m", seed=0)))
    return {"flops_per_token": step_flops(model.config, counted_params(model), 1, 1), "tflops": gemm_tflops("cpu")}


def test_packing_bench_rows(capsys: pytest.CaptureFixture[str], tiny_llama_ceiling: dict) -> None:
    packing_bench.main(["--slots", "2", "--micro", "4", "--row-len", "64", "--steps", "2", "--warmup", "1"])
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["mode"] for r in rows] == ["unpacked", "packed"]
    for row in rows:
        check_row(row, row["mode"], **tiny_llama_ceiling)
        assert row["real_tokens_per_step"] > 0 and 0 <= row["padding"] < 1
        assert row["tok_s"] == pytest.approx(row["real_tokens_per_step"] / row["step_ms"] * 1e3, rel=0.01)
        assert 1 <= row["shapes"] <= MAX_BUCKETS and row["graphs"] == 0 and row["reserved_gib"] is None  # CPU


def test_cpu_bench_rows(tiny_llama_ceiling: dict) -> None:
    result = cpu_bench(2, 2, repeats=1, progress=lambda _line: None)
    rows = result.rows()
    assert [r["mode"] for r in rows] == ["packed (1 run, N slots)", "sequential, engine 1 slot", "sequential, PEFT"]
    for row in rows:
        check_row(row, row["mode"], **tiny_llama_ceiling)
        assert row["tok_s"] == pytest.approx(result.tokens / row["wall_s"])
