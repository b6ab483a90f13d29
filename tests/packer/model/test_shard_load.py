"""``packer.model.shard_load``: which bases load by rows and which load whole first (and why, in one line), and the
benchmarks' random init of a base built on meta. That a pack loaded by rows trains as one loaded whole, reading only
its rows, is shown on 2 gloo ranks in tests/packer/model/test_shard.py (its ``meta`` run)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from lora_sweep.errors import UserError
from lora_sweep.packer.model.load import load_base
from lora_sweep.packer.model.packed import PackedModel
from lora_sweep.packer.model.shard import shard_base
from lora_sweep.packer.model.shard_load import load_sharded, materialise, meta_load_refusal, meta_model
from tests.conftest import need_module


def test_what_loads_by_rows(tiny_dirs, tmp_path: Path) -> None:
    model_dir = tiny_dirs("llama")
    assert meta_load_refusal(str(model_dir), None) is None
    assert meta_load_refusal(str(model_dir), "nf4") == "model.quantize: nf4 quantises the whole weights as they load"
    assert "not a local checkpoint directory" in meta_load_refusal("org/some-model", None)
    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy(model_dir / "config.json", bare)
    assert "holds no safetensors files" in meta_load_refusal(str(bare), None)


@pytest.fixture
def group_of_one(tmp_path: Path):  # noqa: ANN201
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_nf4_loads_whole_and_says_why(tiny_dirs, group_of_one) -> None:
    need_module("torchao", "qlora")
    said: list[str] = []
    loaded = load_sharded(str(tiny_dirs("llama")), dtype="float32", device="cpu", quantize="nf4", log=said.append)
    assert loaded.stats is None and len(said) == 1
    assert said[0] == ("pack.shard: each rank loads the whole base, then shards it: model.quantize: nf4 "
                       "quantises the whole weights as they load")


def test_random_init_materialises_every_parameter(tiny_dirs, group_of_one) -> None:
    """The benchmarks' path (``materialise`` without a checkpoint): no parameter or buffer left on meta, norms one,
    projections drawn with the config's ``initializer_range``, and the pack runs a finite forward."""
    model = meta_model(tiny_dirs("llama"), "float32")
    pm = PackedModel(model, device=torch.device("cpu"))
    shard_base(pm)
    stats = materialise(model, None, dtype=torch.float32, device=torch.device("cpu"))
    assert stats.read_bytes == 0 and stats.tensors == len(list(model.parameters()))
    assert not any(t.is_meta for t in [*model.parameters(), *model.buffers()])
    full = {name: p.full_tensor() if hasattr(p, "full_tensor") else p for name, p in model.named_parameters()}
    assert all(torch.equal(p, torch.ones_like(p)) for name, p in full.items() if name.endswith("norm.weight"))
    q = full["model.layers.0.self_attn.q_proj.weight"]
    assert q.std().item() == pytest.approx(model.config.initializer_range, rel=0.1)
    ids = torch.randint(3, 200, (2, 8))
    assert torch.isfinite(pm.forward(ids, torch.ones_like(ids), None)).all()


def test_a_tied_head_stays_tied_and_gives_a_whole_loads_logits(tiny_dirs, group_of_one) -> None:
    """GPT-2 ties its head to the input embeddings (its checkpoint stores only ``transformer.wte.weight``): loaded by
    rows the two stay one parameter, kept whole beside the shard (``packer.model.shard``), and the logits are the
    whole-loaded model's."""
    model_dir = tiny_dirs("gpt2")
    loaded = load_sharded(str(model_dir), dtype="float32", device="cpu")
    tied = loaded.pm.model
    assert loaded.stats is not None
    assert tied.get_output_embeddings().weight is tied.get_input_embeddings().weight
    model, _ = load_base(str(model_dir))
    ids = torch.randint(3, 200, (2, 8))
    mask = torch.ones_like(ids)
    torch.testing.assert_close(loaded.pm.forward(ids, mask, None), PackedModel(model).forward(ids, mask, None),
                               rtol=0, atol=0)


@pytest.mark.gpu
def test_a_base_loaded_by_rows_on_a_gpu_runs_as_one_loaded_whole(tiny_dirs, tmp_path: Path) -> None:
    """NCCL, a group of one, bf16: built on meta, the pack chooses the fused Triton ops for the GPU it will live on
    (not for the meta device) as a whole-loaded pack does, and its logits are the whole-loaded pack's."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        loaded = load_sharded(str(tiny_dirs("llama")), dtype="bfloat16", device="cuda")
        model, _ = load_base(str(tiny_dirs("llama")), dtype="bfloat16", device="cuda")
        whole = PackedModel(model)
        assert loaded.stats is not None and whole.fused and loaded.pm.fused == whole.fused
        ids = torch.randint(3, 200, (2, 16), device="cuda")
        mask = torch.ones_like(ids)
        torch.testing.assert_close(loaded.pm.forward(ids, mask, None), whole.forward(ids, mask, None), rtol=0, atol=0)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("family", ["llama", "gpt_neox"])
def test_checkpoint_names_without_transformers_loader_internals_are_taken_as_they_are(tiny_dirs, monkeypatch,
                                                                                      family: str) -> None:
    """The name mapping uses transformers' loader internals (5.x); where a version lacks them or calls them
    differently, a checkpoint's names are taken as they are: Llama's still match the model's (it loads by rows),
    GPT-NeoX's renamed head (``embed_out``) then no longer does (it loads whole first, as ``load_sharded`` says)."""
    import transformers.core_model_loading as loading

    from lora_sweep.packer.model import shard_load

    model = meta_model(tiny_dirs(family), "float32")
    index = shard_load._safetensors_index(Path(tiny_dirs(family)))
    mapped = shard_load._by_model_name(model, index)

    def changed(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        raise TypeError("rename_source_key() takes 4 positional arguments")

    monkeypatch.setattr(loading, "rename_source_key", changed)
    plain = shard_load._by_model_name(model, index)
    assert plain == {key: (file, key) for key, file in index.items()}
    assert (plain == mapped) == (family == "llama")


def test_a_damaged_config_is_one_line_before_a_rank_builds_from_it(tiny_dirs, tmp_path: Path, group_of_one) -> None:
    """The sharded load reads config.json itself (``meta_model``): a layer count above the weights' is refused first,
    as ``load_base`` refuses it, not built on meta and materialised layer by layer."""
    out = tmp_path / "damaged"
    shutil.copytree(tiny_dirs("llama"), out)
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 100000}))
    with pytest.raises(UserError) as err:
        load_sharded(str(out), dtype="float32", device="cpu")
    said = "config.json: num_hidden_layers is 100000, but the weights hold 2"
    assert str(err.value) == f"{out}: cannot load model: {said}"
