"""``packer.model.slices``: q/k/v and gate/up run as shared-input group calls on the static step, train to what the
projections run alone train to, and fall back to one call per projection where a group cannot apply."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

import lora_sweep.packer.model.packed
from lora_sweep.kernels.ops import PackLayout
from lora_sweep.packer.model.packed import PackedModel, load_base
from lora_sweep.packer.plan import AdapterSpec
from lora_sweep.packer.step.train import FixedBatch, SlotJob, train
from tests.conftest import Recorder, random_examples

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

SPECS = [AdapterSpec(rank=4, targets=("all-linear",), max_steps=3, seed=1, lr=1e-2),
         AdapterSpec(rank=8, alpha=8.0, targets=("q_proj", "v_proj", "up_proj"), max_steps=3, seed=2, lr=1e-2),
         AdapterSpec(rank=2, targets=("k_proj", "gate_proj"), max_steps=3, seed=3, lr=1e-2)]


def test_a_member_called_on_another_input_computes_its_own(tiny_dirs) -> None:
    """The group keeps the other members' outputs only for the same, unmodified input: q(x), k(x2), v(x), and
    q(x), then x modified in place, then k(x), give each projection its own output."""
    model = load_base(str(tiny_dirs("llama")), device=DEVICE)[0]
    pm = PackedModel(model, impl="torch")
    pm.add_slot(0, SPECS[0])
    attn = model.model.layers[0].self_attn
    q_proj, k_proj, v_proj = attn.q_proj, attn.k_proj, attn.v_proj
    group = q_proj.group
    calls: list[int] = []

    def call(g, x):  # noqa: ANN001, ANN202
        """A group call: every member's output on x (each member's own, as the static step's are)."""
        calls.append(len(g.members))
        return tuple(_own(m, x) for m in g.members)

    def out(layer, x):  # noqa: ANN001, ANN202
        return group.output(layer, x, call)

    layout = PackLayout((0,), (0,), (2,), (5,), (0.0,), (7,))
    g = torch.Generator().manual_seed(0)
    x, x2 = (torch.randn((2, 5, model.config.hidden_size), generator=g).to(DEVICE) for _ in range(2))
    close = dict(rtol=1e-5, atol=1e-5)
    with torch.no_grad(), pm._using(layout):
        q, k2, v = out(q_proj, x), out(k_proj, x2), out(v_proj, x)
        assert calls == [3, 3, 3]  # k's call for x2 replaced what q's call kept: v computed its own
        torch.testing.assert_close(q, _own(q_proj, x), **close)
        torch.testing.assert_close(k2, _own(k_proj, x2), **close)
        torch.testing.assert_close(v, _own(v_proj, x), **close)
        out(q_proj, x)  # takes what v's call kept for x
        x.mul_(2)
        torch.testing.assert_close(out(k_proj, x), _own(k_proj, x), **close)
        assert len(calls) == 4  # k could not reuse anything computed before x changed
        x3 = x2 + 1
        _, _, v = out(q_proj, x3), out(k_proj, x3), out(v_proj, x3)
        assert len(calls) == 5  # the usual order: one call for the three
        torch.testing.assert_close(v, _own(v_proj, x3), **close)


def _own(layer, x: torch.Tensor) -> torch.Tensor:
    """The layer's output computed without its group (the per-batch path: each member alone)."""
    group, layer.group = layer.group, None
    try:
        return layer(x)
    finally:
        layer.group = group


def test_a_removed_slot_leaves_nothing_behind(tiny_dirs) -> None:
    """A slot's buffers are freed when it leaves the pack: the layers' cached gathers of its weights (views) go with
    it (kept, they held a finished pack's adapters alive until the next pack, and a planner's probe counted them)."""
    model = load_base(str(tiny_dirs("llama")), device=DEVICE)[0]
    pm = PackedModel(model, impl="torch")
    pm.add_slot(0, SPECS[0])
    pm.add_slot(1, SPECS[1])
    layout = PackLayout((0, 1), (0, 1), (1, 1), (6, 6), (0.0, 0.0), (7, 8))
    ids = torch.randint(3, 100, (2, 6), generator=torch.Generator().manual_seed(0)).to(DEVICE)
    pm.forward(ids, torch.ones_like(ids), layout).sum().backward()
    buffers = [weakref.ref(t) for slot in (0, 1) for t in pm.flat_buffers(slot)]
    pm.remove_slot(0)
    pm.remove_slot(1)
    gc.collect()
    assert [r() for r in buffers] == [None] * 4


# -- the static step (packer.model.static.StaticStore.group_forward)
# -------------------------------------------------------

STATIC_SPECS = [
    AdapterSpec(rank=4, alpha=8, lr=1e-2, micro_batch=2, targets=("all-linear",), max_steps=5, seed=1, dropout=0.1),
    AdapterSpec(rank=8, alpha=8, lr=1e-2, micro_batch=1, targets=("q_proj", "v_proj", "up_proj"), max_steps=3, seed=2),
    AdapterSpec(rank=2, alpha=4, lr=1e-2, micro_batch=2, targets=("k_proj", "gate_proj", "up_proj"), max_steps=4,
                seed=3, dropout=0.2),
]
"""Mixed ranks, dropout on two slots (one with all-linear, one on k and gate/up only), three jobs in two slots: the
third starts in the slot the second frees (a refill), and the groups see every mix of adapted members."""


def _static_run(model_dir, monkeypatch: pytest.MonkeyPatch, impl: str, grouped: bool,  # noqa: ANN001, ANN202
                **options: object):
    """Train ``STATIC_SPECS`` on the static step (two slots; ``options``: ``train``'s); returns the recorder, how many
    group calls ran and the pack."""
    from lora_sweep.packer.model.static import StaticStore

    calls: list[bool] = []
    real = StaticStore.group_forward

    def counted(self, group, x):  # noqa: ANN001, ANN202
        out = real(self, group, x)
        calls.append(out is not None)
        return out

    monkeypatch.setattr(StaticStore, "group_forward", counted)
    if not grouped:
        monkeypatch.setattr(lora_sweep.packer.model.packed, "link_groups", lambda layers: [])
    pm = PackedModel(load_base(str(model_dir), device=DEVICE, attn_implementation="eager")[0], impl=impl)
    jobs = [SlotJob(s, FixedBatch(random_examples(s.micro_batch, i)), key=i) for i, s in enumerate(STATIC_SPECS)]
    rec = Recorder(pm)
    train(pm, 2, lambda s: jobs.pop(0) if jobs else None, pad_id=0, on_step=rec.on_step, on_end=rec.on_end,
          **options)  # type: ignore[arg-type]
    monkeypatch.undo()
    return rec, sum(calls), pm


def _same_static(got: Recorder, want: Recorder) -> None:
    """Per-step losses within fp32 rounding, final A and B within the bound ``_same`` uses: the group's base GEMM
    over the concatenated weights and its one dx sum in another order than the members' own GEMMs and autograd's
    adds (the LoRA kernels and the dropout masks are the members' own), and AdamW rescales that rounding where a
    gradient is near zero."""
    for key, spec in enumerate(STATIC_SPECS):
        assert len(got.losses[key]) == len(want.losses[key]) == spec.max_steps
        torch.testing.assert_close(torch.tensor(got.losses[key]), torch.tensor(want.losses[key]), rtol=1e-5, atol=0)
        assert got.final[key].keys() == want.final[key].keys()
        for (a, b), (a0, b0) in zip(got.final[key].values(), want.final[key].values(), strict=True):
            torch.testing.assert_close(a, a0, rtol=0, atol=1e-4)
            torch.testing.assert_close(b, b0, rtol=0, atol=1e-4)
            assert b.abs().max() > 0  # trained


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_static_groups_train_as_the_projections_alone(tiny_dirs, monkeypatch, family: str) -> None:
    """The static step (eager, the torch path) with groups: q/k/v and gate/up each run as one call
    whenever a slot adapts a member (Qwen2's q/k/v biases included), and every slot trains as it does with each
    projection alone, dropout masks and a refill included."""
    grouped, n_calls, pm = _static_run(tiny_dirs(family), monkeypatch, "torch", grouped=True)
    layers = pm.model.config.num_hidden_layers
    assert len(pm.groups) == 2 * layers and all(g.base_cat() is not None for g in pm.groups)
    assert n_calls >= 2 * layers * max(s.max_steps for s in STATIC_SPECS)  # both groups of every layer, every step
    alone, n_alone, _ = _static_run(tiny_dirs(family), monkeypatch, "torch", grouped=False)
    assert n_alone == 0
    _same_static(grouped, alone)


def test_static_groups_under_activation_checkpointing(tiny_dirs, monkeypatch) -> None:
    """Recomputing each decoder layer in the backward re-runs its group calls (more calls, the same groups): every
    slot trains as without checkpointing, dropout masks and a refill included."""
    plain, n_plain, _ = _static_run(tiny_dirs("llama"), monkeypatch, "torch", grouped=True)
    checkpointed, n_ckpt, pm = _static_run(tiny_dirs("llama"), monkeypatch, "torch", grouped=True,
                                           activation_checkpointing=True)
    assert pm._checkpointed and n_plain > 0 and n_ckpt > n_plain  # the recompute called the groups again
    _same_static(checkpointed, plain)


def test_moved_weights_run_alone(tiny_dirs) -> None:
    """``link_groups`` lays a group's weights out adjacently (values unchanged); once they are no longer adjacent
    (replaced, moved) the group has no concatenated base and the static step runs its members alone."""
    model = load_base(str(tiny_dirs("llama")), device=DEVICE)[0]
    attn = model.model.layers[0].self_attn
    before = [attn.q_proj.weight.detach().clone(), attn.k_proj.weight.detach().clone()]
    pm = PackedModel(model, impl="torch")
    pm.add_slot(0, SPECS[0])
    group = attn.q_proj.group
    w, b = group.base_cat()
    assert b is None and w.shape[0] == sum(m.out_features for m in group.members)
    torch.testing.assert_close(w[:before[0].shape[0]], before[0], rtol=0, atol=0)
    torch.testing.assert_close(w[before[0].shape[0]:][:before[1].shape[0]], before[1], rtol=0, atol=0)
    attn.k_proj.base.weight.data = attn.k_proj.base.weight.data.clone()
    assert group.base_cat() is None
