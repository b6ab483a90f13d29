"""``benchmarks.shard_bench`` and its PEFT + FSDP2 baseline (``benchmarks.shard_peft``) on the CPU.

Two gloo ranks (``--device cpu``; marked gpu: NCCL on 1 and 2 GPUs), a tiny Llama in bf16: the sharded pack and
the baseline both train and print their JSON line with finite numbers, on the same counted base and the same
adapter size (the baseline's trainable parameters are one slot's: like for like), and the table ends the output
with the pack's tokens/s over the baseline's. On a group of one: the baseline is sharded as torchtune shards it
(every decoder layer, in its checkpoint wrapper, then the root; the adapter inside its layer's unit), the base
frozen in bf16, the adapter fp32 with PEFT's init, and a step trains it.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from lora_sweep.benchmarks.shard_bench import _speed, main
from lora_sweep.benchmarks.shard_peft import peft_model, timed_peft_steps, trainable_params
from lora_sweep.benchmarks.timing import ImplausibleRow, check_row, step_flops
from lora_sweep.packer.tiny.models import tiny_config

VOCAB, HIDDEN, LAYERS, RANK = 300, 64, 2, 4
# per decoder layer: q, o (64 x 64), k, v (64 -> 32: 2 KV heads of 16), gate, up, down (64 x 128), two norms (64)
LAYER = 2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 128 + 2 * 64
ADAPTER = RANK * LAYERS * ((64 + 64) * 2 + (64 + 32) * 2 + (64 + 128) * 3)  # r * (D_in + D_out), seven projections
BASE = LAYERS * LAYER + HIDDEN + VOCAB * HIDDEN  # the layers, the final norm, the head (not the embedding)


def _run_both(config_dir: Path, device: str, world: int, capfd: pytest.CaptureFixture[str]) -> None:
    """``shard_bench`` with its baseline on ``world`` ranks of ``device``: both rows checked (module docstring)."""
    tiny_config("llama", VOCAB, hidden_size=HIDDEN, num_layers=LAYERS).save_pretrained(config_dir)
    slots, micro, seq = 3, 2, 32
    main(["--config", str(config_dir), "--device", device, "--gpus", str(world), "--slots", str(slots), "--micro",
          str(micro), "--seq", str(seq), "--rank", str(RANK), "--warmup", "1", "--steps", "2",
          "--activation-checkpointing", "--baseline", "peft"])
    out = capfd.readouterr().out.strip().splitlines()  # the ranks' processes write to this process's stdout
    rows = [json.loads(line) for line in out if line.startswith("{")]
    assert [row["run"] for row in rows] == ["pack", "peft"]
    pack, peft = rows
    per_token = step_flops(tiny_config("llama", VOCAB, hidden_size=HIDDEN, num_layers=LAYERS), BASE, 1, 1)
    for row in rows:
        assert "error" not in row and row["gpus"] == world and row["activation_checkpointing"] is True
        assert all(math.isfinite(row[k]) and row[k] > 0 for k in ("step_s", "tokens_per_s", "mfu"))
        check_row(row, row["run"], flops_per_token=per_token, tflops=row["gemm_tflops"] * world)
        assert row["tokens_per_s"] == pytest.approx(row["rows_per_step"] * seq / row["step_s"], rel=0.01)
        assert len(row["ranks"]) == world
        for mine in row["ranks"]:
            assert all(math.isfinite(v) and v >= 0 for v in mine.values())
            assert mine["peak_gib"] > 0  # (a tiny base shard rounds to 0.0 GiB)
    assert pack["adapter_params"] == peft["adapter_params"] == ADAPTER  # PEFT trains one slot's worth
    assert pack["base_params"] == peft["base_params"] == BASE  # MFU counts the same N
    assert (pack["adapters"], pack["rows_per_step"]) == (slots, slots * micro)
    assert (peft["adapters"], peft["rows_per_step"]) == (1, micro * world)  # data parallel: each rank its own rows
    assert peft["pack_over_peft"] == pytest.approx(pack["tokens_per_s"] / peft["tokens_per_s"], abs=1e-3)
    assert out[-1] == f"pack / peft tokens/s: {pack['tokens_per_s'] / peft['tokens_per_s']:.2f}x"
    assert out[-3].startswith("pack x3") and out[-2].startswith("peft x1")


def test_pack_and_peft_baseline_on_two_gloo_ranks(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    _run_both(tmp_path, "cpu", 2, capfd)


@pytest.mark.gpu
@pytest.mark.parametrize("world", [1, 2])
def test_pack_and_peft_baseline_on_gpus(tmp_path: Path, capfd: pytest.CaptureFixture[str], world: int) -> None:
    """NCCL, bf16 base and fp32 adapter on the GPUs (the pack on its Triton kernels): the H200 path before a 70B
    run, on 1 GPU and, where there are 2, on 2."""
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} CUDA device(s)")
    _run_both(tmp_path, "cuda", world, capfd)


def test_a_tiny_fast_step_keeps_its_mfu() -> None:
    """The GPU test's rows at a GPU's speed: the tiny Llama's 6 x 32 tokens in 21.3 ms on one rank of 795 TFLOP/s
    is an MFU of ~5e-6, a figure (rounded to 4 decimal places it printed 0.0: the H200 run's failure); a step no
    device could run is no row."""
    config = tiny_config("llama", VOCAB, hidden_size=HIDDEN, num_layers=LAYERS)
    row = _speed("pack", config, BASE, 6, 32, 0.0213, 795.0, 1)
    assert row["mfu"] == pytest.approx(step_flops(config, BASE, 6, 32) / 0.0213 / 1e12 / 795.0, rel=1e-3)
    assert 0 < row["mfu"] < 1e-4 and row["step_s"] == 0.0213 and row["tokens_per_s"] == round(6 * 32 / 0.0213)
    with pytest.raises(ImplausibleRow, match="pack x6 x 32: mfu = .* above the measured GEMM rate"):
        _speed("pack", config, BASE, 6, 32, 1e-13, 795.0, 1)


@pytest.fixture
def group_of_one(tmp_path: Path):  # noqa: ANN201
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_peft_baseline_is_sharded_as_torchtune_shards_it(group_of_one) -> None:
    config = tiny_config("llama", VOCAB, hidden_size=HIDDEN, num_layers=LAYERS)
    model = peft_model(config, rank=RANK, dtype="bfloat16", device=torch.device("cpu"), activation_checkpointing=True)
    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    assert units[0] is model and len(units) == LAYERS + 1
    assert all(isinstance(u, CheckpointWrapper) for u in units[1:])  # the wrapper, as torchtune shards it
    assert all(isinstance(p, DTensor) and not p.is_meta for p in model.parameters())  # every weight in a unit
    trained = {name: p for name, p in model.named_parameters() if p.requires_grad}
    assert len(trained) == 2 * 7 * LAYERS and all(".lora_A." in n or ".lora_B." in n for n in trained)
    assert trainable_params(model) == ADAPTER
    assert {p.dtype for p in trained.values()} == {torch.float32}
    assert {p.dtype for p in model.parameters() if not p.requires_grad} == {torch.bfloat16}
    a_weights = [p.full_tensor() for n, p in trained.items() if ".lora_A." in n]
    b_weights = {n: p for n, p in trained.items() if ".lora_B." in n}
    for a in a_weights:  # PEFT's Kaiming-uniform(a=sqrt(5)): bound 1 / sqrt(D_in)
        assert 0 < a.abs().max() <= 1 / math.sqrt(a.shape[1])
    assert all(not b.full_tensor().any() for b in b_weights.values())
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))
    assert timed_peft_steps(model, ids, warmup=1, steps=1) > 0
    assert all(b.full_tensor().any() for b in b_weights.values())  # AdamW moved every B off zero


def test_peft_baseline_needs_a_warmup_step() -> None:
    with pytest.raises(ValueError, match="warmup must be >= 1"):
        timed_peft_steps(torch.nn.Linear(2, 2), torch.zeros(1, 2), warmup=0, steps=1)
