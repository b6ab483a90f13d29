"""``benchmarks.variants_bench`` on the CPU: one shape's line with every timing finite, for a variant the pack trains;
a variant it does not train yet stops at AdapterSpec's one-line refusal."""

from __future__ import annotations

import json
import math

import pytest

from lora_sweep.benchmarks.variants_bench import main
from lora_sweep.errors import ConfigError

ARGS = ["--shape", "smollm2", "--layers", "1", "--device", "cpu", "--slots", "2", "--seq", "16", "--steps", "2",
        "--warmup", "1"]


def test_a_pissa_line_has_every_timing(capsys: pytest.CaptureFixture[str]) -> None:
    main(["--variant", "pissa", *ARGS])
    line = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert line["shape"] == "smollm2" and line["variant"] == "pissa"
    for key in ("pack_plain_ms", "pack_variant_ms", "peft_plain_ms", "peft_variant_ms", "pack_ratio", "peft_ratio"):
        assert math.isfinite(line[key]) and line[key] > 0, key


def test_dora_is_refused_until_the_pack_trains_it() -> None:
    with pytest.raises(ConfigError, match="dora: DoRA"):
        main(["--variant", "dora", *ARGS])
