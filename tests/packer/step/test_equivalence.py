"""The core invariant: a slot trained in a pack ends where the same adapter trained alone ends.

The oracle is independent code: PEFT on a fresh copy of the base model, torch AdamW, the same
scheduler formula and the same batches, with the loss computed by transformers itself.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from lora_sweep.benchmarks.baseline import make_scheduler
from lora_sweep.packer.data.batch import collate
from lora_sweep.packer.data.rows import SlotStream
from lora_sweep.packer.model.packed import PackedModel, load_base
from lora_sweep.packer.plan import AdapterSpec
from lora_sweep.packer.step.train import SlotJob, train
from tests.conftest import Recorder, random_examples

PAD = 0
STEPS = 20

LLAMA_SPECS = [
    AdapterSpec(rank=2, alpha=4, lr=3e-3, micro_batch=1, targets=("q_proj", "v_proj"), max_steps=STEPS, seed=1),
    AdapterSpec(rank=4, alpha=16, lr=1e-2, micro_batch=2, targets=("all-linear",), max_steps=STEPS + 2, seed=2,
                rslora=True, weight_decay=0.1, warmup_steps=3, schedule="cosine"),
    AdapterSpec(rank=8, alpha=8, lr=5e-3, micro_batch=3, targets=("o_proj", "down_proj"), max_steps=STEPS, seed=3,
                max_grad_norm=0.05, schedule="linear", warmup_steps=2),
    AdapterSpec(rank=16, alpha=32, lr=2e-3, micro_batch=2, targets=("gate_proj", "up_proj", "k_proj"),
                max_steps=STEPS + 1, seed=4, max_grad_norm=None, betas=(0.8, 0.95)),
]
GPT2_SPECS = [
    AdapterSpec(rank=2, alpha=4, lr=3e-3, micro_batch=1, targets=("c_attn",), max_steps=STEPS, seed=1),
    AdapterSpec(rank=4, alpha=16, lr=1e-2, micro_batch=2, targets=("all-linear",), max_steps=STEPS, seed=2,
                schedule="cosine", warmup_steps=4),
    AdapterSpec(rank=8, alpha=8, lr=5e-3, micro_batch=3, targets=("c_proj",), max_steps=STEPS, seed=3,
                max_grad_norm=0.05, rslora=True),
    AdapterSpec(rank=16, alpha=32, lr=2e-3, micro_batch=2, targets=("c_fc", "c_attn"), max_steps=STEPS, seed=4,
                weight_decay=0.05),
]

OPT_SPECS = [  # OPT's decoder feeds fc1/fc2 flattened (B·L, D) tokens: both steps must route them by the pack's rows
    AdapterSpec(rank=2, alpha=4, lr=3e-3, micro_batch=2, targets=("fc1", "fc2"), max_steps=STEPS, seed=1),
    AdapterSpec(rank=4, alpha=16, lr=1e-2, micro_batch=3, targets=("all-linear",), max_steps=STEPS, seed=2,
                schedule="cosine", warmup_steps=3),
]


@contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Run the oracle and the engine in ``dtype``: torch's default dtype, in which the engine allocates its
    slots' flat buffers and PEFT its LoRA weights, and to which the helpers below cast the base."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


def _jobs(specs: list[AdapterSpec]) -> list[SlotJob]:
    return [SlotJob(spec, SlotStream(random_examples(40, seed=100 + i), spec.micro_batch, seed=spec.seed), key=i)
            for i, spec in enumerate(specs)]


def _run_packed(model_dir: Path, jobs: list[SlotJob], capacity: int, impl: str = "torch"):
    """Train jobs through our engine , the base in torch's default dtype;
    returns per-key losses and per-key final (A, B) by module path."""
    model, _ = load_base(str(model_dir), attn_implementation="eager")
    pm = PackedModel(model.to(torch.get_default_dtype()), impl=impl)
    queue = list(jobs)
    rec = Recorder(pm)
    train(pm, capacity, lambda slot: queue.pop(0) if queue else None, pad_id=PAD, on_step=rec.on_step,
          on_end=rec.on_end)
    return rec.losses, rec.final


def _initial_a(model_dir: Path, spec: AdapterSpec) -> dict[str, torch.Tensor | None]:
    """The engine's initial A for ``spec`` (it depends on the seed only), to start PEFT from the same point; None
    for each path where PEFT computes its own from the base weight (``pissa``, ``olora``: the engine must agree)."""
    model, _ = load_base(str(model_dir), attn_implementation="eager")
    pm = PackedModel(model.to(torch.get_default_dtype()))
    pm.add_slot(7, _with(spec, init="kaiming" if spec.principal else spec.init, dora=False))  # A by seed and init
    return {p: None if spec.principal else a.detach().clone() for p, (a, _) in pm.slot_weights(7).items()}


def _run_peft(model_dir: Path, spec: AdapterSpec, stream: SlotStream, init_a: dict[str, torch.Tensor | None]):
    """One adapter alone with PEFT + torch AdamW on the same batches."""
    base = AutoModelForCausalLM.from_pretrained(str(model_dir), attn_implementation="eager",
                                                dtype=torch.get_default_dtype())
    leaf_names = sorted({p.rsplit(".", 1)[-1] for p in init_a})
    cfg = LoraConfig(r=spec.rank, lora_alpha=spec.alpha, lora_dropout=0.0, target_modules=leaf_names,
                     use_rslora=spec.rslora, bias="none", fan_in_fan_out=base.config.model_type == "gpt2",
                     init_lora_weights=True if spec.init == "kaiming" else spec.init, use_dora=spec.dora)
    model = get_peft_model(base, cfg)
    model.eval()  # base dropout off, as in the engine; gradients still flow
    lora = dict(model.named_parameters())
    with torch.no_grad():
        for path, a in init_a.items():
            if a is not None:
                lora[f"base_model.model.{path}.lora_A.default.weight"].copy_(a)
    params = [p for p in model.parameters() if p.requires_grad]
    assert len(params) == (3 if spec.dora else 2) * len(init_a)  # DoRA: a magnitude per layer too
    opt = _peft_optimizer(model, spec)
    sched = make_scheduler(opt, spec)
    losses = []
    for _ in range(spec.max_steps):
        rows = stream.next_batch()
        b = collate([0], [rows], PAD, dropout=[0.0], seeds=[0])
        out = model(input_ids=b.input_ids, attention_mask=b.attention_mask, labels=b.labels)
        out.loss.backward()
        losses.append(out.loss.item())
        if spec.max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(params, spec.max_grad_norm)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
    weights = {path: (lora[f"base_model.model.{path}.lora_A.default.weight"].detach(),
                      lora[f"base_model.model.{path}.lora_B.default.weight"].detach()) for path in init_a}
    return losses, weights


def _peft_optimizer(model: torch.nn.Module, spec: AdapterSpec) -> torch.optim.Optimizer:
    """torch AdamW over the PEFT model's LoRA weights; with a LoRA+ ratio, PEFT's own ``create_loraplus_optimizer``
    (B in a group of ``lr * lr_ratio``)."""
    params = [p for p in model.parameters() if p.requires_grad]
    if spec.lr_ratio == 1.0:
        return torch.optim.AdamW(params, lr=spec.lr, betas=spec.betas, eps=spec.eps, weight_decay=spec.weight_decay)
    from peft.optimizers import create_loraplus_optimizer

    return create_loraplus_optimizer(model, torch.optim.AdamW, lr=spec.lr, loraplus_lr_ratio=spec.lr_ratio,
                                     loraplus_weight_decay=spec.weight_decay, betas=spec.betas, eps=spec.eps)


def assert_trained_as_peft(model_dir: Path, job: SlotJob, losses: dict, final: dict, min_steps: int = STEPS) -> None:
    """The packed job's per-step losses (1e-5 relative) and final A/B (1e-4) equal PEFT + torch AdamW's
    on the same batches, from the same initial A, over at least ``min_steps`` steps."""
    ref_losses, ref_weights = _run_peft(model_dir, job.spec, job.stream, _initial_a(model_dir, job.spec))
    assert len(losses[job.key]) == job.spec.max_steps >= min_steps
    torch.testing.assert_close(torch.tensor(losses[job.key]), torch.tensor(ref_losses), rtol=1e-5, atol=0)
    assert final[job.key].keys() == ref_weights.keys()
    for path, (a, b) in final[job.key].items():
        ra, rb = ref_weights[path]
        assert b.abs().max() > 0, "B never moved: the test would not see a wrong update"
        torch.testing.assert_close(a, ra, rtol=0, atol=1e-4)
        torch.testing.assert_close(b, rb, rtol=0, atol=1e-4)


@pytest.mark.parametrize(("family", "specs"), [("llama", LLAMA_SPECS), ("gpt2", GPT2_SPECS), ("opt", OPT_SPECS)])
def test_packed_equals_peft_separately(tiny_dirs, family: str, specs: list[AdapterSpec]) -> None:
    model_dir = tiny_dirs(family)
    losses, final = _run_packed(model_dir, _jobs(specs), capacity=len(specs))
    for job in _jobs(specs):
        assert_trained_as_peft(model_dir, job, losses, final)


def test_loop_and_dense_impls_agree(tiny_dirs) -> None:
    specs = LLAMA_SPECS[:3]
    dense = _run_packed(tiny_dirs("llama"), _jobs(specs), capacity=3, impl="torch")
    loop = _run_packed(tiny_dirs("llama"), _jobs(specs), capacity=3, impl="loop")
    for key in dense[0]:
        torch.testing.assert_close(torch.tensor(dense[0][key]), torch.tensor(loop[0][key]), rtol=1e-5, atol=0)


def _with(spec: AdapterSpec, **kw) -> AdapterSpec:
    from dataclasses import replace

    return replace(spec, **kw)


@pytest.mark.parametrize("impl", ["torch", "loop"])
def test_dropout_slot_in_pack_equals_alone(tiny_dirs, impl: str) -> None:
    """Packed == alone with dropout (each slot's masks from its own seed, whatever its rows in the step)."""
    specs = [_with(LLAMA_SPECS[0], dropout=0.1), _with(LLAMA_SPECS[1], dropout=0.3), LLAMA_SPECS[2]]
    packed_losses, packed_final = _run_packed(tiny_dirs("llama"), _jobs(specs), capacity=3, impl=impl)
    for job in _jobs(specs)[:2]:
        alone_losses, alone_final = _run_packed(tiny_dirs("llama"), [job], capacity=1, impl=impl)
        torch.testing.assert_close(torch.tensor(packed_losses[job.key]), torch.tensor(alone_losses[job.key]),
                                   rtol=1e-5, atol=0)
        for path, (a, b) in packed_final[job.key].items():
            torch.testing.assert_close(a, alone_final[job.key][path][0], rtol=0, atol=1e-5)
            torch.testing.assert_close(b, alone_final[job.key][path][1], rtol=0, atol=1e-5)
    # dropout really is on: the same slot without dropout trains differently
    plain = _run_packed(tiny_dirs("llama"), [_jobs([LLAMA_SPECS[0]])[0]], capacity=1, impl=impl)[0]
    assert plain[0][1:] != packed_losses[0][1:]


def test_slot_started_mid_run_equals_fresh_run(tiny_dirs) -> None:
    short = _with(LLAMA_SPECS[0], max_steps=5)
    late = _with(LLAMA_SPECS[2], dropout=0.2, max_steps=12)
    specs = [short, LLAMA_SPECS[1], late]  # capacity 2: `late` starts in slot 0 at global step 5
    steps_at_start = {}
    jobs = _jobs(specs)
    model, _ = load_base(str(tiny_dirs("llama")), attn_implementation="eager")
    pm = PackedModel(model)
    queue = list(jobs)
    rec = Recorder(pm)

    def next_job(slot: int) -> SlotJob | None:
        if queue:
            steps_at_start[queue[0].key] = (slot, rec.global_step)
            return queue.pop(0)
        return None

    train(pm, 2, next_job, pad_id=PAD, on_step=rec.on_step, on_end=rec.on_end)
    losses, final = rec.losses, rec.final
    assert steps_at_start[2] == (0, 5), "the late job must have started in the freed slot mid-run"
    fresh_losses, fresh_final = _run_packed(tiny_dirs("llama"), [_jobs(specs)[2]], capacity=1)
    torch.testing.assert_close(torch.tensor(losses[2]), torch.tensor(fresh_losses[2]), rtol=1e-5, atol=0)
    for path, (a, b) in final[2].items():
        torch.testing.assert_close(a, fresh_final[2][path][0], rtol=0, atol=1e-5)
        torch.testing.assert_close(b, fresh_final[2][path][1], rtol=0, atol=1e-5)
