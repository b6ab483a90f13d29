"""Slots attach to every supported family without touching base weights; bad input is one clear line."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from torch import nn

from lora_sweep.errors import ConfigError, UserError
from lora_sweep.kernels.ops import PackLayout
from lora_sweep.packer.model.load import load_base
from lora_sweep.packer.model.packed import PackedModel
from lora_sweep.packer.plan import AdapterSpec


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral", "gpt2"])
def test_slots_attach_without_touching_base(tiny_dirs, family: str) -> None:
    model, _ = load_base(str(tiny_dirs(family)))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    pm = PackedModel(model)
    params = pm.add_slot(0, AdapterSpec(rank=4, targets=("all-linear",)))
    pm.add_slot(1, AdapterSpec(rank=2, targets=("all-linear",), seed=5))
    assert all(p.requires_grad for p in params) and len(params) % 2 == 0
    assert not any(p.requires_grad for n, p in model.named_parameters() if "lora_" not in n)
    for _, b in pm.slot_weights(0).values():  # PEFT init: B = 0, so the slot starts at the base model
        assert torch.count_nonzero(b) == 0
    ids = torch.randint(3, 300, (3, 9))
    layout = PackLayout((0, 1), (0, 2), (2, 1), (9, 9), (0.0, 0.0), (0, 0))
    with torch.no_grad():
        base_logits = pm.forward(ids, torch.ones_like(ids), None)
        torch.testing.assert_close(pm.forward(ids, torch.ones_like(ids), layout), base_logits)
        for _, b in pm.slot_weights(1).values():
            b.normal_()
        moved = pm.forward(ids, torch.ones_like(ids), layout)
    torch.testing.assert_close(moved[:2], base_logits[:2])  # slot 0's rows do not see slot 1's adapter
    assert not torch.allclose(moved[2:], base_logits[2:])
    pm.remove_slot(1)
    pm.remove_slot(0)
    state = {k.replace(".base.", "."): v for k, v in model.state_dict().items()}
    assert state.keys() == before.keys()
    for k, v in before.items():
        assert torch.equal(state[k], v), k


def test_unknown_target_lists_existing_names(tiny_dirs) -> None:
    pm = PackedModel(load_base(str(tiny_dirs("llama")))[0])
    with pytest.raises(ConfigError) as err:
        pm.add_slot(0, AdapterSpec(targets=("qkv_proj",)))
    msg = str(err.value)
    assert "\n" not in msg and "'qkv_proj'" in msg and "q_proj" in msg and "down_proj" in msg


def test_unknown_architecture_lists_module_names() -> None:
    class Odd(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.mixer = nn.Conv2d(2, 2, 1)
            self.proj = nn.Linear(4, 4)

    pm = PackedModel(Odd())
    with pytest.raises(ConfigError, match=r"unknown target module 'mixer'.*linear projections are: proj.*mixer"):
        pm.add_slot(0, AdapterSpec(rank=2, targets=("mixer",)))


def test_rank_larger_than_layer(tiny_dirs) -> None:
    pm = PackedModel(load_base(str(tiny_dirs("llama")))[0])
    with pytest.raises(ConfigError, match=r"rank: 64 is larger than layer model\.layers\.0\.self_attn\.k_proj"):
        pm.add_slot(0, AdapterSpec(rank=64, targets=("k_proj",)))


@pytest.mark.parametrize(("kwargs", "key"), [
    ({"rank": 0}, "rank"), ({"rank": -3}, "rank"), ({"rank": 257}, "rank"), ({"alpha": 0}, "alpha"),
    ({"dropout": 1.0}, "dropout"), ({"lr": -1.0}, "lr"), ({"schedule": "cosine_annealing"}, "schedule"),
    ({"targets": ()}, "targets"), ({"micro_batch": 0}, "micro_batch"), ({"max_steps": 0}, "max_steps"),
])
def test_bad_adapter_spec_names_the_key(kwargs, key: str) -> None:
    with pytest.raises(ConfigError) as err:
        AdapterSpec(**kwargs)
    assert str(err.value).startswith(f"{key}:") and "\n" not in str(err.value)


def test_missing_model_dir_is_user_error(tmp_path) -> None:
    with pytest.raises(UserError, match="model directory not found"):
        load_base(str(tmp_path / "nope"))


def test_second_packed_model_over_the_same_model_rewraps(tiny_dirs) -> None:
    model, _ = load_base(str(tiny_dirs("llama")))
    ids = torch.randint(3, 300, (1, 5))
    first = PackedModel(model)
    first.add_slot(0, AdapterSpec(rank=2, targets=("q_proj",)))
    second = PackedModel(model, impl="loop")
    second.add_slot(0, AdapterSpec(rank=4, targets=("q_proj",)))
    q = model.model.layers[0].self_attn.q_proj
    assert q is second.layers["model.layers.0.self_attn.q_proj"] and isinstance(q.base, nn.Linear)
    with torch.no_grad():
        assert second.forward(ids, torch.ones_like(ids), PackLayout((0,), (0,), (1,), (5,), (0.0,), (0,))).shape[-1]


def test_a_dropped_store_leaves_nothing_behind(tiny_dirs) -> None:
    """The store's buffers are freed once its slots leave and the pack drops it: the layers' cached gathers of the
    slots' weights (views) go with the slots (kept, they held a finished pack's adapters alive until the next pack,
    and a planner's probe counted them)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    pm = PackedModel(load_base(str(tiny_dirs("llama")), device=device)[0], impl="torch")
    pm.add_slot(0, AdapterSpec(rank=4, targets=("all-linear",), seed=1))
    pm.add_slot(1, AdapterSpec(rank=8, alpha=8.0, targets=("q_proj", "v_proj", "up_proj"), seed=2))
    layout = PackLayout((0, 1), (0, 1), (1, 1), (6, 6), (0.0, 0.0), (7, 8))
    ids = torch.randint(3, 100, (2, 6), generator=torch.Generator().manual_seed(0)).to(device)
    with torch.no_grad():
        pm.forward(ids, torch.ones_like(ids), layout)  # the per-adapter path: the layers cache their gathers
    store = pm.store
    assert store is not None
    buffers = [weakref.ref(t) for t in (store.flat, store.grad, store.exp_avg, store.exp_avg_sq)]
    del store
    pm.remove_slot(0)
    pm.remove_slot(1)
    pm.drop_store()
    gc.collect()
    assert [r() for r in buffers] == [None] * 4


def test_the_store_buckets_the_rows_a_caller_says_are_coming(tiny_dirs) -> None:
    """``max_rows`` (the most rows a later slot will need: the sweep's largest rank over its space) is bucketed by the
    packer like a slot's own rows: 24 rows -> the power-of-two bucket 32, kept while it holds every rank asked for;
    a PiSSA / OLoRA slot needs twice its rank (``AdapterSpec.rows``)."""
    pm = PackedModel(load_base(str(tiny_dirs("llama")))[0], impl="torch")
    store = pm.ensure_store(2, 4, max_rows=24)
    assert store.rank_bucket == 32 and pm.ensure_store(2, 8) is store
    assert pm.ensure_store(2, AdapterSpec(rank=32, init="pissa").rows).rank_bucket == 64
