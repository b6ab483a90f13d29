"""Every tiny family's base shards with FSDP2 over 2 gloo ranks, loaded by rows, and runs as it runs unsharded.

One pair of processes (starting them costs seconds) loops over the families: each rank builds the family's base on
meta and reads its shard's rows from the checkpoint (``load_sharded``: never the whole-load fallback), then takes
the logits of ``PackedModel.forward`` (the causal LM's own forward: OPT's calls ``model.decoder`` past
``OPTModel``, so FSDP's root unit must be the decoder, ``decoder_body``) and trains a 1-slot pack 2 steps (the
loss through ``forward_hidden`` and the head, or the whole logits where the family post-processes them). The
reference is the same base loaded whole in this process, unsharded. A model with no decoder body apart from its
head is refused in one line naming the family.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lora_sweep.errors import ConfigError
from lora_sweep.packer.data.rows import SlotStream
from lora_sweep.packer.model.load import load_base
from lora_sweep.packer.model.packed import PackedModel
from lora_sweep.packer.model.shard import base_share, decoder_body, decoder_layers, local_param_bytes, shard_base
from lora_sweep.packer.model.shard_load import load_sharded, meta_model
from lora_sweep.packer.plan import AdapterSpec
from lora_sweep.packer.step.launch import spawn
from lora_sweep.packer.step.train import SlotJob, train
from lora_sweep.packer.tiny.models import FAMILIES
from tests.conftest import Recorder, random_examples

SPEC = AdapterSpec(rank=4, alpha=8, lr=1e-2, micro_batch=2, targets=("all-linear",), max_steps=2, seed=1)
IDS = torch.randint(3, 250, (2, 9), generator=torch.Generator().manual_seed(0))
MASK = torch.ones_like(IDS)
MASK[1, 6:] = 0  # right padding, as collate pads


def run_pack(model_dir: Path, shard: bool) -> dict:
    """The base's logits (``PackedModel.forward``) and a 1-slot pack's per-step losses and final (A, B) over 2
    steps: sharded over the default process group and loaded by rows if ``shard`` (with what this rank read and
    what ``base_share`` counts it holds), else loaded whole."""
    got: dict = {}
    if shard:
        whole = meta_model(model_dir, "float32", "eager")
        share = base_share(whole, dist.get_world_size(), dist.get_rank())
        loaded = load_sharded(str(model_dir), dtype="float32", device="cpu", attn_implementation="eager")
        pm = loaded.pm
        got["read"] = None if loaded.stats is None else loaded.stats.read_bytes
        got["share"] = (share.whole, share.shard, local_param_bytes(whole), local_param_bytes(pm.model))
    else:
        pm = PackedModel(load_base(str(model_dir), attn_implementation="eager")[0])
    with torch.no_grad():
        got["logits"] = pm.forward(IDS, MASK, None)  # (2, 9, V)
    queue = [SlotJob(SPEC, SlotStream(random_examples(8, seed=7, vocab=250), SPEC.micro_batch, seed=SPEC.seed), 0)]
    rec = Recorder(pm)
    train(pm, 1, lambda slot: queue.pop() if queue else None, pad_id=0, on_step=rec.on_step, on_end=rec.on_end,
          cuda_graphs="off", readback_every=1)
    got["losses"], got["final"] = rec.losses[0], rec.final[0]
    return got


def _ranks(rank: int, world: int, dirs: dict[str, Path], out: Path) -> None:
    for family, model_dir in dirs.items():
        torch.save(run_pack(model_dir, shard=True), out / f"{family}-rank{rank}.pt")


@pytest.fixture(scope="module")
def sharded(tiny_dirs, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Directory of what each of 2 gloo ranks ran of every family."""
    out = tmp_path_factory.mktemp("families")
    spawn(_ranks, 2, {family: tiny_dirs(family) for family in FAMILIES}, out)
    return out


@pytest.mark.slow  # one spawn of 2 ranks over every family: ~20 s on 2 cores
@pytest.mark.parametrize("family", FAMILIES)
def test_family_shards_loads_by_rows_and_runs_as_unsharded(tiny_dirs, sharded: Path, family: str) -> None:
    ref = run_pack(tiny_dirs(family), shard=False)
    assert len(ref["losses"]) == 2
    ranks = [torch.load(sharded / f"{family}-rank{r}.pt") for r in range(2)]
    reads = []
    for got in ranks:
        torch.testing.assert_close(got["logits"], ref["logits"], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref["losses"]), rtol=1e-5, atol=0)
        assert got["final"].keys() == ref["final"].keys()
        for path, (a, b) in ref["final"].items():
            torch.testing.assert_close(got["final"][path][0], a, rtol=0, atol=1e-4)
            torch.testing.assert_close(got["final"][path][1], b, rtol=0, atol=1e-4)
        whole, shard, full, held = got["share"]
        assert got["read"] is not None, f"{family} fell back to the whole load"
        assert held == whole + shard < full  # the rank holds its shard and the parameters kept whole
        assert got["read"] == whole + shard  # and read exactly those from the checkpoint, no tensor of the shard whole
        reads.append(got["read"])
    assert sum(reads) == ranks[0]["share"][2] + ranks[0]["share"][0]  # the base once, what is kept whole twice


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)


class _Flat(nn.Module):
    """A causal LM holding its embeddings and decoder layers beside its head: no body to shard apart from it."""

    _no_split_modules = ["_Block"]

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.layers = nn.ModuleList([_Block(), _Block()])
        self.head = nn.Linear(8, 16)

    def get_input_embeddings(self) -> nn.Module:
        return self.embed


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_a_meta_models_buffers_are_the_whole_loads(tiny_dirs, dtype: str) -> None:
    """Every family's buffers on the meta-built model (what a rows load keeps of the constructor) are
    ``from_pretrained``'s, bitwise and in the same dtype: in bf16, GPT-J's and CodeGen's sinusoidal position
    tables computed at construction kept bf16's rounding (up to 0.05 off) until the model's own
    initialisation ran again outside the load dtype, as from_pretrained runs it."""
    for family in FAMILIES:
        built = dict(meta_model(tiny_dirs(family), dtype).named_buffers())
        loaded = dict(load_base(str(tiny_dirs(family)), dtype=dtype)[0].named_buffers())
        assert built.keys() == loaded.keys(), family
        for name, want in loaded.items():
            got = built[name]
            assert got.dtype == want.dtype and torch.equal(got, want), f"{family}: {name}"


def test_body_is_the_module_the_causal_lm_calls(tiny_dirs) -> None:
    """The innermost module holding the embeddings and every layer: OPT's decoder, not ``base_model``."""
    opt = meta_model(tiny_dirs("opt"), "float32")
    assert decoder_body(opt) is opt.model.decoder and opt.base_model is opt.model
    llama = meta_model(tiny_dirs("llama"), "float32")
    assert decoder_body(llama) is llama.base_model
    assert len(decoder_layers(decoder_body(opt))) == opt.config.num_hidden_layers


def test_no_body_apart_from_the_head_is_refused_in_one_line() -> None:
    with pytest.raises(ConfigError, match=r"^pack.shard: _Flat keeps its embeddings and decoder layers beside "
                                          r"the head, with no decoder body to shard apart from it$"):
        decoder_body(_Flat())
    bare = _Flat()
    bare._no_split_modules = []
    with pytest.raises(ConfigError, match=r"^pack.shard: _Flat has no decoder layers to shard"):
        decoder_body(bare)


def test_a_body_module_run_past_the_body_is_refused_in_one_line(tiny_dirs, tmp_path: Path) -> None:
    """What OPT's forward did to a root unit on ``base_model``: the decoder's modules run while FSDP holds their
    weights sharded (OPT's embeddings are tied to its head, kept whole; its learned positions are sharded)."""
    pm = PackedModel(load_base(str(tiny_dirs("opt")), attn_implementation="eager")[0])
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        shard_base(pm)
        with pytest.raises(ConfigError, match=r"^pack.shard: opt \(OPTForCausalLM\) runs "
                                              r"model.decoder.embed_positions outside the forward of its decoder "
                                              r"body \(model.decoder\), so FSDP never gathers its weights$"):
            pm.model.model.decoder.embed_positions(MASK, 0)
        torch.testing.assert_close(pm.forward(IDS, MASK, None), run_pack(tiny_dirs("opt"), shard=False)["logits"])
    finally:
        dist.destroy_process_group()


@pytest.mark.gpu
def test_every_family_loaded_by_rows_on_a_gpu_gives_the_whole_loads_logits(tiny_dirs, tmp_path: Path) -> None:
    """NCCL, a group of one, bf16, the fused Triton base ops: every family's pack built on meta and loaded by rows
    gives the logits of the same pack loaded whole (the same kernels on the same weights and buffers: CodeGen's
    differed, 13 of 7,596 logits by up to 5.5e-4, while its position table kept bf16's rounding on the rows
    path; test_a_meta_models_buffers_are_the_whole_loads checks the buffers on the CPU)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        ids, mask = IDS.cuda(), MASK.cuda()
        for family in FAMILIES:
            loaded = load_sharded(str(tiny_dirs(family)), dtype="bfloat16", device="cuda",
                                  attn_implementation="eager")
            assert loaded.stats is not None, f"{family} fell back to the whole load"
            whole = PackedModel(load_base(str(tiny_dirs(family)), dtype="bfloat16", device="cuda",
                                          attn_implementation="eager")[0])
            with torch.no_grad():
                got, want = loaded.pm.forward(ids, mask, None), whole.forward(ids, mask, None)
            torch.testing.assert_close(got, want, msg=lambda m, family=family: f"{family}: {m}")  # bf16 defaults
    finally:
        dist.destroy_process_group()
