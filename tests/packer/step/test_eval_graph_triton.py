"""Batched evaluation on the Triton path (``packer.step.eval_graph``; the interpreter without CUDA): a segment applies
the adapter its table row names."""

from __future__ import annotations

from tests.conftest import need_triton

need_triton()  # before anything imports the kernels

import pytest  # noqa: E402

from lora_sweep.evaluators.generation import build_prompts, generate_ids  # noqa: E402
from lora_sweep.evaluators.heldout_loss import heldout_loss  # noqa: E402
from lora_sweep.evaluators.registry import load_eval_data  # noqa: E402
from tests.evaluators.conftest import YESNO  # noqa: E402
from tests.helpers import scored_alone, scored_pack  # noqa: E402


@pytest.mark.slow
def test_the_triton_kernels_apply_each_segments_slot_from_its_table_row(tiny_dirs) -> None:
    """The Triton path (the interpreter here) reads a segment's adapter from ``SegInt.rank_off``: slots scored in
    segments other than their own give the per-adapter path's losses and tokens."""
    pm, tok = scored_pack(tiny_dirs("llama"), impl="triton")
    data = load_eval_data(YESNO, tok, fmt="prompt_completion", max_length=48)
    data = type(data)(data.rows[:5], data.fmt, tok, data.source, data.max_length)
    prompts = build_prompts(data)[:3]
    gen_kw = {"eos_id": None, "pad_id": tok.pad_token_id, "max_new_tokens": 3}
    slots = [2, 1]  # held-out: 3 pieces of 2 rows each; slot 2 in segments 0-2, slot 1 in segment 3, then 0-1
    loss = heldout_loss(pm, slots, data, batch_size=2, batched=True)
    ids = generate_ids(pm, slots, prompts, batch_size=2, batched=True, **gen_kw)
    for slot in slots:
        alone = scored_alone(pm, slot, data, prompts, gen_kw)
        assert loss.per_item[slot]["eval_loss"] == pytest.approx(alone[0], rel=1e-4, abs=1e-5)
        assert ids[slot] == alone[1]
