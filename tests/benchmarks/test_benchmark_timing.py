"""``benchmarks.timing``: the one step timer (every step's own time, the losses read back after each) and the
plausibility check every benchmark row passes before it is printed, on the impossible rows an H200 run printed
(issue 38) and on real ones."""

from __future__ import annotations

import math
import time

import pytest
import torch

from lora_sweep.benchmarks.shapes import SHAPES
from lora_sweep.benchmarks.timing import (
    ImplausibleRow,
    check_row,
    counted_params,
    gemm_tflops,
    random_jobs,
    sig,
    step_flops,
    timed_steps,
)
from lora_sweep.packer.model.packed import PackedModel
from lora_sweep.packer.tiny.models import tiny_config

H200_GEMM = 795.0  # TFLOP/s, the bf16 8192^3 rate gemm_tflops measured on the H200 (BENCHMARKS.md)


def _meta_model(shape: str) -> torch.nn.Module:
    """A model of ``SHAPES[shape]`` on the meta device: its parameter count without its memory."""
    from transformers import AutoConfig, AutoModelForCausalLM

    kw = dict(SHAPES[shape])
    config = AutoConfig.for_model(kw.pop("model_type"), **kw)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def _per_token(shape: str) -> float:
    model = _meta_model(shape)
    return step_flops(model.config, counted_params(model), 1, 1)


def test_check_row_rejects_the_rows_packing_bench_printed_on_the_h200() -> None:
    """``step_ms 0.0`` and ``tok_s 118291465`` (the packed row at the 0.5B shape, its stamps bunched by 8)."""
    printed = {"mode": "packed", "step_ms": 0.0, "tok_s": 118291465}
    with pytest.raises(ImplausibleRow, match=r"packed 8 slots: step_ms = 0\.0"):
        check_row(printed, "packed 8 slots")
    per_token = _per_token("qwen2.5-0.5b")
    assert 1.5e9 < per_token < 2.5e9  # 4 FLOPs a weight: the 0.5B shape counts ~0.49B with its tied head
    with pytest.raises(ImplausibleRow, match=r"packed 8 slots: tok_s = 118291465 .* above the measured GEMM rate"):
        check_row(dict(printed, step_ms=1.3), "packed 8 slots", flops_per_token=per_token, tflops=H200_GEMM)


@pytest.mark.parametrize("field, value", [("mfu", 1.2), ("hfu", 1.01), ("step_s", -0.5), ("tokens_per_s", 0),
                                          ("step_ms", math.nan), ("tok_s", math.inf), ("mfu", None),
                                          ("makespan_s", "3.1"), ("mfu", 0.0)])
def test_check_row_names_the_row_and_the_field_it_rejects(field: str, value: object) -> None:
    row = {"step_ms": 788.2, "tok_s": 15590, "mfu": 0.622, field: value}
    with pytest.raises(ImplausibleRow, match=f"^llama3-8b 12 slots: {field} = "):
        check_row(row, "llama3-8b 12 slots")


def test_check_row_accepts_real_rows() -> None:
    """Rows BENCHMARKS.md holds from H200 runs: Qwen2.5-0.5B 32 x 1 x 512 on the CUDA-graph step, Llama-3-8B 12 x
    1024 at 62.2% MFU; and the tiny Llama's MFU on a GPU (1e-5: small, not zero)."""
    qwen = {"slots": 32, "step_ms": 118.74, "tok_s": 137984}
    assert check_row(qwen, "qwen", flops_per_token=_per_token("qwen2.5-0.5b"), tflops=H200_GEMM) is qwen
    llama = {"step_ms": 788.2, "tok_s": 15590, "mfu": 0.622, "hfu": 0.622, "error": None}
    assert check_row(llama, "llama", flops_per_token=_per_token("llama3-8b"), tflops=H200_GEMM) is llama
    check_row({"step_s": 0.0213, "tokens_per_s": 9014, "mfu": 5.3e-6}, "tiny")


def test_sig_keeps_a_small_figure() -> None:
    assert sig(5.3172e-6) == 5.317e-6 and round(5.3172e-6, 4) == 0.0
    assert sig(118.7449) == 118.7 and sig(0.62249, 3) == 0.622


def test_gemm_tflops_has_a_cpu_path() -> None:
    rate = gemm_tflops("cpu")
    assert math.isfinite(rate) and 1e-4 < rate < 100  # 2 shared cores to a large CPU's fp32


def _tiny_pack() -> PackedModel:
    from transformers import AutoModelForCausalLM

    config = tiny_config("llama", 300, hidden_size=64, num_layers=2)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return PackedModel(AutoModelForCausalLM.from_config(config), impl="torch")


def test_timed_steps_times_every_step_on_its_own_and_leaves_on_step_out() -> None:
    """Each global step reported alone, in order (the loop's default read-back would hand over 8 at once), and the
    caller's ``on_step`` (here 0.1 s each) outside every step's seconds."""
    pm = _tiny_pack()
    steps, seen = 5, []

    def slow(reports: list) -> None:  # noqa: ANN001
        seen.append([r.step for r in reports])
        time.sleep(0.1)

    t0 = time.perf_counter()
    timed = timed_steps(pm, random_jobs(2, 2, 16, 300, steps), 2, on_step=slow)
    wall = time.perf_counter() - t0
    assert seen == [[s, s] for s in range(steps)] and timed.result.steps == steps
    assert [[r.step for r in reps] for reps in timed.reports] == seen and len(timed.at) == steps
    # a step of the tiny pack takes milliseconds: stamps bunched by a late read-back would be microseconds apart
    assert min(timed.seconds) > 1e-3 and sum(timed.seconds) <= wall - 0.1 * steps
    assert timed.median(2) == sorted(timed.seconds[2:])[1]
    assert timed.input_tokens(0) == 2 * 2 * 16
    with pytest.raises(ValueError, match="none after a warm-up of 5"):
        timed.median(5)


def test_timed_steps_refuses_a_readback_override() -> None:
    with pytest.raises(ValueError, match="readback_every cannot be set"):
        timed_steps(_tiny_pack(), [], 1, readback_every=8)
