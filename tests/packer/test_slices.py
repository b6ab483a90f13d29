"""``packer.slices``: q/k/v and gate/up run as shared-input group calls on the Triton path, train to what the
projections run one by one train to, and fall back to one call per projection where a group cannot apply."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from tests.conftest import need_triton

need_triton()  # before anything imports the Triton kernel modules

import lora_sweep.packer.model  # noqa: E402
import lora_sweep.packer.slices  # noqa: E402
from lora_sweep.kernels import PackLayout  # noqa: E402
from lora_sweep.packer.model import PackedModel, load_base  # noqa: E402
from lora_sweep.packer.plan import AdapterSpec  # noqa: E402
from lora_sweep.packer.train import FixedBatch, SlotJob, train  # noqa: E402
from tests.conftest import Recorder, random_examples  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _counting(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Count the group calls (each records its number of slices)."""
    calls: list[int] = []
    real = lora_sweep.packer.slices.packed_lora_linear_slices

    def counted(x, weights, *args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(len(weights))
        return real(x, weights, *args, **kwargs)

    monkeypatch.setattr(lora_sweep.packer.slices, "packed_lora_linear_slices", counted)
    return calls


def _train(pm: PackedModel, specs: list[AdapterSpec], **options: object) -> Recorder:
    """Train on the one training step (which does not run the shared-input groups yet: packer.slices)."""
    jobs = [SlotJob(s, FixedBatch(random_examples(2, i)), key=i) for i, s in enumerate(specs)]
    rec = Recorder(pm)
    train(pm, len(specs), lambda s: jobs.pop(0) if jobs else None, pad_id=0, on_step=rec.on_step, on_end=rec.on_end,
          **options)  # type: ignore[arg-type]
    return rec


def _same(got: Recorder, want: Recorder, n: int) -> None:
    """Equal losses, and final weights within the bound of packer's other reduction-order tests (AdamW
    rescales near-zero gradients' noise)."""
    for key in range(n):
        assert len(got.losses[key]) == 3
        torch.testing.assert_close(torch.tensor(got.losses[key]), torch.tensor(want.losses[key]), rtol=1e-5,
                                   atol=1e-5)
        for (a, b), (a0, b0) in zip(got.final[key].values(), want.final[key].values(), strict=True):
            torch.testing.assert_close(a, a0, rtol=0, atol=1e-4)
            torch.testing.assert_close(b, b0, rtol=0, atol=1e-4)


SPECS = [AdapterSpec(rank=4, targets=("all-linear",), max_steps=3, seed=1, lr=1e-2),
         AdapterSpec(rank=8, alpha=8.0, targets=("q_proj", "v_proj", "up_proj"), max_steps=3, seed=2, lr=1e-2),
         AdapterSpec(rank=2, targets=("k_proj", "gate_proj"), max_steps=3, seed=3, lr=1e-2)]


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_groups_train_as_the_projections_one_by_one(tiny_dirs, monkeypatch, family: str) -> None:
    """Three slots adapting different subsets of q/k/v and gate/up (mixed ranks and scales; Qwen2's q/k/v
    carry biases): the losses and final weights of grouped calls equal those of one call per projection."""
    calls = _counting(monkeypatch)
    grouped_pm = PackedModel(load_base(str(tiny_dirs(family)), device=DEVICE)[0], impl="triton")
    grouped = _train(grouped_pm, SPECS)
    layers = grouped_pm.model.config.num_hidden_layers
    assert len(grouped_pm.groups) == 2 * layers
    assert set(calls) == {2, 3} and len(calls) >= 2 * layers * 3  # each layer's two groups, every step
    monkeypatch.setattr(lora_sweep.packer.model, "link_groups", lambda layers: [])
    alone_pm = PackedModel(load_base(str(tiny_dirs(family)), device=DEVICE)[0], impl="triton")
    alone = _train(alone_pm, SPECS)
    assert all(layer.group is None for layer in alone_pm.layers.values())
    _same(grouped, alone, len(SPECS))


def test_groups_under_activation_checkpointing(tiny_dirs, monkeypatch) -> None:
    """Recomputing each decoder layer in the backward re-runs its group calls (more calls, same groups):
    the same losses and weights as without checkpointing."""
    calls = _counting(monkeypatch)
    plain = _train(PackedModel(load_base(str(tiny_dirs("llama")), device=DEVICE)[0], impl="triton"), SPECS)
    n_plain = len(calls)
    pm = PackedModel(load_base(str(tiny_dirs("llama")), device=DEVICE)[0], impl="triton")
    checkpointed = _train(pm, SPECS, activation_checkpointing=True)
    assert pm._checkpointed and len(calls) - n_plain > n_plain  # the recompute called the groups again
    _same(checkpointed, plain, len(SPECS))


def test_dropout_or_the_torch_path_run_one_call_per_projection(tiny_dirs, monkeypatch) -> None:
    """A slot with LoRA dropout on q/k/v keeps that group apart (gate/up, which it does not adapt, still groups);
    on the torch path nothing groups."""
    calls = _counting(monkeypatch)
    pm = PackedModel(load_base(str(tiny_dirs("llama")), device=DEVICE)[0], impl="triton")
    _train(pm, [SPECS[0], AdapterSpec(rank=2, targets=("q_proj",), dropout=0.1, max_steps=3, seed=4)])
    assert calls and set(calls) == {2}
    calls.clear()
    torch_pm = PackedModel(load_base(str(tiny_dirs("llama")), device=DEVICE)[0], impl="torch")
    _train(torch_pm, SPECS)
    assert calls == [] and torch_pm.groups


def test_a_member_called_on_another_input_computes_its_own(tiny_dirs, monkeypatch) -> None:
    """The group keeps the other members' outputs only for the same, unmodified input: q(x), k(x2), v(x), and
    q(x), then x modified in place, then k(x), give each projection its own output."""
    calls = _counting(monkeypatch)
    model = load_base(str(tiny_dirs("llama")), device=DEVICE)[0]
    pm = PackedModel(model, impl="triton")
    pm.add_slot(0, SPECS[0])
    attn = model.model.layers[0].self_attn
    q_proj, k_proj, v_proj = attn.q_proj, attn.k_proj, attn.v_proj
    layout = PackLayout((0,), (0,), (2,), (5,), (0.0,), (7,))
    g = torch.Generator().manual_seed(0)
    x, x2 = (torch.randn((2, 5, model.config.hidden_size), generator=g).to(DEVICE) for _ in range(2))
    close = dict(rtol=1e-5, atol=1e-5)
    with torch.no_grad(), pm._using(layout):
        q, k2, v = q_proj(x), k_proj(x2), v_proj(x)
        assert calls == [3, 3, 3]  # k's call for x2 replaced what q's call kept: v computed its own
        torch.testing.assert_close(q, _own(q_proj, x), **close)
        torch.testing.assert_close(k2, _own(k_proj, x2), **close)
        torch.testing.assert_close(v, _own(v_proj, x), **close)
        q_proj(x)  # takes what v's call kept for x
        x.mul_(2)
        torch.testing.assert_close(k_proj(x), _own(k_proj, x), **close)
        assert len(calls) == 4  # k could not reuse anything computed before x changed
        x3 = x2 + 1
        _, _, v = q_proj(x3), k_proj(x3), v_proj(x3)
        assert len(calls) == 5  # the usual order: one call for the three
        torch.testing.assert_close(v, _own(v_proj, x3), **close)


def _own(layer, x: torch.Tensor) -> torch.Tensor:
    """The layer's output computed without its group (and without the LoRA term's old outputs)."""
    group, layer.group = layer.group, None
    try:
        return layer(x)
    finally:
        layer.group = group


def test_a_removed_slot_leaves_nothing_behind_in_the_groups(tiny_dirs) -> None:
    """A slot's buffers are freed when it leaves the pack: the groups' stacked views of its weights go with it
    (they kept a finished pack's adapters alive until the next pack, and a planner's probe counted them)."""
    model = load_base(str(tiny_dirs("llama")), device=DEVICE)[0]
    pm = PackedModel(model, impl="triton")
    pm.add_slot(0, SPECS[0])
    pm.add_slot(1, SPECS[1])
    layout = PackLayout((0, 1), (0, 1), (1, 1), (6, 6), (0.0, 0.0), (7, 8))
    ids = torch.randint(3, 100, (2, 6), generator=torch.Generator().manual_seed(0)).to(DEVICE)
    cached_before = sum(1 for g in pm.groups if g._cache is not None)
    pm.forward(ids, torch.ones_like(ids), layout).sum().backward()
    assert cached_before == 0 and all(g._cache is not None for g in pm.groups)
    buffers = [weakref.ref(t) for slot in (0, 1) for t in pm.flat_buffers(slot)]
    pm.remove_slot(0)
    pm.remove_slot(1)
    gc.collect()
    assert [r() for r in buffers] == [None] * 4
