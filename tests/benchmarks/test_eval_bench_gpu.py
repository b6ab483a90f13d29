"""``eval_bench_gpu``'s documented CPU smoke run (``--device cpu``, one layer, two slots): the benchmark builds its
pack and runs the evaluations through the packer's own calls, so a change of theirs fails here rather than first on
the device."""

from __future__ import annotations

from lora_sweep.benchmarks.eval_bench_gpu import build_pack, random_items, run_pass
from lora_sweep.benchmarks.shapes import SMOLLM2


def test_a_cpu_pass_runs_every_evaluation_and_the_warm_pass_captures_nothing_new() -> None:
    pm = build_pack(2, "cpu", layers=1)
    examples, prompts = random_items(4, SMOLLM2["vocab_size"])
    cold = run_pass(pm, examples, prompts, groups=(2, 1), rung_groups=(2,), new_tokens=2, batch_size=4)
    warm = run_pass(pm, examples, prompts, groups=(2, 1), rung_groups=(2,), new_tokens=2, batch_size=4)
    for row in (cold, warm):
        assert row["forwards"] > 0 and row["heldout_s"] > 0 and row["generation_s"] > 0 and row["rung_s"] > 0
    assert warm["forwards"] == cold["forwards"] and warm["graphs"] == cold["graphs"]
