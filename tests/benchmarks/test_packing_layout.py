"""``packing_bench --layout``: what a slot's steps hold on a real dataset, unpacked and sample-packed, without
training (BENCHMARKS.md reads the GPU demo's packing cost against it)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lora_sweep.benchmarks import packing_bench
from lora_sweep.packer.tiny.models import build_tiny_model

DATA = Path(__file__).resolve().parents[2] / "studies" / "data" / "codes-train.jsonl"


def test_layout_counts_positions_tokens_and_examples_per_step(tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    model_dir = build_tiny_model("llama", tmp_path / "m", seed=0)
    packing_bench.main(["--layout", str(DATA), "--tokenizer", str(model_dir), "--format", "prompt_completion",
                        "--micro", "8", "--row-len", "128"])
    unpacked, packed = (json.loads(line) for line in capsys.readouterr().out.splitlines())
    assert (unpacked["mode"], packed["mode"]) == ("unpacked", "packed")
    assert unpacked["examples_per_step"] == 8  # one example a row, padded to the step's longest
    assert 0.95 * 8 * 128 <= packed["positions_per_step"] <= 8 * 128  # 8 rows filled (an epoch's last: shorter)
    assert unpacked["real_tokens_per_step"] <= unpacked["positions_per_step"]
    assert packed["real_tokens_per_step"] <= packed["positions_per_step"]
    assert packed["examples_per_step"] > 2 * unpacked["examples_per_step"]  # short rows: several to a packed row
