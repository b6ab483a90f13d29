"""The PEFT oracle the training step is held to (tests/packer/step/test_equivalence.py, tests/packer/model/
test_families.py): one adapter alone, PEFT on a fresh copy of the base, torch AdamW and transformers' schedule
(``benchmarks.baseline``), the same batches, the loss computed by transformers itself."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import NamedTuple

import torch
from peft import LoraConfig, get_peft_model
from torch import nn
from transformers import AutoModelForCausalLM
from transformers.pytorch_utils import Conv1D

from lora_sweep.benchmarks.baseline import make_scheduler
from lora_sweep.packer.data.batch import collate
from lora_sweep.packer.data.rows import SlotStream
from lora_sweep.packer.model.packed import PackedModel, load_base
from lora_sweep.packer.plan import AdapterSpec

PAD = 0


@contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Run the oracle and the engine in ``dtype``: torch's default dtype, in which the engine allocates its slot
    store and PEFT its LoRA weights, and to which ``initial_a`` and ``run_peft`` cast the base."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


def initial_a(model_dir: Path, spec: AdapterSpec) -> dict[str, torch.Tensor]:
    """The engine's initial A for ``spec`` (it depends on the seed only), to start PEFT from the same point."""
    model, _ = load_base(str(model_dir), attn_implementation="eager")
    pm = PackedModel(model.to(torch.get_default_dtype()))
    pm.add_slot(0, spec)
    return {p: a.detach().clone() for p, (a, _) in pm.slot_weights(0).items()}


class PeftRun(NamedTuple):
    losses: list[float]
    """The loss of every optimizer step."""
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]
    """Module path -> final (A (r, D_in), B (D_out, r))."""
    moments: dict[str, tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]]
    """Module path -> AdamW's final (exp_avg, exp_avg_sq) of A and of B (``PackedModel.slot_moments``' layout)."""


def adamw_steps(model: nn.Module, params: list[nn.Parameter], spec: AdapterSpec,
                stream: SlotStream) -> tuple[list[float], torch.optim.Optimizer]:
    """``spec.max_steps`` steps of ``model`` (a PEFT model: its loss from ``labels``) on ``stream``'s batches, torch
    AdamW on ``params`` with ``spec``'s clipping and schedule; returns the losses and the optimizer (its state)."""
    opt = torch.optim.AdamW(params, lr=spec.lr, betas=spec.betas, eps=spec.eps, weight_decay=spec.weight_decay)
    sched = make_scheduler(opt, spec)
    losses = []
    for _ in range(spec.max_steps):
        b = collate([0], [stream.next_batch()], PAD, dropout=[0.0], seeds=[0])
        out = model(input_ids=b.input_ids, attention_mask=b.attention_mask, labels=b.labels)
        out.loss.backward()
        losses.append(out.loss.item())
        if spec.max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(params, spec.max_grad_norm)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
    return losses, opt


def run_peft(model_dir: Path, spec: AdapterSpec, stream: SlotStream, init_a: dict[str, torch.Tensor],
             targets: str | None = None) -> PeftRun:
    """``spec``'s adapter alone for ``spec.max_steps`` steps of ``stream``'s batches, from ``init_a``.

    Args:
        targets: PEFT's ``target_modules`` (``all-linear``: PEFT's own resolution, which must adapt exactly the
            modules of ``init_a``); None: the leaf names of ``init_a``'s paths.
    """
    base = AutoModelForCausalLM.from_pretrained(str(model_dir), attn_implementation="eager",
                                                dtype=torch.get_default_dtype())
    conv1d = any(isinstance(m, Conv1D) for m in base.modules())
    cfg = LoraConfig(r=spec.rank, lora_alpha=spec.alpha, lora_dropout=0.0, use_rslora=spec.rslora, bias="none",
                     target_modules=targets or sorted({p.rsplit(".", 1)[-1] for p in init_a}), fan_in_fan_out=conv1d)
    model = get_peft_model(base, cfg)
    model.eval()  # base dropout off, as in the engine; gradients still flow
    named = dict(model.named_parameters())
    lora = {path: (named[f"base_model.model.{path}.lora_A.default.weight"],
                   named[f"base_model.model.{path}.lora_B.default.weight"]) for path in init_a}
    params = [p for p in model.parameters() if p.requires_grad]
    assert len(params) == 2 * len(init_a), "PEFT adapts other modules than the engine's slot"
    with torch.no_grad():
        for path, a in init_a.items():
            lora[path][0].copy_(a)
    losses, opt = adamw_steps(model, params, spec, stream)
    weights = {path: (a.detach(), b.detach()) for path, (a, b) in lora.items()}
    moments = {path: tuple((opt.state[w]["exp_avg"], opt.state[w]["exp_avg_sq"]) for w in pair)
               for path, pair in lora.items()}
    return PeftRun(losses, weights, moments)  # type: ignore[arg-type]
