"""``benchmarks.gpu_bench``'s arithmetic and printed summary: the FLOP counts behind MFU and HFU, and the table
(the runs themselves need a GPU; these functions do not)."""

from __future__ import annotations

import pytest
from transformers import AutoModelForCausalLM

from lora_sweep.benchmarks.gpu_bench import model_flops, recompute_flops, table
from lora_sweep.packer.model.packed import PackedModel
from lora_sweep.packer.model.store import SlotStore
from lora_sweep.packer.tiny.models import tiny_config

VOCAB, HIDDEN, LAYERS = 300, 64, 2


@pytest.fixture(scope="module", params=["plain", "packed"])
def model(request: pytest.FixtureRequest):  # noqa: ANN201
    """A tiny Llama (4 heads of 16, 2 KV heads, MLP width 128, untied head); ``packed``: its projections wrapped as
    a pack's step wraps them (``packed_run`` counts after training)."""
    base = AutoModelForCausalLM.from_config(tiny_config("llama", VOCAB, hidden_size=HIDDEN, num_layers=LAYERS))
    if request.param == "packed":
        pm = PackedModel(base, impl="torch")
        SlotStore(pm.model, pm.state, pm.layers, 2, 16, pm.device)
        assert pm.layers
    return base


# per decoder layer: q, o (64 x 64), k, v (64 -> 32: 2 KV heads of 16), gate, up, down (64 x 128), two norms (64)
LAYER = 2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 128 + 2 * 64
ADAPTER_PER_RANK = (64 + 64) * 2 + (64 + 32) * 2 + (64 + 128) * 3  # r * (D_in + D_out) over the seven projections


def test_model_flops_count_the_base_forward_and_backward_and_attention(model) -> None:  # noqa: ANN001
    counted = LAYERS * LAYER + HIDDEN + VOCAB * HIDDEN  # layers, the final norm, the head (not the embedding)
    rows, seq = 3, 16
    assert model_flops(model, rows, seq) == 4 * counted * rows * seq + 3 * 4 * LAYERS * seq**2 * HIDDEN * rows


def test_recompute_flops_are_one_more_forward_of_the_layers_base_and_lora(model) -> None:  # noqa: ANN001
    seq, row_ranks = 16, [4, 4, 16]  # a slot of rank 4 with two rows, one of rank 16 with one
    layers_fwd = 2 * LAYERS * LAYER * 3 * seq + 4 * LAYERS * seq**2 * HIDDEN * 3
    lora_fwd = 2 * LAYERS * ADAPTER_PER_RANK * (4 + 4 + 16) * seq
    assert recompute_flops(model, seq, row_ranks) == layers_fwd + lora_fwd
    # the recompute is a forward: about half of the base's model FLOPs (less the head, which runs once)
    ratio = recompute_flops(model, seq, row_ranks) / model_flops(model, 3, seq)
    assert 0.3 < ratio < 0.5


def test_table_ratio_against_peft_of_the_same_shape() -> None:
    rows = [
        {"gpu": "H200", "gemm_tflops": 795},  # the environment line has no workload: not a table row
        {"shape": "s", "workload": "W1", "mode": "packed-triton", "slots": 32, "step_ms": 256.4, "tok_s": 63910,
         "mfu": 0.17, "hfu": 0.17, "peak_gib": 33.2, "rank": 16},
        {"shape": "s", "workload": "W1", "mode": "packed-triton+ckpt", "slots": 32, "step_ms": 340.0,
         "tok_s": 48188, "mfu": 0.128, "hfu": 0.183, "peak_gib": 12.5, "rank": 16},
        {"shape": "s", "workload": "W1", "mode": "peft", "slots": 1, "step_ms": 217.0, "tok_s": 2360, "mfu": 0.006,
         "peak_gib": 3.8},
        {"shape": "t", "workload": "W1", "mode": "packed-triton", "slots": 4, "step_ms": 1.0, "tok_s": 10, "mfu": 0.5,
         "hfu": 0.5, "peak_gib": 1.0},
        {"workload": "W4", "shape": "4096->4096", "ratio": 1.193},
        {"shape": "s", "workload": "W1", "mode": "packed-triton", "slots": 64, "seq": 1024, "error": "out of memory"},
    ]
    lines = table(rows).splitlines()  # the row that ran out of memory (no tok_s) stopped the table on an H100
    assert len(lines) == 7 and lines[0].split()[7:10] == ["MFU", "HFU", "GiB"]
    assert lines[1].split()[:10] == ["W1", "s", "packed-triton", "32", "256.4", "63910", "17.0%", "17.0%", "33.2",
                                     "27.1"]
    assert lines[2].split()[6:10] == ["12.8%", "18.3%", "12.5", "20.4"]
    assert lines[3].split()[6:] == ["0.6%", "3.8", "1.0"]  # no HFU on the PEFT row: the column stays blank
    assert lines[3][lines[0].index("HFU"):lines[0].index("HFU") + 3].strip() == ""
    assert lines[4].split()[8:] == ["1.0"]  # shape t has no PEFT row: no ratio
    assert '"ratio": 1.193' in lines[5]
    assert lines[6].split()[:4] == ["W1", "s", "packed-triton", "64"] and '"error": "out of memory"' in lines[6]
