"""Chunked cross-entropy equals the plain full-logits path: losses, every slot's gradients, whole runs, less memory."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from lora_sweep.errors import ConfigError
from lora_sweep.packer.data.batch import IGNORE_INDEX, collate
from lora_sweep.packer.data.rows import Example, SlotStream
from lora_sweep.packer.loss import chunked_slot_losses, output_head, plain_output_head, slot_losses
from lora_sweep.packer.model.load import load_base
from lora_sweep.packer.model.packed import PackedModel
from lora_sweep.packer.plan import AdapterSpec
from lora_sweep.packer.probe import peak_memory
from lora_sweep.packer.step.train import FixedBatch, SlotJob, train
from lora_sweep.packer.tiny.models import tiny_config
from tests.conftest import Recorder, random_examples

PAD = 0
TARGETS = {"llama": ("q_proj", "v_proj", "down_proj"), "gpt2": ("c_attn", "c_fc")}


def _specs(family: str, steps: int = 10) -> list[AdapterSpec]:
    t = TARGETS[family]
    return [AdapterSpec(rank=2, alpha=4, lr=1e-2, micro_batch=1, targets=t[:1], max_steps=steps, seed=1),
            AdapterSpec(rank=4, alpha=8, lr=5e-3, micro_batch=3, targets=t, max_steps=steps, seed=2, dropout=0.2),
            AdapterSpec(rank=8, alpha=8, lr=2e-3, micro_batch=2, targets=t[-1:], max_steps=steps, seed=3)]


def _pack(model_dir, specs: list[AdapterSpec]) -> PackedModel:
    model, _ = load_base(str(model_dir), attn_implementation="eager")
    pm = PackedModel(model)
    gen = torch.Generator().manual_seed(0)
    for slot, spec in enumerate(specs):
        pm.add_slot(slot, spec)
        with torch.no_grad():  # B starts at 0, which would leave the hidden states the base's alone
            for _, b in pm.slot_weights(slot).values():
                b.copy_(torch.randn(b.shape, generator=gen) * 0.1)
    return pm


def _loss_and_grads(pm: PackedModel, batch, chunk_tokens: int | None):
    """Per-slot losses and counts of ``batch`` through the head, plain or chunked, and per slot the gradient of the
    losses' sum with respect to its rows of the final hidden states (every adapter gradient is a product with it)."""
    with torch.no_grad():
        hidden = pm.forward_hidden(batch.input_ids, batch.attention_mask, batch.layout)  # (B, L, H)
    hidden.requires_grad_()
    if chunk_tokens is None:
        losses, counts = slot_losses(pm.output_head()(hidden), batch.labels, batch.layout)
    else:
        losses, counts = chunked_slot_losses(hidden, pm.output_head(), batch.labels, batch.layout,
                                             chunk_tokens=chunk_tokens)
    losses.sum().backward()
    lay = batch.layout
    grads = {s: hidden.grad[r0:r0 + n] for s, r0, n in zip(lay.slots, lay.row_start, lay.n_rows, strict=True)}
    return losses.detach(), counts, grads


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_chunked_equals_plain_losses_and_gradients(tiny_dirs, family: str) -> None:
    specs = _specs(family)
    pm = _pack(tiny_dirs(family), specs)
    rows = [random_examples(spec.micro_batch, seed=10 + i) for i, spec in enumerate(specs)]  # prompt-masked
    batch = collate(list(range(len(specs))), rows, PAD, dropout=[s.dropout for s in specs], seeds=[5, 6, 7])
    n_targets = int((batch.labels[:, 1:] != IGNORE_INDEX).sum())
    ref_losses, ref_counts, ref_grads = _loss_and_grads(pm, batch, None)
    assert all(g.abs().max() > 0 for g in ref_grads.values())
    for chunk in (6, n_targets - 1, 10_000):  # 6 and T-1 do not divide T; 10_000 is one chunk
        assert n_targets % chunk != 0 or chunk > n_targets
        losses, counts, grads = _loss_and_grads(pm, batch, chunk)
        torch.testing.assert_close(counts, ref_counts, rtol=0, atol=0)
        torch.testing.assert_close(losses, ref_losses, rtol=1e-6, atol=0)  # fp32, only summation order differs
        for slot, g in grads.items():
            torch.testing.assert_close(g, ref_grads[slot], rtol=1e-5, atol=1e-6 * float(ref_grads[slot].abs().max()))


def test_slot_without_target_tokens(tiny_dirs) -> None:
    specs = _specs("llama")[:2]
    pm = _pack(tiny_dirs("llama"), specs)
    masked = [Example(r.input_ids, (IGNORE_INDEX,) * len(r.labels)) for r in random_examples(1, seed=3)]
    batch = collate([0, 1], [masked, random_examples(3, seed=4)], PAD, dropout=[0.0, 0.2], seeds=[1, 2])
    ref_losses, ref_counts, ref_grads = _loss_and_grads(pm, batch, None)
    losses, counts, grads = _loss_and_grads(pm, batch, 5)
    assert counts[0] == 0 and losses[0] == 0 and grads[0].abs().max() == 0
    torch.testing.assert_close(losses, ref_losses, rtol=1e-6, atol=0)
    torch.testing.assert_close(grads[1], ref_grads[1], rtol=1e-5, atol=1e-6 * float(ref_grads[1].abs().max()))
    # no target token in the whole batch: the loss is 0 and backward still runs
    empty = collate([0], [masked], PAD, dropout=[0.0], seeds=[1])
    losses, counts, grads = _loss_and_grads(pm, empty, 5)
    assert counts.tolist() == [0.0] and losses.tolist() == [0.0] and grads[0].abs().max() == 0


def _train(model_dir, family: str, **options):
    pm = PackedModel(load_base(str(model_dir), attn_implementation="eager")[0])
    queue = [SlotJob(spec, SlotStream(random_examples(30, seed=100 + i), spec.micro_batch, seed=spec.seed), key=i)
             for i, spec in enumerate(_specs(family))]
    rec = Recorder(pm, snapshot=lambda slot: torch.cat([t.detach().flatten() for t in pm.slot_parameters(slot)]))

    train(pm, 2, lambda slot: queue.pop(0) if queue else None, pad_id=PAD, on_step=rec.on_step, on_end=rec.on_end,
          **options)
    return rec.losses, rec.final


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_train_with_chunked_ce_equals_plain(tiny_dirs, family: str) -> None:
    ref_losses, ref_final = _train(tiny_dirs(family), family)
    losses, final = _train(tiny_dirs(family), family, chunked_ce=9)
    for key, curve in ref_losses.items():
        assert len(curve) == 10
        torch.testing.assert_close(torch.tensor(losses[key]), torch.tensor(curve), rtol=1e-5, atol=0)
        torch.testing.assert_close(final[key], ref_final[key], rtol=0, atol=1e-5)


def test_chunked_ce_refuses_logit_postprocessing(tiny_dirs) -> None:
    model, _ = load_base(str(tiny_dirs("llama")))
    model.config.final_logit_softcapping = 30.0  # what Gemma-2 applies after the head
    pm = PackedModel(model)
    with pytest.raises(ConfigError, match="final_logit_softcapping"):
        train(pm, 1, lambda slot: None, pad_id=PAD, chunked_ce=True)
    with pytest.raises(ValueError, match="chunked_ce"):
        train(pm, 1, lambda slot: None, pad_id=PAD, chunked_ce=0)


def test_output_head_lookup() -> None:
    """``output_head``: the head or None; ``plain_output_head``: the head, or a ConfigError naming what is wrong."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(tiny_config("llama", 64), dtype=torch.float32)
    assert output_head(model) is model.lm_head
    assert plain_output_head(model) is model.lm_head
    model.config.final_logit_softcapping = 30.0  # Gemma-2's: the head's output is not the logits
    assert output_head(model) is model.lm_head
    with pytest.raises(ConfigError, match=r"^chunked_ce: the model post-processes its logits "
                                          r"\(final_logit_softcapping=30.0\)"):
        plain_output_head(model)

    class Headless(torch.nn.Module):  # an encoder: transformers' get_output_embeddings() answers None
        def get_output_embeddings(self) -> None:
            return None

    for bare in (torch.nn.Linear(4, 8), Headless()):
        assert output_head(bare) is None
        with pytest.raises(ConfigError, match=rf"^chunked_ce: {type(bare).__name__} has no output head"):
            plain_output_head(bare)


def test_chunked_ce_lowers_peak_memory_with_a_large_vocabulary() -> None:
    vocab, seq, micro = 20_000, 64, 8
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        pm = PackedModel(AutoModelForCausalLM.from_config(tiny_config("llama", vocab), dtype=torch.float32))
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (micro, seq), generator=gen).tolist()
    rows = [Example(tuple(x), (IGNORE_INDEX,) * (seq // 2) + tuple(x[seq // 2:])) for x in ids]  # prompt-masked
    spec = AdapterSpec(rank=8, targets=("all-linear",), micro_batch=micro, max_steps=1, seed=0)

    def step(**options) -> int:
        jobs = [SlotJob(spec, FixedBatch(rows))]
        return peak_memory(lambda: train(pm, 1, lambda s: jobs.pop() if jobs else None, pad_id=PAD, **options), pm)

    plain, chunked = step(), step(chunked_ce=64)
    print(f"peak plain {plain / 1e6:.1f} MB, chunked {chunked / 1e6:.1f} MB ({1 - chunked / plain:.0%} less)")
    assert chunked < 0.7 * plain


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_head_gradient_equals_recomputed_one(dtype) -> None:
    """The frozen head's fused path (input gradient made in the forward) against the checkpointed chunks,
    under a non-uniform upstream gradient; a head that trains takes the checkpointed path and gets its grads."""
    from lora_sweep.packer.loss import _token_nll

    gen = torch.Generator().manual_seed(0)
    head = torch.nn.Linear(48, 300, bias=True).to(dtype).requires_grad_(False)
    x0 = torch.randn(37, 48, generator=gen).to(dtype)
    y = torch.randint(0, 300, (37,), generator=gen)
    g = torch.rand(37, generator=gen)  # per-token upstream gradient, as per-slot means give
    got = {}
    for name, chunk in (("fused", 10), ("one-chunk", 64)):
        x = x0.clone().requires_grad_(True)
        nll = _token_nll(head, x, y, chunk)
        (nll * g).sum().backward()
        got[name] = (nll.detach(), x.grad)
    head.requires_grad_(True)
    x = x0.clone().requires_grad_(True)
    nll = _token_nll(head, x, y, 10)  # checkpointed: recomputed in the backward, weight gradient too
    (nll * g).sum().backward()
    assert head.weight.grad is not None and head.weight.grad.abs().max() > 0
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-3)
    for name, (n, gx) in got.items():
        torch.testing.assert_close(n, nll.detach(), **tol, msg=name)
        torch.testing.assert_close(gx, x.grad, **tol, msg=name)
