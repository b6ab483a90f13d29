"""Batched evaluation on a pack's fixed shapes (``packer.step.eval_graph``): the (slot, item) pairs packed into the
fewest forwards, any slot in any segment, one graph per shape whatever the slot set, the same numbers as scoring each
adapter alone on the per-adapter path. CPU, eager (``tests/evaluators/test_gpu.py`` replays the graphs on CUDA)."""

from __future__ import annotations

import pytest

from lora_sweep.evaluators.generation import build_prompts, generate_ids
from lora_sweep.evaluators.heldout_loss import heldout_loss
from lora_sweep.evaluators.registry import load_eval_data
from lora_sweep.packer.step import eval_graph
from lora_sweep.packer.step.eval_graph import Segment, plan
from tests.evaluators.conftest import YESNO
from tests.helpers import scored_alone, scored_pack


def test_plan_packs_every_slots_items_into_the_fewest_forwards() -> None:
    forwards = plan([5, 2], n_items=7, rows=3, capacity=4)
    assert forwards == [[Segment(0, 5, 0, 3), Segment(1, 5, 3, 3), Segment(2, 5, 6, 1), Segment(3, 2, 0, 3)],
                        [Segment(0, 2, 3, 3), Segment(1, 2, 6, 1)]]
    pairs = sorted((s.slot, s.item0 + i) for f in forwards for s in f for i in range(s.n))
    assert pairs == sorted((slot, i) for slot in (5, 2) for i in range(7))  # each pair once
    assert len(plan([0], n_items=80, rows=8, capacity=16)) == 1  # one finished slot: one forward, not ten
    assert len(plan(list(range(16)), n_items=80, rows=8, capacity=16)) == 10
    assert plan([], n_items=5, rows=2, capacity=4) == []


def test_plan_without_remapping_keeps_each_slot_on_its_own_segment() -> None:
    """A pack that has held a DoRA slot: its magnitudes are read by segment, so segment k is slot k."""
    assert plan([1, 3], n_items=5, rows=2, capacity=4, remap=False) == [
        [Segment(1, 1, 0, 2), Segment(3, 3, 0, 2)], [Segment(1, 1, 2, 2), Segment(3, 3, 2, 2)],
        [Segment(1, 1, 4, 1), Segment(3, 3, 4, 1)]]


@pytest.mark.parametrize("dora", [False, True])
def test_batched_evaluation_of_any_slot_set_equals_each_adapter_alone_with_one_graph_per_shape(tiny_dirs,
                                                                                                 dora: bool) -> None:
    pm, tok = scored_pack(tiny_dirs("llama"), dora)
    assert (pm.store.mag is not None) is dora
    data = load_eval_data(YESNO, tok, fmt="prompt_completion", max_length=48)
    prompts = build_prompts(data)[:11]
    gen_kw = {"eos_id": None, "pad_id": tok.pad_token_id, "max_new_tokens": 4}
    alone = {slot: scored_alone(pm, slot, data, prompts, gen_kw) for slot in range(4)}
    assert alone[0][0] != alone[1][0] and alone[0][1] != alone[3][1]  # different adapters
    for slots in ([3], [0, 2], [1, 3, 0], [0, 1, 2, 3], [2]):
        loss = heldout_loss(pm, slots, data, batch_size=3, batched=True)
        ids = generate_ids(pm, slots, prompts, batch_size=2, batched=True, **gen_kw)
        for slot in slots:
            assert loss.per_item[slot]["eval_loss"] == pytest.approx(alone[slot][0], rel=1e-5, abs=1e-6)
            assert ids[slot] == alone[slot][1]
        assert eval_graph.graphs(pm) == (3, 0)  # one held-out forward, one prefill, one decoding step; none captured


def test_a_batched_evaluation_reads_the_device_once(tiny_dirs, monkeypatch: pytest.MonkeyPatch) -> None:
    """However many forwards an evaluation takes, the host waits for the device once (``_read``), so it queues the
    next forward's inputs while the last one runs."""
    pm, tok = scored_pack(tiny_dirs("llama"))
    data = load_eval_data(YESNO, tok, fmt="prompt_completion", max_length=48)
    reads: list[int] = []
    real = eval_graph._read
    monkeypatch.setattr(eval_graph, "_read", lambda results: reads.append(len(results)) or real(results))
    heldout_loss(pm, [0, 1, 2, 3], data, batch_size=2, batched=True)
    generate_ids(pm, [0, 1], build_prompts(data)[:9], eos_id=None, pad_id=tok.pad_token_id, max_new_tokens=2,
                 batch_size=2, batched=True)
    assert reads == [12, 3]  # 4 slots x 12 pieces / 4 segments; 2 slots x 5 pieces / 4 segments


def test_a_batched_decode_stops_once_every_row_has_decoded_eos(tiny_dirs, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every row answers the same prompt under one adapter, so all decode EOS together (the answer's first new token
    after its first, k): the forward stops at the next check instead of decoding ``max_new_tokens``, and the answers
    are the per-adapter path's."""
    pm, tok = scored_pack(tiny_dirs("llama"))
    prompt = build_prompts(load_eval_data(YESNO, tok, fmt="prompt_completion", max_length=48))[0]
    kw = {"pad_id": tok.pad_token_id, "max_new_tokens": 12, "batch_size": 3}
    answer = generate_ids(pm, [0], [prompt], eos_id=None, batched=False, **kw)[0][0]
    k = next(i for i, t in enumerate(answer) if t != answer[0])
    assert k < 6, answer
    eos = answer[k]
    steps: list[int] = []
    real = eval_graph._Decoder._step
    monkeypatch.setattr(eval_graph._Decoder, "_step", lambda self: steps.append(1) or real(self))
    monkeypatch.setattr(eval_graph, "STOP_CHECK", 2)
    batched = generate_ids(pm, [0], [prompt] * 5, eos_id=eos, batched=True, **kw)
    assert batched == generate_ids(pm, [0], [prompt] * 5, eos_id=eos, batched=False, **kw)
    assert all(len(a) == k for a in batched[0])
    assert len(steps) == k + (k + 1) % 2  # to the EOS (step k), then to the next check, which stops it: not 11

