"""The optimizer step in the backward (``train(optimizer_in_backward=True)``) trains exactly as the whole-gradient step.

Each slot's AdamW step is taken layer by layer inside the backward and its gradient dropped; the adapters must end
where the ordinary step (same pack, no clipping) and PEFT + torch AdamW (one slot) put them, and no slot may keep a
gradient buffer.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from lora_sweep.packer.data import SlotStream
from lora_sweep.packer.errors import ConfigError
from lora_sweep.packer.model import PackedModel, load_base
from lora_sweep.packer.plan import AdapterSpec
from lora_sweep.packer.train import SlotJob, train
from tests.conftest import Recorder, random_examples
from tests.packer.test_equivalence import assert_trained_as_peft

PAD = 0
STEPS = 6

SPECS = [  # heterogeneous: ranks, lrs, schedules, weight decay, micro-batches, targets, dropout on one; no clipping
    AdapterSpec(rank=2, alpha=4, lr=3e-3, micro_batch=1, targets=("q_proj", "v_proj"), max_steps=STEPS, seed=1,
                max_grad_norm=None),
    AdapterSpec(rank=4, alpha=16, lr=1e-2, micro_batch=2, targets=("all-linear",), max_steps=STEPS + 2, seed=2,
                rslora=True, weight_decay=0.1, warmup_steps=3, schedule="cosine", max_grad_norm=None, dropout=0.2),
    AdapterSpec(rank=8, alpha=8, lr=5e-3, micro_batch=3, targets=("o_proj", "down_proj"), max_steps=STEPS, seed=3,
                schedule="linear", warmup_steps=2, max_grad_norm=None, betas=(0.8, 0.95)),
]


def _jobs(specs: list[AdapterSpec]) -> list[SlotJob]:
    return [SlotJob(spec, SlotStream(random_examples(40, seed=100 + i), spec.micro_batch, seed=spec.seed), key=i)
            for i, spec in enumerate(specs)]


def _run(model_dir, jobs: list[SlotJob], capacity: int, in_backward: bool, **kw):  # noqa: ANN001, ANN003
    model, _ = load_base(str(model_dir), attn_implementation="eager")
    pm = PackedModel(model, impl="torch")
    queue = list(jobs)
    rec = Recorder(pm)
    starts: dict = {}
    grads_kept: list[bool] = []

    def next_job(slot: int) -> SlotJob | None:
        if not queue:
            return None
        starts[queue[0].key] = (slot, rec.global_step)
        return queue.pop(0)

    def on_step(reports) -> None:  # noqa: ANN001
        rec.on_step(reports)
        if not kw.get("static_shapes"):  # a static slot's gradient is rows of the store's one buffer
            grads_kept.extend(pm.flat_buffers(r.slot)[1] is not None for r in reports)
        norms.extend(r.grad_norm for r in reports)

    norms: list[float] = []
    train(pm, capacity, next_job, pad_id=PAD, on_step=on_step, on_end=rec.on_end, optimizer_in_backward=in_backward,
          **kw)
    return rec.losses, rec.final, starts, grads_kept, norms


def _assert_same(a: tuple, b: tuple, keys) -> None:  # noqa: ANN001
    for key in keys:
        assert len(a[0][key]) >= STEPS
        torch.testing.assert_close(torch.tensor(a[0][key]), torch.tensor(b[0][key]), rtol=1e-6, atol=0)
        for path, (wa, wb) in a[1][key].items():
            assert wb.abs().max() > 0, "B never moved: the test would not see a wrong update"
            torch.testing.assert_close(wa, b[1][key][path][0], rtol=0, atol=1e-6)
            torch.testing.assert_close(wb, b[1][key][path][1], rtol=0, atol=1e-6)


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "activation-checkpointing"])
def test_step_in_backward_equals_whole_gradient_step(tiny_dirs, checkpointing: bool) -> None:
    ours = _run(tiny_dirs("llama"), _jobs(SPECS), 3, True, activation_checkpointing=checkpointing)
    ref = _run(tiny_dirs("llama"), _jobs(SPECS), 3, False, activation_checkpointing=checkpointing)
    _assert_same(ours, ref, range(len(SPECS)))
    assert ours[3] and not any(ours[3]), "a slot stepping in the backward keeps no gradient buffer"
    assert all(ref[3])
    torch.testing.assert_close(torch.tensor(ours[4]), torch.tensor(ref[4]), rtol=1e-5, atol=0)  # reported norms


def test_step_in_backward_equals_peft(tiny_dirs) -> None:
    job = _jobs([replace(SPECS[1], dropout=0.0)])[0]
    losses, final, *_ = _run(tiny_dirs("llama"), [job], 1, True)
    assert_trained_as_peft(tiny_dirs("llama"), _jobs([replace(SPECS[1], dropout=0.0)])[0], losses, final,
                           min_steps=STEPS)


def test_gpt2_shared_projections_step_once(tiny_dirs) -> None:
    """GPT-2's fused c_attn and Conv1D layers: every piece is stepped exactly once per step."""
    specs = [AdapterSpec(rank=4, alpha=8, lr=1e-2, micro_batch=2, max_steps=STEPS, seed=5, max_grad_norm=None),
             AdapterSpec(rank=2, alpha=4, lr=5e-3, micro_batch=1, targets=("c_attn",), max_steps=STEPS, seed=6,
                         max_grad_norm=None, weight_decay=0.05)]
    _assert_same(_run(tiny_dirs("gpt2"), _jobs(specs), 2, True), _run(tiny_dirs("gpt2"), _jobs(specs), 2, False),
                 range(2))


def test_refilled_slot_trains_as_in_a_fresh_run(tiny_dirs) -> None:
    short = replace(SPECS[0], max_steps=3)
    late = replace(SPECS[2], dropout=0.1, max_steps=STEPS)
    ours = _run(tiny_dirs("llama"), _jobs([short, SPECS[1], late]), 2, True)
    assert ours[2][2] == (0, 3), "the late job must have started in the freed slot mid-run"
    fresh = _run(tiny_dirs("llama"), [_jobs([short, SPECS[1], late])[2]], 1, True)
    _assert_same(ours, fresh, [2])


@pytest.mark.parametrize(("change", "key"), [({"max_grad_norm": 1.0}, "max_grad_norm"),
                                             ({"gradient_accumulation_steps": 2}, "gradient_accumulation_steps")])
def test_clipping_and_accumulation_are_refused(tiny_dirs, change: dict, key: str) -> None:
    job = _jobs([replace(SPECS[0], **change)])[0]
    with pytest.raises(ConfigError, match=f"^optimizer_in_backward: needs {key}: "):
        _run(tiny_dirs("llama"), [job], 1, True)


def test_static_step_takes_the_same_updates_after_the_backward_and_says_so(tiny_dirs) -> None:
    """The static step keeps its one gradient buffer: with ``optimizer_in_backward`` it trains as the step in the
    backward does (the same math, another summation order: padded rows), warns once that it keeps the buffer,
    and refuses a job that clips as the step in the backward does."""
    ref = _run(tiny_dirs("llama"), _jobs(SPECS), 3, True)
    with pytest.warns(UserWarning, match="optimizer_in_backward: the static-shape step keeps") as caught:
        ours = _run(tiny_dirs("llama"), _jobs(SPECS), 3, True, static_shapes=True)
    assert len([w for w in caught if "optimizer_in_backward" in str(w.message)]) == 1
    for key in range(len(SPECS)):
        torch.testing.assert_close(torch.tensor(ours[0][key]), torch.tensor(ref[0][key]), rtol=1e-5, atol=0)
        for path, (wa, wb) in ours[1][key].items():
            assert wb.abs().max() > 0
            torch.testing.assert_close(wa, ref[1][key][path][0], rtol=0, atol=1e-5)
            torch.testing.assert_close(wb, ref[1][key][path][1], rtol=0, atol=1e-5)
    with pytest.raises(ConfigError, match="^optimizer_in_backward: needs max_grad_norm: "), pytest.warns(UserWarning):
        _run(tiny_dirs("llama"), _jobs([replace(SPECS[0], max_grad_norm=1.0)]), 1, True, static_shapes=True)


def test_planner_calibrates_without_gradient_buffers(tiny_dirs) -> None:
    """The memory model measured with the option keeps no gradient buffer: about 4 B less per adapter parameter
    (the fp32 gradient), and never under the 12 B of weights and moments."""
    from lora_sweep.packer.plan import IN_BACKWARD_BYTES_PER_PARAM
    from lora_sweep.packer.probe import calibrate

    model, _ = load_base(str(tiny_dirs("llama")), attn_implementation="eager")
    pm = PackedModel(model, impl="torch")
    off = calibrate(pm, 32, rows=(1, 3))
    on = calibrate(pm, 32, rows=(1, 3), optimizer_in_backward=True)
    assert on.optimizer_in_backward and not off.optimizer_in_backward
    assert IN_BACKWARD_BYTES_PER_PARAM <= on.bytes_per_param <= off.bytes_per_param - 3, (on, off)


def test_pieces_stepped_in_the_backward_equal_the_whole_step() -> None:
    """``PackedAdamW`` directly: pieces given in any order, one piece no gradient reaches (a zero gradient, as the
    whole step sees it), over several steps, equal ``step`` on the flat buffers; a piece twice is an error."""
    from lora_sweep.packer.optim import PackedAdamW

    specs = [AdapterSpec(lr=1e-2, weight_decay=0.1, schedule="cosine", warmup_steps=1, max_steps=5, max_grad_norm=None),
             AdapterSpec(lr=3e-3, betas=(0.8, 0.95), eps=1e-6, max_steps=5, max_grad_norm=None)]
    sizes = (6, 10, 4)
    g = torch.Generator().manual_seed(0)
    init = {s: torch.randn(sum(sizes), generator=g) for s in (0, 1)}
    whole, pieces = PackedAdamW(), PackedAdamW()
    flat_w = {s: (init[s].clone(), torch.zeros(sum(sizes))) for s in (0, 1)}
    flat_p = {s: init[s].clone() for s in (0, 1)}
    for s, spec in enumerate(specs):
        whole.add_slot(s, *flat_w[s], spec)
        pieces.add_slot(s, flat_p[s], None, spec)
    views = {s: list(flat_p[s].split(sizes)) for s in (0, 1)}
    for step in range(5):
        grads = {s: torch.randn(sum(sizes), generator=g) for s in (0, 1)}
        missing = step >= 2  # from step 2 slot 1's last piece gets no gradient (its moments are not zero by then)
        if missing:
            grads[1][sizes[0] + sizes[1]:] = 0
        for s in (0, 1):
            flat_w[s][1].copy_(grads[s])
        ref_lrs = [whole.lr(0), whole.lr(1)]
        ref_norms = whole.step([0, 1])
        assert pieces.begin_step([0, 1]) == ref_lrs  # the schedule at the step taken, advanced once
        split = {s: list(grads[s].split(sizes)) for s in (0, 1)}
        pieces.backward_step([views[1][1], views[0][2]], [split[1][1], split[0][2]])
        pieces.backward_step([views[0][0], views[1][0], views[0][1]], [split[0][0], split[1][0], split[0][1]])
        if not missing:
            pieces.backward_step([views[1][2]], [split[1][2]])
        with pytest.raises(RuntimeError, match="two gradients"):
            pieces.backward_step([views[0][0]], [split[0][0]])
        norms = pieces.end_step({s: views[s] for s in (0, 1)})
        torch.testing.assert_close(norms, ref_norms, rtol=1e-6, atol=0)
        for s in (0, 1):
            torch.testing.assert_close(flat_p[s], flat_w[s][0], rtol=0, atol=1e-7)
    assert not torch.equal(flat_p[1], init[1])
