"""``benchmarks.variants_bench`` on the CPU: one shape's line with every timing finite."""

from __future__ import annotations

import json
import math

import pytest

from lora_sweep.benchmarks.variants_bench import main

ARGS = ["--shape", "smollm2", "--layers", "1", "--device", "cpu", "--slots", "2", "--seq", "16", "--steps", "2",
        "--warmup", "1"]


@pytest.mark.parametrize("variant", ["pissa", "dora"])
def test_a_variant_line_has_every_timing(capsys: pytest.CaptureFixture[str], variant: str) -> None:
    main(["--variant", variant, *ARGS])
    line = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert line["shape"] == "smollm2" and line["variant"] == variant
    for key in ("pack_plain_ms", "pack_variant_ms", "peft_plain_ms", "peft_variant_ms", "pack_ratio", "peft_ratio"):
        assert math.isfinite(line[key]) and line[key] > 0, key

