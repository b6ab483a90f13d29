"""Helpers several test modules share (a test module imports none from another): the packed-vs-PEFT oracle of the
packer's invariant, the probe's growth measure, the evaluations on a training pack, the workers' and the foreign
configs' study files, and the patches that make a test see one cause.

tests/conftest.py keeps the fixtures and pytest hooks, the skips for want of an extra (``missing``, ``need_module``)
and the tiny rows and study file the whole suite builds on (``random_examples``, ``write_study``, ``Recorder``).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import NamedTuple

import optuna
import pytest
import torch
import transformers.masking_utils
import yaml
from peft import LoraConfig, PeftModel, get_peft_model
from torch import nn
from transformers import AutoModelForCausalLM
from transformers.pytorch_utils import Conv1D

from lora_sweep.benchmarks.baseline import make_scheduler
from lora_sweep.kernels.ops import PackLayout, dropout_seed
from lora_sweep.kernels.reference import dropout_keep_mask
from lora_sweep.packer.data.batch import collate
from lora_sweep.packer.data.rows import Example, SlotStream, read_jsonl, tokenize_rows
from lora_sweep.packer.model.checkpoint import read_adapter, save_adapters
from lora_sweep.packer.model.inject import projection_names
from lora_sweep.packer.model.load import load_base
from lora_sweep.packer.model.packed import PackedModel
from lora_sweep.packer.plan import AdapterSpec, adapter_param_count
from lora_sweep.packer.probe import peak_memory
from lora_sweep.packer.step import eval_graph
from lora_sweep.packer.step.train import FixedBatch, SlotEnd, SlotJob, train
from lora_sweep.packer.tiny.data import arithmetic_rows, write_jsonl
from lora_sweep.store.storage import open_storage
from lora_sweep.sweep.export import merge_adapter
from tests.conftest import Recorder, missing, need_module, random_examples, write_study
from tests.evaluators.conftest import YESNO

FOREIGN_CONFIGS = Path(__file__).parent / "sweep" / "data"
"""Axolotl and torchtune configs (published LoRA examples) with BASE_MODEL, DATA, EVAL and OUTPUT to fill in."""

# --------------------------------------------------------------- the packer's invariant: packed == PEFT alone

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


def initial_a(model_dir: Path, spec: AdapterSpec) -> dict[str, torch.Tensor | None]:
    """The engine's initial A for ``spec`` (it depends on the seed only), to start PEFT from the same point; None
    for each path where PEFT computes its own from the base weight (``pissa``, ``olora``: the engine must agree)."""
    model, _ = load_base(str(model_dir), attn_implementation="eager")
    pm = PackedModel(model.to(torch.get_default_dtype()))
    pm.add_slot(0, replace(spec, init="kaiming" if spec.principal else spec.init, dora=False))  # A by seed and init
    return {p: None if spec.principal else a.detach().clone() for p, (a, _) in pm.slot_weights(0).items()}


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
    AdamW on ``params`` with ``spec``'s clipping and schedule (with a LoRA+ ratio, PEFT's own
    ``create_loraplus_optimizer``: B in a group of ``lr * lr_ratio``); returns the losses and the optimizer."""
    if spec.lr_ratio == 1.0:
        opt = torch.optim.AdamW(params, lr=spec.lr, betas=spec.betas, eps=spec.eps, weight_decay=spec.weight_decay)
    else:
        from peft.optimizers import create_loraplus_optimizer

        opt = create_loraplus_optimizer(model, torch.optim.AdamW, lr=spec.lr, loraplus_lr_ratio=spec.lr_ratio,
                                        loraplus_weight_decay=spec.weight_decay, betas=spec.betas, eps=spec.eps)
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


def run_peft(model_dir: Path, spec: AdapterSpec, stream: SlotStream, init_a: dict[str, torch.Tensor | None],
             targets: str | None = None) -> PeftRun:
    """``spec``'s adapter alone for ``spec.max_steps`` steps of ``stream``'s batches, from ``init_a`` (None for a
    path: PEFT's own init by ``spec.init``), with ``spec``'s DoRA and dropout (the engine's masks: ``_EngineMask``).

    Args:
        targets: PEFT's ``target_modules`` (``all-linear``: PEFT's own resolution, which must adapt exactly the
            modules of ``init_a``); None: the leaf names of ``init_a``'s paths.
    """
    fp64_principal = spec.principal and torch.get_default_dtype() == torch.float64  # PEFT inits those in fp32 only
    base = AutoModelForCausalLM.from_pretrained(str(model_dir), attn_implementation="eager",
                                                dtype=torch.float32 if fp64_principal else torch.get_default_dtype())
    conv1d = any(isinstance(m, Conv1D) for m in base.modules())
    layer_ids = {p: i for i, p in enumerate(projection_names(base))}  # the engine's (``inject``), before PEFT wraps
    cfg = LoraConfig(r=spec.rank, lora_alpha=spec.alpha, lora_dropout=spec.dropout, use_rslora=spec.rslora, bias="none",
                     target_modules=targets or sorted({p.rsplit(".", 1)[-1] for p in init_a}), fan_in_fan_out=conv1d,
                     init_lora_weights=True if spec.init == "kaiming" else spec.init, use_dora=spec.dora)
    model = get_peft_model(base, cfg)
    if fp64_principal:
        _residual_in_fp64(model, model_dir, init_a)
    model.eval()  # base dropout off, as in the engine; gradients still flow
    for path in init_a if spec.dropout > 0 else ():  # in training mode: PEFT's DoRA drops its input only then
        layer = model.base_model.model.get_submodule(path)
        layer.lora_dropout["default"] = _EngineMask(spec, layer_ids[path])
        layer.train()
    named = dict(model.named_parameters())
    lora = {path: (named[f"base_model.model.{path}.lora_A.default.weight"],
                   named[f"base_model.model.{path}.lora_B.default.weight"]) for path in init_a}
    params = [p for p in model.parameters() if p.requires_grad]
    assert len(params) == (3 if spec.dora else 2) * len(init_a), "PEFT adapts other modules than the engine's slot"
    with torch.no_grad():  # (DoRA: a magnitude per layer too)
        for path, a in init_a.items():
            if a is not None:
                lora[path][0].copy_(a)
    losses, opt = adamw_steps(model, params, spec, stream)
    weights = {path: (a.detach(), b.detach()) for path, (a, b) in lora.items()}
    moments = {path: tuple((opt.state[w]["exp_avg"], opt.state[w]["exp_avg_sq"]) for w in pair)
               for path, pair in lora.items()}
    return PeftRun(losses, weights, moments)  # type: ignore[arg-type]


class _EngineMask(nn.Module):
    """PEFT's ``lora_dropout`` of one layer as the mask the engine's torch step draws for the slot alone at each of its
    steps (``dropout_keep_mask``: the step's seed, the engine's layer id): the oracle drops what the pack drops."""

    def __init__(self, spec: AdapterSpec, layer_id: int) -> None:
        super().__init__()
        self.spec, self.layer_id, self.calls = spec, layer_id, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (rows, L, D_in), one call per step
        n, seq, d_in = x.shape
        lay = PackLayout((0,), (0,), (n,), (seq,), (self.spec.dropout,), (dropout_seed(self.spec.seed, self.calls),))
        self.calls += 1
        return x * dropout_keep_mask(lay, 0, self.layer_id, d_in, seq, x.device).to(x.dtype)


def _residual_in_fp64(model: nn.Module, model_dir: Path, paths: Iterable[str]) -> None:
    """PEFT's PiSSA / OLoRA model, initialised in fp32 (``pissa_init`` / ``olora_init`` refuse fp64), in fp64 with its
    residual base ``W_res = W - s B0 A0`` formed again in fp64 from the original W and the fp32 factors (exact in
    fp64): PEFT's math, without the fp32 rounding of W_res."""
    original = AutoModelForCausalLM.from_pretrained(str(model_dir), attn_implementation="eager", dtype=torch.float64)
    model.double()
    with torch.no_grad():
        for path in paths:
            layer = model.base_model.model.get_submodule(path)
            b0a0 = layer.lora_B["default"].weight @ layer.lora_A["default"].weight  # (D_out, D_in)
            layer.base_layer.weight.copy_(original.get_submodule(path).weight - layer.scaling["default"] * b0a0)


def slot_jobs(specs: list[AdapterSpec]) -> list[SlotJob]:
    return [SlotJob(spec, SlotStream(random_examples(40, seed=100 + i), spec.micro_batch, seed=spec.seed), key=i)
            for i, spec in enumerate(specs)]


def run_packed(model_dir: Path, jobs: list[SlotJob], capacity: int, impl: str = "torch"):
    """Train jobs through our engine , the base in torch's default dtype;
    returns per-key losses and per-key final (A, B) by module path."""
    model, _ = load_base(str(model_dir), attn_implementation="eager")
    pm = PackedModel(model.to(torch.get_default_dtype()), impl=impl)
    queue = list(jobs)
    rec = Recorder(pm)
    train(pm, capacity, lambda slot: queue.pop(0) if queue else None, pad_id=PAD, on_step=rec.on_step,
          on_end=rec.on_end)
    return rec.losses, rec.final


def assert_trained_as_peft(model_dir: Path, job: SlotJob, losses: dict, final: dict, min_steps: int = STEPS) -> None:
    """The packed job's per-step losses (1e-5 relative) and final A/B (1e-4) equal PEFT + torch AdamW's
    on the same batches, from the same initial A, over at least ``min_steps`` steps."""
    ref_losses, ref_weights, _ = run_peft(model_dir, job.spec, job.stream, initial_a(model_dir, job.spec))
    assert len(losses[job.key]) == job.spec.max_steps >= min_steps
    torch.testing.assert_close(torch.tensor(losses[job.key]), torch.tensor(ref_losses), rtol=1e-5, atol=0)
    assert final[job.key].keys() == ref_weights.keys()
    for path, (a, b) in final[job.key].items():
        ra, rb = ref_weights[path]
        assert b.abs().max() > 0, "B never moved: the test would not see a wrong update"
        torch.testing.assert_close(a, ra, rtol=0, atol=1e-4)
        torch.testing.assert_close(b, rb, rtol=0, atol=1e-4)


# --------------------------------------------------------------- exported adapters: PEFT loads them, merges agree

IDS = torch.randint(3, 300, (2, 12), generator=torch.Generator().manual_seed(0))


def train_and_save(model_dir, specs, out_root):  # noqa: ANN001, ANN202
    """Each slot's saved directory and its packed logits on IDS, taken as it ends (its frozen rows still live)."""
    model, _ = load_base(str(model_dir))
    pm = PackedModel(model)
    queue = [SlotJob(s, SlotStream(random_examples(20, i), 2, seed=i), key=i) for i, s in enumerate(specs)]
    saved, logits = {}, {}

    def on_end(ends):  # noqa: ANN001, ANN202
        dirs = save_adapters(pm, [(e.slot, out_root / f"trial-{e.job.key}", None) for e in ends],
                             base_model_name_or_path=str(model_dir))
        for e, d in zip(ends, dirs, strict=True):
            saved[e.job.key] = d
            with torch.no_grad():
                layout = PackLayout((e.slot,), (0,), (2,), (12,), (0.0,), (0,))
                logits[e.job.key] = pm.forward(IDS, torch.ones_like(IDS), layout)

    train(pm, len(specs), lambda s: queue.pop(0) if queue else None, pad_id=0, on_end=on_end)
    return saved, logits


def assert_peft_and_merge_reproduce(model_dir, adapter_dir, packed: torch.Tensor):  # noqa: ANN001, ANN201
    """PEFT's model of the saved adapter on the original base, and the base with it merged (``merge_adapter``), give
    the packed adapter's logits on IDS; returns the adapter's (config, tensors)."""
    config, tensors = read_adapter(adapter_dir)
    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(model_dir)), str(adapter_dir))
    peft_model.eval()
    with torch.no_grad():
        theirs = peft_model(input_ids=IDS, attention_mask=torch.ones_like(IDS)).logits
        base = AutoModelForCausalLM.from_pretrained(str(model_dir)).eval()
        plain = base(input_ids=IDS).logits
        merge_adapter(base, config, tensors)
        merged = base(input_ids=IDS).logits
    assert (packed - plain).abs().max() > 1e-4, "the adapter must change the logits for the check to mean it"
    torch.testing.assert_close(packed, theirs, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(merged, theirs, rtol=1e-4, atol=1e-4)  # the merge in fp32, then the forward
    return config, tensors


# --------------------------------------------------------------- planning and evaluation on a pack

def step_growth(pm: PackedModel, mm, ranks: tuple[int, ...], micro: int, seq: int, vocab: int, dora: bool = False,
                dropout: float = 0.0, **options) -> tuple[float, float]:
    """(predicted, measured) bytes a pack's step adds on top of the base part, for slots of ``ranks`` (DoRA slots
    with ``dora``, with LoRA dropout ``dropout``)."""
    gen = torch.Generator().manual_seed(1)
    jobs = []
    for i, r in enumerate(ranks):
        ids = torch.randint(3, vocab, (micro, seq), generator=gen).tolist()
        spec = AdapterSpec(rank=r, targets=("all-linear",), micro_batch=micro, max_steps=2, seed=i, dora=dora,
                           dropout=dropout)
        jobs.append(SlotJob(spec, FixedBatch([Example(tuple(x), tuple(x)) for x in ids])))
    shapes = [(layer.in_features, layer.out_features) for layer in pm.layers.values()]
    params = sum(adapter_param_count(shapes, r) for r in ranks)
    predicted = mm.predict(len(ranks) * micro * seq, params, sum(ranks))
    measured = peak_memory(lambda: train(pm, len(ranks), lambda s: jobs.pop(0) if jobs else None, pad_id=0,
                                         **options), pm)
    print(f"growth predicted {(predicted - mm.base_bytes) / 1e6:.1f} MB, measured "
          f"{(measured - mm.base_bytes) / 1e6:.1f} MB; adapters {params / 1e6:.2f} M parameters")
    return predicted - mm.base_bytes, measured - mm.base_bytes


def pack_evaluations(model_dir, check, attn: str = "sdpa", device: str = "cpu", impl: str = "torch",
                            **train_kw):  # noqa: ANN001, ANN003, ANN201
    """Train 3 jobs (mixed ranks, targets, lengths) in 4 slots; ``check(pm, slots, tok)`` runs in every
    ``on_end`` (the ending slots and every other live slot are still in the pack)."""
    model, tok = load_base(str(model_dir), attn_implementation=attn, device=device)
    pm = PackedModel(model, impl=impl)
    _, rows = read_jsonl(YESNO)
    examples = tokenize_rows(rows, "prompt_completion", tok)
    base = AdapterSpec(rank=8, alpha=16, lr=3e-2, targets=("all-linear",), micro_batch=4, max_steps=6)
    specs = [replace(base, max_steps=4, seed=1), replace(base, rank=4, targets=("q_proj", "v_proj"), seed=2),
             replace(base, rank=16, alpha=8, targets=("gate_proj", "up_proj", "down_proj"), seed=3)]
    queue = [SlotJob(s, SlotStream(examples, s.micro_batch, seed=i), key=i) for i, s in enumerate(specs)]
    calls = []

    def on_end(ends: list[SlotEnd]) -> None:
        assert eval_graph.available(pm)
        calls.append(sorted(pm.specs))
        check(pm, sorted(e.slot for e in ends), tok)
        check(pm, sorted(pm.specs), tok)

    train(pm, 4, lambda slot: queue.pop(0) if queue else None, pad_id=tok.pad_token_id, on_end=on_end,
          readback_every=2, **train_kw)
    assert len(calls) == 2 and pm.store is None


# --------------------------------------------------------------- study files: workers, Axolotl and torchtune

_SERVERS = {"postgresql": ("LORA_SWEEP_TEST_PG", "PostgreSQL on 127.0.0.1:55432", "psycopg2", "postgres"),
            "mysql": ("LORA_SWEEP_TEST_MYSQL", "MariaDB on 127.0.0.1:53306", "pymysql", "mysql")}


def server_url(kind: str) -> str:
    """The test server's URL (``postgresql`` or ``mysql``), its driver's extra installed; else the test is skipped
    (``tests.conftest.missing``)."""
    env, server, module, extra = _SERVERS[kind]
    need_module(module, extra)
    if not os.environ.get(env):
        missing(f"a {kind} server ({env} is unset)", f"export {env} (.ci/run starts {server})")
    return os.environ[env]


def worker_study(tmp_path: Path, model_dir: Path, name: str, **changes) -> Path:
    """The shared small study, as a multi-worker job: 9 trials of 20 steps, 2 slots, no pruning."""
    return write_study(tmp_path, model_dir, name, **{
        "train": {"max_steps": 20, "micro_batch": 4},
        "objectives": [{"metric": "eval_loss", "direction": "minimize"}],
        "budget": {"trials": 9},
        "pruning": {"kind": "none"},
        "pack": {"max_slots": 2},
        "evaluators": [{"name": "heldout_loss"}],
        "artifacts": str(tmp_path / "shared-adapters" / name),
        **changes,
    })


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "lora_sweep", *args]


# One thread per worker, as conftest gives the test process: workers sharing 2 cores with a pool of
# threads each spin against one another and a 10-step trial takes a minute instead of a second.
WORKER_ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def stored_trials(url: str, name: str) -> list[optuna.trial.FrozenTrial]:
    return optuna.load_study(study_name=name, storage=open_storage(url)).get_trials()


def foreign_config(tmp_path: Path, model_dir: Path, name: str, **changes) -> Path:  # noqa: ANN003
    """A copy of ``FOREIGN_CONFIGS/<name>`` with BASE_MODEL, DATA, EVAL and OUTPUT filled in and ``changes`` applied."""
    train, held_out = tmp_path / "alpaca-train.jsonl", tmp_path / "alpaca-eval.jsonl"
    rows = arithmetic_rows(60, seed=3, fmt="alpaca")
    write_jsonl(train, rows[:48])
    write_jsonl(held_out, rows[48:])
    text = (FOREIGN_CONFIGS / name).read_text()
    for word, value in (("BASE_MODEL", model_dir), ("DATA", train), ("EVAL", held_out),
                        ("OUTPUT", tmp_path / f"out-{name}")):
        text = text.replace(word, str(value))
    path = tmp_path / name
    path.write_text(text)
    if changes:
        doc = yaml.safe_load(text)
        for key, value in changes.items():
            doc[key] = value
        path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


# --------------------------------------------------------------- patches that make a test see one cause

def positions_ignored(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make transformers build a plain causal mask over packed rows, as a family whose modeling code does not
    pass its positions to the mask does (Falcon in transformers 5.23): each example sees the ones before it."""
    monkeypatch.setattr(transformers.masking_utils, "find_packed_sequence_indices", lambda position_ids: None)


def refuse_model_loads(monkeypatch) -> None:  # noqa: ANN001
    """From here on, loading the model or its tokenizer fails the test: what a cached plan must not do."""
    import lora_sweep.packer.model.load as load  # where the packer's object reads them, when a method is called

    def refused(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        raise AssertionError("a cached plan loads neither the model nor its tokenizer")

    monkeypatch.setattr(load, "load_base", refused)
    monkeypatch.setattr(load, "load_tokenizer", refused)


def scored_pack(model_dir: Path, dora: bool = False, impl: str = "torch") -> tuple[PackedModel, object]:
    """(pack, tokenizer): four slots of different ranks, targets and scales with non-zero B (slot 2 DoRA with
    ``dora``), for the batched evaluation's tests (tests/packer/step/test_eval_graph*.py)."""
    model, tok = load_base(str(model_dir))
    pm = PackedModel(model, impl=impl)  # type: ignore[arg-type]
    gen = torch.Generator().manual_seed(0)
    targets = (("all-linear",), ("q_proj", "v_proj"), ("gate_proj", "up_proj", "down_proj"), ("all-linear",))
    for slot, (rank, tg) in enumerate(zip((8, 4, 16, 2), targets, strict=True)):
        pm.add_slot(slot, AdapterSpec(rank=rank, alpha=3.0 * rank, targets=tg, seed=slot, dora=dora and slot == 2))
        with torch.no_grad():
            for _, b in pm.slot_weights(slot).values():
                b.copy_(torch.randn(b.shape, generator=gen) * 0.3)
    return pm, tok


def scored_alone(pm: PackedModel, slot: int, data, prompts, gen_kw) -> tuple:  # noqa: ANN001
    """Slot ``slot`` scored by itself on the per-adapter path: (per-item losses, generated ids)."""
    from lora_sweep.evaluators.generation import generate_ids
    from lora_sweep.evaluators.heldout_loss import heldout_loss

    loss = heldout_loss(pm, [slot], data, batch_size=5, batched=False).per_item[slot]["eval_loss"]
    return loss, generate_ids(pm, [slot], prompts, batched=False, **gen_kw)[slot]
