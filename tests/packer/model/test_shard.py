"""A pack whose frozen base is sharded with FSDP2 over 2 gloo processes trains every slot as the same pack unsharded.

Two CPU processes, tiny Llama, fp32: per-step losses within 1e-5 relative and final A/B within 1e-4 of the
unsharded pack run in this process, through a slot that finishes early and is refilled with a new adapter and a
slot pruned by ``should_stop``; every slot scored from the sharded pack as it ends (held-out loss, generation) as
from the unsharded one; the ranks' replicas are identical and each rank holds fewer parameter bytes.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors import safe_open

from lora_sweep.errors import ConfigError
from lora_sweep.evaluators.registry import EvalData, evaluate
from lora_sweep.packer.data.rows import SlotStream, read_jsonl
from lora_sweep.packer.model import shard_load
from lora_sweep.packer.model.load import load_base
from lora_sweep.packer.model.packed import PackedModel
from lora_sweep.packer.model.shard import base_share, decoder_layers, is_sharded, local_param_bytes, shard_base
from lora_sweep.packer.model.shard_load import load_sharded, meta_model
from lora_sweep.packer.plan import AdapterSpec
from lora_sweep.packer.step.launch import spawn
from lora_sweep.packer.step.train import SlotEnd, SlotJob, StepReport, train
from tests.conftest import DEMO_DATA, Recorder, random_examples

PAD = 0
STEPS = 6
PRUNED, PRUNE_AT = 2, 3
"""Job 2 is stopped by ``should_stop`` after its 3rd step."""

SPECS = [
    AdapterSpec(rank=2, alpha=4, lr=3e-3, micro_batch=1, targets=("q_proj", "v_proj"), max_steps=3, seed=1),
    AdapterSpec(rank=4, alpha=16, lr=1e-2, micro_batch=2, targets=("all-linear",), max_steps=STEPS, seed=2,
                rslora=True, weight_decay=0.1, warmup_steps=2, schedule="cosine"),
    AdapterSpec(rank=8, alpha=8, lr=5e-3, micro_batch=3, targets=("o_proj", "down_proj"), max_steps=STEPS, seed=3,
                max_grad_norm=0.05, schedule="linear", warmup_steps=2),
    AdapterSpec(rank=16, alpha=32, lr=2e-3, micro_batch=2, targets=("gate_proj", "up_proj", "k_proj"),
                max_steps=STEPS, seed=4, betas=(0.8, 0.95)),
    AdapterSpec(rank=4, alpha=8, lr=8e-3, micro_batch=2, targets=("all-linear",), max_steps=4, seed=5),
]
"""Job 0 ends after 3 steps and job 4 refills its slot; job 2 is pruned."""
STEPS_RUN = {"plain": (False, False), "ckpt": (True, False), "meta": (False, True)}
"""Run name -> (activation checkpointing, built on meta and loaded by rows), of the sharded runs."""
EVALUATORS = [("heldout_loss", None), ("generation", {"max_new_tokens": 4, "batch_size": 2})]


class _Counted:
    """safetensors' ``safe_open`` counting the bytes of every tensor its handles give out (``get_tensor``,
    ``get_slice(name)[rows]``), whichever the loader calls: what a rank read of the checkpoint, counted outside it."""

    read = 0

    def __init__(self, *args: object, **kwargs: object) -> None:
        self.f = safe_open(*args, **kwargs)

    def __enter__(self) -> _Counted:
        self.f.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.f.__exit__(*exc)

    def keys(self) -> list[str]:
        return self.f.keys()

    def get_tensor(self, name: str) -> torch.Tensor:
        return self._count(self.f.get_tensor(name))

    def get_slice(self, name: str) -> _CountedSlice:
        return _CountedSlice(self.f.get_slice(name))

    @staticmethod
    def _count(t: torch.Tensor) -> torch.Tensor:
        _Counted.read += t.numel() * t.element_size()
        return t


class _CountedSlice:
    def __init__(self, sliced: object) -> None:
        self.sliced = sliced

    def get_shape(self) -> list[int]:
        return self.sliced.get_shape()

    def __getitem__(self, index: object) -> torch.Tensor:
        return _Counted._count(self.sliced[index])


def _jobs() -> list[SlotJob]:
    return [SlotJob(spec, SlotStream(random_examples(30, seed=100 + i), spec.micro_batch, seed=spec.seed), key=i)
            for i, spec in enumerate(SPECS)]


def _prune(report: StepReport) -> bool:
    return report.key == PRUNED and report.slot_step >= PRUNE_AT


def train_pack(model_dir: Path, shard: bool, ckpt: bool = False, meta: bool = False) -> dict:
    """Train the jobs in a 4-slot pack (its base sharded over the default process group if ``shard``, loaded whole
    and then sharded, or with ``meta`` built on the meta device and each rank's shard read by rows; on the
    eager step; each decoder layer recomputed in the backward if ``ckpt``), each job
    scored as it ends (held-out loss and generation, as the sweep scores them); returns per-key losses, final (A, B)
    and metrics, how the jobs ended, this rank's parameter bytes before and after sharding, what ``base_share``
    counts of them, the base's buffers and, with ``meta``, the bytes read from the checkpoint (as the loader
    counts them, as safetensors gave them out)."""
    world, rank = (dist.get_world_size(), dist.get_rank()) if shard else (1, 0)
    read = None
    if meta:
        whole = meta_model(model_dir, "float32", "eager")  # nothing allocated: only the sizes are read
        before, share = local_param_bytes(whole), base_share(whole, world, rank)
        shard_load.safe_open = _Counted  # this process's loads count what the checkpoint gives out
        _Counted.read = 0
        loaded = load_sharded(str(model_dir), dtype="float32", device="cpu", attn_implementation="eager")
        assert loaded.stats is not None, "the tiny safetensors checkpoint must load by rows"
        pm, tokenizer, read = loaded.pm, loaded.tokenizer, (loaded.stats.read_bytes, _Counted.read)
    else:
        model, tokenizer = load_base(str(model_dir), attn_implementation="eager")
        pm = PackedModel(model)
        before = local_param_bytes(pm.model)
        share = base_share(pm.model, world, rank) if shard else None
        if shard:
            shard_base(pm)
    after = local_param_bytes(pm.model)
    buffers = {name: b.detach().clone() for name, b in pm.model.named_buffers()}
    queue, rec, metrics, texts = _jobs(), Recorder(pm), {}, {}
    fmt, rows = read_jsonl(DEMO_DATA / "arith-eval.jsonl")
    data = EvalData(rows[:4], fmt, tokenizer, max_length=48)

    def on_end(ends: list[SlotEnd]) -> None:  # every rank scores together: the forwards gather the same layers
        rec.on_end(ends)
        scored = evaluate(pm, [e.slot for e in ends], data, EVALUATORS)
        metrics.update({e.job.key: scored.metrics[e.slot] for e in ends})
        texts.update({e.job.key: [r["generation"] for r in scored.samples[e.slot] if "generation" in r] for e in ends})

    result = train(pm, 4, lambda slot: queue.pop(0) if queue else None, pad_id=PAD, on_step=rec.on_step,
                   should_stop=_prune, on_end=on_end, cuda_graphs="off",
                   readback_every=1, activation_checkpointing=ckpt)
    assert result.step == "eager"
    return {"losses": dict(rec.losses), "final": rec.final, "metrics": metrics, "texts": texts,
            "ended": sorted(result.ended), "bytes": (before, after),
            "share": None if share is None else (share.whole, share.shard, share.peak, share.load_peak),
            "read": read, "buffers": buffers}


def _rank(rank: int, world: int, model_dir: Path, out: Path) -> None:
    for step, (ckpt, meta) in STEPS_RUN.items():  # in one pair of processes: starting them is most of the time
        torch.save(train_pack(model_dir, shard=True, ckpt=ckpt, meta=meta), out / f"rank{rank}-{step}.pt")


def _assert_same_training(got: dict, ref: dict) -> None:
    assert got["ended"] == ref["ended"]
    assert got["losses"].keys() == ref["losses"].keys() == set(range(len(SPECS)))
    for key, losses in ref["losses"].items():
        torch.testing.assert_close(torch.tensor(got["losses"][key]), torch.tensor(losses), rtol=1e-5, atol=0)
    assert got["metrics"].keys() == ref["metrics"].keys() == set(range(len(SPECS)))
    for key, values in ref["metrics"].items():
        assert got["metrics"][key] == pytest.approx(values, rel=1e-5)
        assert got["texts"][key] == ref["texts"][key] and len(ref["texts"][key]) == 4  # the same greedy answers
    for key, weights in ref["final"].items():
        assert got["final"][key].keys() == weights.keys()
        for path, (a, b) in weights.items():
            torch.testing.assert_close(got["final"][key][path][0], a, rtol=0, atol=1e-4)
            torch.testing.assert_close(got["final"][key][path][1], b, rtol=0, atol=1e-4)


@pytest.fixture(scope="module")
def two_ranks(tiny_dirs, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Directory of what each of 2 gloo ranks trained, sharded, with and without activation checkpointing."""
    out = tmp_path_factory.mktemp("ranks")
    spawn(_rank, 2, tiny_dirs("llama"), out)
    return out


@pytest.mark.parametrize("step", list(STEPS_RUN))
def test_sharded_pack_trains_as_unsharded(tiny_dirs, two_ranks: Path, step: str) -> None:
    """The reference is never checkpointed: recomputing a layer inside its FSDP unit (gathered again for the
    recompute) changes nothing either."""
    ref = train_pack(tiny_dirs("llama"), shard=False)
    # the lifecycle this test is about: job 0 finished early and was refilled by job 4, job 2 was pruned
    assert (0, 3, "finished") in ref["ended"] and (4, 4, "finished") in ref["ended"]
    assert (PRUNED, PRUNE_AT, "stopped") in ref["ended"]
    ranks = [torch.load(two_ranks / f"rank{r}-{step}.pt") for r in range(2)]
    for got in ranks:
        _assert_same_training(got, ref)
    for key, weights in ranks[0]["final"].items():  # the replicas are bitwise the same (rank 0's gradients)
        for path, (a, b) in weights.items():
            assert torch.equal(a, ranks[1]["final"][key][path][0]) and torch.equal(b, ranks[1]["final"][key][path][1])
    for got in ranks:  # what the planner counts of the base per rank is what each rank holds
        before, after = got["bytes"]
        assert before == ref["bytes"][0] and after < before
        whole, shard, peak, load_peak = got["share"]
        assert whole + shard == after and peak > after and after < load_peak < peak
        assert got["buffers"].keys() == ref["buffers"].keys() and ref["buffers"]  # the rotary inv_freq recomputed
        for name, b in ref["buffers"].items():
            assert torch.equal(got["buffers"][name], b), name
    if step == "meta":
        _assert_read_by_rows(ranks, ref, [torch.load(two_ranks / f"rank{r}-plain.pt") for r in range(2)])


def _assert_read_by_rows(ranks: list[dict], ref: dict, loaded_whole: list[dict]) -> None:
    """Built on meta, each rank read from the checkpoint its shard's rows and the head (kept whole) and nothing
    else: both ranks' reads add up to the base once plus the head twice (no rank read a sharded tensor whole), as
    the loader counted and as safetensors gave them out; the pack trained bitwise as the one loaded whole and then
    sharded (the same shards)."""
    full = ref["bytes"][0]
    reads = []
    for got in ranks:
        whole, shard, _, _ = got["share"]
        counted, given = got["read"]
        assert counted == given == whole + shard and shard < full - whole
        reads.append(given)
    assert sum(reads) == full + ranks[0]["share"][0]
    for got, other in zip(ranks, loaded_whole, strict=True):
        assert got["losses"] == other["losses"]
        for key, weights in other["final"].items():
            for path, (a, b) in weights.items():
                assert torch.equal(got["final"][key][path][0], a) and torch.equal(got["final"][key][path][1], b)


def test_world_of_one_runs_the_sharded_path(tiny_dirs, tmp_path: Path) -> None:
    model_dir = tiny_dirs("llama")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        got = train_pack(model_dir, shard=True)
    finally:
        dist.destroy_process_group()
    assert got["bytes"][1] == got["bytes"][0]  # one rank holds every shard
    assert got["share"][2] == got["bytes"][0]
    _assert_same_training(got, train_pack(model_dir, shard=False))


def test_shard_before_slots_and_layers_found(tiny_dirs, tmp_path: Path) -> None:
    model, _ = load_base(str(tiny_dirs("llama")), attn_implementation="eager")
    pm = PackedModel(model)
    assert len(decoder_layers(model)) == model.config.num_hidden_layers
    pm.add_slot(0, SPECS[0])
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        with pytest.raises(ConfigError, match="before adding slots"):
            shard_base(pm)
    finally:
        dist.destroy_process_group()
    assert not is_sharded(model)
