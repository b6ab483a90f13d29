"""PackedAdamW equals one torch AdamW + clip_grad_norm_ + schedule per slot, slots coming and going."""

from __future__ import annotations

import torch
from torch import nn

from lora_sweep.packer.optim import PackedAdamW
from lora_sweep.packer.plan import AdapterSpec
from lora_sweep.packer.train import make_optimizer, make_scheduler

SPECS = [
    AdapterSpec(lr=1e-2, max_grad_norm=0.1, weight_decay=0.1, schedule="cosine", warmup_steps=2, max_steps=9),
    AdapterSpec(lr=3e-3, max_grad_norm=None, betas=(0.8, 0.95), eps=1e-6, schedule="linear", max_steps=9),
    AdapterSpec(lr=5e-2, max_grad_norm=10.0, max_steps=9),
]


SHAPES = ((3, 7), (7,), (2, 5))


def _params(seed: int) -> list[nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [nn.Parameter(torch.randn(shape, generator=g)) for shape in SHAPES]


def _flat(params: list[nn.Parameter]) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.cat([p.detach().flatten() for p in params]), torch.zeros(sum(p.numel() for p in params))


def _views(flat: torch.Tensor) -> list[torch.Tensor]:
    out, off = [], 0
    for shape in SHAPES:
        n = torch.Size(shape).numel()
        out.append(flat[off:off + n].view(shape))
        off += n
    return out


def test_packed_adamw_equals_per_slot_torch_adamw() -> None:
    packed = PackedAdamW()
    ours = {i: _flat(_params(i)) for i in range(3)}
    ref = {i: _params(i) for i in range(3)}
    ref_opt = {i: make_optimizer(ref[i], s) for i, s in enumerate(SPECS)}
    ref_sched = {i: make_scheduler(ref_opt[i], s) for i, s in enumerate(SPECS)}
    for i, s in enumerate(SPECS[:2]):
        packed.add_slot(i, *ours[i], s)
    g = torch.Generator().manual_seed(9)
    for step in range(8):
        if step == 3:  # slot 0 leaves, slot 2 arrives mid-run with fresh state
            packed.remove_slot(0)
            packed.add_slot(2, *ours[2], SPECS[2])
        live = [0, 1] if step < 3 else [1, 2]
        for i in live:
            grads = [torch.randn(shape, generator=g) * (5.0 if i == 2 else 1.0) for shape in SHAPES]
            for view, q, gr in zip(_views(ours[i][1]), ref[i], grads, strict=True):
                view.copy_(gr)
                q.grad = gr.clone()
        lrs = [packed.lr(i) for i in live]
        norms = packed.step(live)
        for k, i in enumerate(live):
            assert lrs[k] == ref_sched[i].get_last_lr()[0]
            spec = SPECS[i]
            ref_norm = (torch.nn.utils.clip_grad_norm_(ref[i], spec.max_grad_norm) if spec.max_grad_norm
                        else torch.nn.utils.get_total_norm([p.grad for p in ref[i]]))
            torch.testing.assert_close(norms[k], ref_norm.float(), rtol=1e-6, atol=0)
            ref_opt[i].step()
            ref_sched[i].step()
            ref_opt[i].zero_grad(set_to_none=True)
            for p, q in zip(_views(ours[i][0]), ref[i], strict=True):
                torch.testing.assert_close(p, q.detach(), rtol=1e-6, atol=1e-7)
            assert torch.count_nonzero(ours[i][1]) == 0, "gradients are zeroed for the next accumulation"
    assert not torch.equal(ours[2][0], _flat(_params(2))[0]), "slot 2 must have moved"
