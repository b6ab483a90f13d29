"""Held-out loss and greedy generation scored batched on a static pack's fixed shapes (``packer.step.eval_graph``) equal
the per-adapter path's.

On the CPU the batched path runs eagerly (no CUDA graphs) where a test asks for it (``batched=True``: its default,
auto, takes the per-adapter path there); the shapes, tables, static KV cache and 4D masks are the
ones a CUDA graph replays on the GPU (``test_gpu.py`` checks the captured decode there)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from lora_sweep.errors import ConfigError
from lora_sweep.evaluators._core import uses_batched
from lora_sweep.evaluators.generation import GenerationOptions, build_prompts, generate_ids, generate_texts
from lora_sweep.evaluators.heldout_loss import HeldoutOptions, heldout_loss
from lora_sweep.evaluators.registry import load_eval_data, validate
from lora_sweep.packer.step import eval_graph
from tests.evaluators.conftest import YESNO
from tests.helpers import pack_evaluations


def _spy(monkeypatch: pytest.MonkeyPatch, name: str) -> list[int]:
    """Count the calls of ``packer.step.eval_graph.<name>`` (the static path was taken, not only the fallback)."""
    calls: list[int] = []
    real = getattr(eval_graph, name)

    def counted(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(eval_graph, name, counted)
    return calls


def _forwards(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The number of forwards of each batched evaluation (the length of each ``eval_graph.plan``)."""
    seen: list[int] = []
    real = eval_graph.plan

    def counted(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        forwards = real(*args, **kwargs)
        seen.append(len(forwards))
        return forwards

    monkeypatch.setattr(eval_graph, "plan", counted)
    return seen


def test_batched_heldout_loss_equals_the_per_adapter_one(tiny_dirs, monkeypatch: pytest.MonkeyPatch) -> None:
    seen, calls, forwards, sizes = [], _spy(monkeypatch, "row_losses"), _forwards(monkeypatch), []

    def check(pm, slots, tok) -> None:  # noqa: ANN001
        data = load_eval_data(YESNO, tok, fmt="prompt_completion", max_length=48)
        batched = heldout_loss(pm, slots, data, batch_size=3, batched=True)
        per_adapter = heldout_loss(pm, slots, data, batch_size=3, batched=False)
        for slot in slots:
            assert batched.metrics[slot]["eval_loss"] == pytest.approx(per_adapter.metrics[slot]["eval_loss"], rel=1e-5)
            assert batched.per_item[slot]["eval_loss"] == pytest.approx(per_adapter.per_item[slot]["eval_loss"],
                                                                        rel=1e-5)
        seen.append({s: batched.metrics[s]["eval_loss"] for s in slots})
        sizes.append(len(slots))

    pack_evaluations(tiny_dirs("llama"), check)
    assert len(calls) == 2 * 2  # slot ends x slot sets, one call each: the static path only
    # 24 rows in pieces of 3 per slot, 4 segments a forward: the forwards follow the scored slots, not the capacity
    assert forwards == [-(-8 * n // 4) for n in sizes] and min(sizes) < 4
    assert len({round(v, 4) for d in seen for v in d.values()}) > 1  # the slots are different adapters


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_batched_greedy_decoding_equals_the_per_adapter_one(tiny_dirs, attn: str, monkeypatch) -> None:  # noqa: ANN001
    calls = _spy(monkeypatch, "greedy_decode")
    def check(pm, slots, tok) -> None:  # noqa: ANN001
        data = load_eval_data(YESNO, tok, fmt="prompt_completion", max_length=48)
        prompts = build_prompts(data)[:7]  # 3 chunks of 3: the last one has free rows
        kw = {"pad_id": tok.pad_token_id, "max_new_tokens": 5, "batch_size": 3}
        per_adapter = generate_ids(pm, slots, prompts, eos_id=None, batched=False, **kw)
        assert generate_ids(pm, slots, prompts, eos_id=None, batched=True, **kw) == per_adapter
        assert all(len(a) == 5 for answers in per_adapter.values() for a in answers)
        eos = per_adapter[slots[0]][0][2]  # a token some answer reaches: answers are cut before it
        cut = generate_ids(pm, slots, prompts, eos_id=eos, batched=False, **kw)
        assert generate_ids(pm, slots, prompts, eos_id=eos, batched=True, **kw) == cut
        assert any(len(a) < 5 for answers in cut.values() for a in answers)
        stop = tok.decode(per_adapter[slots[-1]][1][1:3])  # a stop string: cut after the token that completes it
        texts = {s: generate_texts(pm, slots, prompts, tok, stop=[stop], batched=s, max_new_tokens=5,
                                   batch_size=3) for s in (True, False)}
        assert texts[True] == texts[False]

    pack_evaluations(tiny_dirs("llama"), check, attn)
    assert len(calls) == 2 * 2 * 3  # slot ends x slot sets x static calls, each one call for all chunks


def test_the_heldout_budget_counts_the_measured_bytes_per_logit_of_the_packs_loss(tiny_dirs, monkeypatch) -> None:
    """Full logits (the torch path here) count 10 B each, the Triton path's fused loss head 2.5 B
    (``HELDOUT_BYTES_PER_LOGIT``, ``benchmarks.eval_memory``): the same shape fits a budget on one and not the other."""
    seen = []

    def check(pm, slots, tok) -> None:  # noqa: ANN001
        logits = pm.store.capacity * 3 * 48 * pm.model.config.vocab_size
        monkeypatch.setattr(eval_graph, "LOGITS_BYTES", logits * 10)
        assert eval_graph.heldout_fits(pm, 3, 48) and not eval_graph.heldout_fits(pm, 3, 49)
        monkeypatch.setattr(eval_graph, "LOGITS_BYTES", logits * 5)
        assert not eval_graph.heldout_fits(pm, 3, 48)
        monkeypatch.setattr(eval_graph, "_triton", lambda pm: True)  # the fused head's 2.5 B: it fits
        assert eval_graph.heldout_fits(pm, 3, 48)
        monkeypatch.setattr(eval_graph, "fused_loss_head", lambda model: None)  # a head it cannot take: 10 B
        assert not eval_graph.heldout_fits(pm, 3, 48)
        monkeypatch.undo()
        seen.append(slots)

    pack_evaluations(tiny_dirs("llama"), check)
    assert seen


def test_a_static_heldout_shape_over_the_logits_budget_takes_the_per_adapter_path(tiny_dirs, monkeypatch) -> None:
    calls = _spy(monkeypatch, "row_losses")
    monkeypatch.setattr(eval_graph, "LOGITS_BYTES", 1024)

    def check(pm, slots, tok) -> None:  # noqa: ANN001
        assert not eval_graph.heldout_fits(pm, 3, 48)
        data = load_eval_data(YESNO, tok, fmt="prompt_completion", max_length=48)
        result = heldout_loss(pm, slots, data, batch_size=3, batched=True)
        assert all(result.metrics[s]["eval_loss"] > 0 for s in slots)

    pack_evaluations(tiny_dirs("llama"), check)
    assert calls == []


def test_auto_evaluates_per_adapter_on_the_cpu_and_on_the_fixed_shapes_on_cuda(tiny_dirs, monkeypatch) -> None:
    """``batched: auto`` (the default): the CPU takes the per-adapter path, which holds only the scored adapters'
    rows; CUDA, where a graph replays each forward, the fixed shapes."""
    losses, decodes = _spy(monkeypatch, "row_losses"), _spy(monkeypatch, "greedy_decode")

    def check(pm, slots, tok) -> None:  # noqa: ANN001
        data = load_eval_data(YESNO, tok, fmt="prompt_completion", max_length=48)
        heldout_loss(pm, slots, data, batch_size=3)
        generate_ids(pm, slots, build_prompts(data)[:3], eos_id=None, pad_id=tok.pad_token_id, max_new_tokens=2)
        assert uses_batched("auto", SimpleNamespace(device=torch.device("cuda")))  # type: ignore[arg-type]
        assert uses_batched(True, pm) and not uses_batched(False, pm) and not uses_batched("auto", pm)

    pack_evaluations(tiny_dirs("llama"), check)
    assert losses == [] and decodes == []


@pytest.mark.parametrize("value", ["yes", 1, None, "Auto"])
def test_batched_is_true_false_or_auto(value) -> None:
    with pytest.raises(ConfigError, match=r"batched: must be true, false or auto"):
        HeldoutOptions(batched=value)
    with pytest.raises(ConfigError, match=r"batched: must be true, false or auto"):
        GenerationOptions(batched=value)


def test_static_shapes_is_an_alias_of_batched() -> None:
    """A study file written with the option's former name keeps working; both names at once is an error."""
    assert validate("heldout_loss", {"static_shapes": False}) == HeldoutOptions(batched=False)
    assert validate("generation", {"static_shapes": True}).batched is True
    with pytest.raises(ConfigError, match=r"^generation\.options\.static_shapes: is an alias of batched; give one"):
        validate("generation", {"static_shapes": True, "batched": False})


@pytest.mark.parametrize("triton", [True, False])
def test_an_evaluation_graph_compiles_its_triton_kernels_in_parallel_before_its_capture(monkeypatch, triton) -> None:
    order: list[str] = []
    monkeypatch.setattr(eval_graph, "precompile", lambda fn: order.append("precompile"))
    monkeypatch.setattr(eval_graph, "capture", lambda fn: order.append("capture") or type("C", (), {"graph": 1})())
    graph = eval_graph._Graph(lambda: None, cuda=True, triton=triton)
    assert graph.ready() and not graph.ready()  # captured once
    assert order == (["precompile", "capture"] if triton else ["capture"])
