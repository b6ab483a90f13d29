"""The fixed-shape step on the CPU (eager): refills without new buffers, the ring buffer, padding, callbacks."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from lora_sweep.packer.model.load import load_base
from lora_sweep.packer.model.packed import PackedModel
from lora_sweep.packer.model.store import SlotStore
from lora_sweep.packer.step import loop
from lora_sweep.packer.step.train import train
from tests.conftest import Recorder
from tests.helpers import LLAMA_SPECS, PAD, run_packed, slot_jobs

FIELDS = ("step", "slot", "key", "slot_step", "tokens", "input_tokens")


def _train(model_dir, jobs, capacity, on_step_extra: list | None = None, **kw):  # noqa: ANN001, ANN003, ANN202
    model, _ = load_base(str(model_dir), attn_implementation="eager")
    pm = PackedModel(model, impl="torch")
    queue = list(jobs)
    rec = Recorder(pm)
    reports, calls = on_step_extra if on_step_extra is not None else [], []

    def on_step(reps) -> None:  # noqa: ANN001
        calls.append(reps[0].step)
        reports.extend(reps)
        rec.on_step(reps)

    result = train(pm, capacity, lambda slot: queue.pop(0) if queue else None, pad_id=PAD, on_step=on_step,
                   on_end=rec.on_end, **kw)
    return rec, reports, result, pm


def test_ring_buffer_reports_equal_reading_every_step(tiny_dirs) -> None:
    """Every per-step report (loss, counts, lr, grad norm), read back every 8 steps, equals the one read back
    after every step."""
    specs = [replace(s, max_steps=11 + i) for i, s in enumerate(LLAMA_SPECS[:3])]
    _, eager, _, _ = _train(tiny_dirs("llama"), slot_jobs(specs), 3, readback_every=1)
    _, ring, result, _ = _train(tiny_dirs("llama"), slot_jobs(specs), 3, readback_every=8)
    assert len(ring) == len(eager) == sum(s.max_steps for s in specs)
    for a, b in zip(eager, ring, strict=True):
        assert [getattr(a, f) for f in FIELDS] == [getattr(b, f) for f in FIELDS]
        assert b.lr == pytest.approx(a.lr, rel=1e-12)
        assert b.loss == pytest.approx(a.loss, rel=1e-5)
        assert b.grad_norm == pytest.approx(a.grad_norm, rel=1e-5)
    assert result.graphs == 0  # no CUDA here: eager


def test_reports_arrive_in_batches_at_readback_points(tiny_dirs, monkeypatch: pytest.MonkeyPatch) -> None:
    """The ring is read every K steps and when a slot ends (the only syncs); on_step still sees every step."""
    reads: list[int] = []
    flush = loop.flush

    def counting(ring, pending, *args):  # noqa: ANN001, ANN002, ANN202
        if pending:
            reads.append(pending[-1].step)
        return flush(ring, pending, *args)

    monkeypatch.setattr(loop, "flush", counting)
    specs = [replace(LLAMA_SPECS[0], max_steps=13), replace(LLAMA_SPECS[2], max_steps=20)]
    _, reports, _, _ = _train(tiny_dirs("llama"), slot_jobs(specs), 2, readback_every=8)
    assert reads == [7, 12, 19]  # steps 0-7, then 8-12 (slot 0 ends at 13 steps), then 13-19
    assert [r.step for r in reports if r.slot == 1] == list(range(20))


def test_refill_without_new_buffers_trains_as_a_fresh_run(tiny_dirs, monkeypatch: pytest.MonkeyPatch) -> None:
    """A job started mid-run in a freed slot (same store, same step buffers: nothing to re-capture) trains
    exactly as the same job in a fresh run."""
    built: list[tuple] = []
    shape_buffers = SlotStore.shape_buffers

    def counting(self, rows, seq_len):  # noqa: ANN001, ANN202
        built.append((rows, seq_len))
        return shape_buffers(self, rows, seq_len)

    monkeypatch.setattr(SlotStore, "shape_buffers", counting)
    short = replace(LLAMA_SPECS[1], max_steps=5, micro_batch=3)
    late = replace(LLAMA_SPECS[2], dropout=0.2, max_steps=12)
    jobs = slot_jobs([short, LLAMA_SPECS[3], late])
    rec, reports, _, _ = _train(tiny_dirs("llama"), jobs, 2, max_rows=16)
    assert next(r for r in reports if r.key == 2).step == 5 and next(r for r in reports if r.key == 2).slot == 0
    assert len({(r, s) for r, s in built}) == len(built)  # each step shape built once, never for a refill
    fresh_losses, fresh_final = run_packed(tiny_dirs("llama"), [slot_jobs([short, LLAMA_SPECS[3], late])[2]], 1)
    torch.testing.assert_close(torch.tensor(rec.losses[2]), torch.tensor(fresh_losses[2]), rtol=1e-5, atol=0)
    for path, (a, b) in rec.final[2].items():
        torch.testing.assert_close(a, fresh_final[2][path][0], rtol=0, atol=1e-5)
        torch.testing.assert_close(b, fresh_final[2][path][1], rtol=0, atol=1e-5)


def test_padding_rows_stay_zero_and_larger_ranks_move_the_pack(tiny_dirs) -> None:
    """Rank padding and untargeted layers stay exactly zero while the slot trains; a job whose rank exceeds the
    bucket moves the live slots to a larger one (weights and moments), and every job still trains as alone."""
    small = replace(LLAMA_SPECS[0], max_steps=8)  # rank 2, q/v only
    big = replace(LLAMA_SPECS[3], rank=32, max_steps=6)  # arrives at step 3 in a pack of bucket 16
    seen = {}

    def snapshot(pm):  # noqa: ANN001, ANN202
        def take(slot: int) -> dict:
            store = pm.store
            r0, r1 = slot * store.rank_bucket, (slot + 1) * store.rank_bucket
            rank = pm.specs[slot].rank
            for p in store.paths:
                pad_a, pad_bt = store.a[p].data[r0 + rank:r1], store.bt[p].data[r0 + rank:r1]
                assert pad_a.count_nonzero() == 0 and pad_bt.count_nonzero() == 0, p
                if p not in pm.slot_paths[slot]:
                    assert store.a[p].data[r0:r1].count_nonzero() == 0, p
            seen[slot] = store.rank_bucket
            return {p: (a.detach().clone(), b.detach().clone()) for p, (a, b) in pm.slot_weights(slot).items()}
        return take

    model, _ = load_base(str(tiny_dirs("llama")), attn_implementation="eager")
    pm = PackedModel(model, impl="torch")
    jobs = slot_jobs([replace(LLAMA_SPECS[1], max_steps=3), small, big])
    rec = Recorder(pm)
    rec.snapshot = snapshot(pm)
    train(pm, 2, lambda slot: jobs.pop(0) if jobs else None, pad_id=PAD, on_step=rec.on_step, on_end=rec.on_end,
          readback_every=2)
    assert seen == {0: 32, 1: 32}
    for i, spec in ((1, small), (2, big)):
        alone_losses, alone_final = run_packed(tiny_dirs("llama"), [slot_jobs([LLAMA_SPECS[1], small, big])[i]], 1)
        torch.testing.assert_close(torch.tensor(rec.losses[i]), torch.tensor(alone_losses[i]), rtol=1e-5, atol=0)
        for path, (a, b) in rec.final[i].items():
            torch.testing.assert_close(a, alone_final[i][path][0], rtol=0, atol=1e-5)
            torch.testing.assert_close(b, alone_final[i][path][1], rtol=0, atol=1e-5)
        assert len(rec.losses[i]) == spec.max_steps


def test_should_stop_latency(tiny_dirs) -> None:
    """A stop asked at a sync step ends the slot there; elsewhere it lands at the next readback (documented
    latency, at most K - 1 steps)."""
    specs = [replace(LLAMA_SPECS[0], max_steps=30), replace(LLAMA_SPECS[2], max_steps=30)]

    def run(sync_steps):  # noqa: ANN001, ANN202
        model, _ = load_base(str(tiny_dirs("llama")), attn_implementation="eager")
        jobs = slot_jobs(specs)
        return train(PackedModel(model, impl="torch"), 2, lambda slot: jobs.pop(0) if jobs else None, pad_id=PAD,
                     should_stop=lambda r: r.key == 0 and r.slot_step == 4, readback_every=8,
                     sync_steps=sync_steps)

    assert run({4}).ended[0] == (0, 4, "stopped")
    assert run(()).ended[0] == (0, 8, "stopped")  # asked at step 4, read back after step 8


def test_operand_copy_follows_the_weights_into_every_forward(tiny_dirs, monkeypatch: pytest.MonkeyPatch) -> None:
    """The bf16 weight copy the Triton kernels read (``use_operands``; a bf16 model on CUDA) is refreshed as each
    step or evaluation forward enters ``stepping``: after the weights change (an optimizer step, a refill), no
    forward reads the old ones. (On the CPU the kernels read fp32 masters, so the dtype is forced here.)"""
    from lora_sweep.kernels import ops

    model, _ = load_base(str(tiny_dirs("llama")), attn_implementation="eager")
    pm = PackedModel(model, impl="torch")
    store = SlotStore(pm.model, pm.state, pm.layers, 2, 16, pm.device)
    monkeypatch.setattr(ops, "lora_operand_dtype", lambda act: torch.bfloat16)
    store.use_operands(torch.bfloat16)
    path = store.paths[0]
    assert store.a_op[path].dtype == torch.bfloat16 and store.a_op[path].shape == store.a[path].shape
    shape = store.shape_buffers(1, 8)
    for value in (0.5, -2.0):  # weights written between two forwards
        with torch.no_grad():
            store.flat.fill_(value)
        with store.stepping(shape, False):
            assert torch.equal(store.a_op[path], store.a[path].detach().to(torch.bfloat16))
            assert torch.equal(store.bt_op[path], store.bt[path].detach().to(torch.bfloat16))


def test_a_profiler_marks_every_step_after_its_reports(tiny_dirs) -> None:
    """``profiler``: ``step()`` once per global step, after that step's reports (torch's profiler, scheduled over
    the pack's steps: its step ranges are the loop's)."""
    from torch.profiler import ProfilerActivity, profile, schedule

    marks: list[int] = []
    reported: list[int] = []

    class Counting:
        def step(self) -> None:
            marks.append(len(reported))

    specs = [replace(LLAMA_SPECS[0], max_steps=5), replace(LLAMA_SPECS[2], max_steps=3)]
    jobs = slot_jobs(specs)
    *_, result, _ = _train(tiny_dirs("llama"), jobs, 2, readback_every=1, profiler=Counting(),
                           on_step_extra=reported)
    assert marks == [2, 4, 6, 7, 8] and result.steps == 5  # each step's reports (2 slots, then 1) before its mark
    with profile(activities=[ProfilerActivity.CPU],
                 schedule=schedule(wait=1, warmup=1, active=2, repeat=1)) as prof:
        _train(tiny_dirs("llama"), slot_jobs(specs), 2, profiler=prof)
    # wait and warm-up take the loop's steps 0 and 1: the profiler records steps 2 and 3
    assert sum(e.name.startswith("ProfilerStep") for e in prof.events()) == 2
