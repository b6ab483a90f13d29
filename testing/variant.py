"""What every adapter variant promises, as checks a variant (built in or a user's) runs on the tiny models.

A variant (``packer.variants.Variant``) is a row: an ``AdapterSpec`` that selects it. The promises::

    from lora_sweep.testing.variant import check_variant
    check_variant(AdapterSpec(rank=2, alpha=4, lorafa=True, eps=1e-6, ...))  # AssertionError naming the promise

or, under pytest, a class that subclasses the suite and provides the row (Optuna's ``StorageTestCase`` style)::

    from lora_sweep.testing.variant import VariantContract

    class TestMyVariantContract(VariantContract):
        @pytest.fixture
        def spec(self) -> AdapterSpec: return AdapterSpec(..., my_variant=True)

- **alone = PEFT** (``check_alone_is_peft``): the slot trained alone in a pack, per-step losses and final A, B,
  equal PEFT's model of the same config (``run_peft``: ``get_peft_model`` with ``init_lora_weights`` / ``use_dora``,
  torch AdamW, or PEFT's own LoRA+ / LoRA-FA optimizer) on the same batches from the same initial A, in fp64;
- **mixed pack = alone** (``check_mixed_is_alone``): beside slots of other variants the slot trains as alone;
- **Triton = torch** (``check_triton_is_torch``): the Triton step (the interpreter on CPU, ``TRITON_INTERPRET=1`` set
  before the kernels are imported) trains the slot as the torch step, fp32, one decoder layer;
- **PEFT loads the checkpoint** (``check_checkpoint_loads_in_peft``): the saved directory, loaded by
  ``PeftModel.from_pretrained`` on the original base, gives the pack's logits, and so does the merged base
  (``Packer.merge_adapter``, each variant's ``merge``);
- **state survives a bucket move** (``check_bucket_move``): a later job whose rank outgrows the store's rank bucket
  moves the live slot to a new store (``SlotStore.copy_slot_from``, the variant's buffers too) and it ends as alone.

The oracle the packer's own parity tests use is this module's (``run_peft``, ``run_packed``,
``assert_trained_as_peft``; tests/helpers.py re-exports it). Nothing in the library imports this module (an import
contract).
"""

from __future__ import annotations

import atexit
import functools
import random
import shutil
import tempfile
from collections import defaultdict
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import NamedTuple
from unittest import mock

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM, get_scheduler
from transformers.pytorch_utils import Conv1D

from lora_sweep.kernels.ops import PackLayout, dropout_seed
from lora_sweep.kernels.reference import dropout_keep_mask
from lora_sweep.packer.data.batch import collate
from lora_sweep.packer.data.rows import IGNORE_INDEX, Example, SlotStream
from lora_sweep.packer.model.checkpoint import read_adapter, save_adapters
from lora_sweep.packer.model.inject import projection_names
from lora_sweep.packer.model.load import load_base
from lora_sweep.packer.model.packed import PackedModel
from lora_sweep.packer.plan import AdapterSpec
from lora_sweep.packer.step.train import SlotJob, train
from lora_sweep.packer.tiny.models import build_tiny_model

__all__ = ["check_variant", "check_alone_is_peft", "check_mixed_is_alone", "check_triton_is_torch",
           "check_checkpoint_loads_in_peft", "check_bucket_move", "VariantContract", "run_peft", "run_packed",
           "assert_trained_as_peft", "initial_a", "default_dtype", "slot_jobs", "random_examples", "Recorder",
           "tiny_model_dir", "PeftRun", "adamw_steps", "train_and_save", "assert_peft_and_merge_reproduce", "IDS",
           "PAD", "STEPS"]

PAD = 0

STEPS = 20
"""Optimizer steps of the packer's parity tests."""

BESIDE = (AdapterSpec(rank=4, alpha=8, lr=5e-3, micro_batch=2, targets=("o_proj", "down_proj"), max_steps=6, seed=3,
                      max_grad_norm=0.05),
          AdapterSpec(rank=8, alpha=16, lr=2e-3, micro_batch=1, targets=("q_proj", "gate_proj"), max_steps=5, seed=4,
                      dora=True, lr_ratio=4.0))
"""Slots of other variants beside the checked one in ``check_mixed_is_alone`` (a plain slot that clips, a DoRA slot
with LoRA+'s ratio), on the llama family's projections."""


@functools.cache
def tiny_model_dir(family: str = "llama", num_layers: int = 2) -> Path:
    """A tiny model of ``family`` (``packer.tiny``), built once per process in a temporary directory removed at exit."""
    root = Path(tempfile.mkdtemp(prefix="lora-sweep-variant-"))
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    return build_tiny_model(family, root / f"tiny-{family}", seed=0, num_layers=num_layers)


def random_examples(n: int, seed: int, vocab: int = 300, min_len: int = 6, max_len: int = 24) -> list[Example]:
    """Synthetic rows of random lengths with a masked prompt, for engine tests that need no text."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        length = rng.randint(min_len, max_len)
        ids = tuple(rng.randrange(3, vocab) for _ in range(length))
        prompt = rng.randint(1, length - 2)
        rows.append(Example(ids, (IGNORE_INDEX,) * prompt + ids[prompt:]))
    return rows


class Recorder:
    """``train()`` callbacks that keep each job's per-step losses and its final weights."""

    def __init__(self, pm, snapshot=None) -> None:  # noqa: ANN001
        self.losses: dict = defaultdict(list)
        self.final: dict = {}
        self.global_step = 0
        self.snapshot = snapshot or (lambda slot: {p: (a.detach().clone(), b.detach().clone())
                                                   for p, (a, b) in pm.slot_weights(slot).items()})

    def on_step(self, reports) -> None:  # noqa: ANN001
        self.global_step = reports[0].step + 1
        for r in reports:
            self.losses[r.key].append(r.loss)

    def on_end(self, ends) -> None:  # noqa: ANN001
        for e in ends:
            self.final[e.job.key] = self.snapshot(e.slot)


# --------------------------------------------------------------- the oracle: PEFT alone, the engine packed

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
    ``create_loraplus_optimizer``: B in a group of ``lr * lr_ratio``; with LoRA-FA, PEFT's ``create_lorafa_optimizer``);
    returns the losses and the optimizer."""
    if spec.lorafa:
        opt = _lorafa_optimizer(model, spec)
    elif spec.lr_ratio == 1.0:
        opt = torch.optim.AdamW(params, lr=spec.lr, betas=spec.betas, eps=spec.eps, weight_decay=spec.weight_decay)
    else:
        from peft.optimizers import create_loraplus_optimizer

        opt = create_loraplus_optimizer(model, torch.optim.AdamW, lr=spec.lr, loraplus_lr_ratio=spec.lr_ratio,
                                        loraplus_weight_decay=spec.weight_decay, betas=spec.betas, eps=spec.eps)
    name = "constant_with_warmup" if spec.schedule == "constant" else spec.schedule  # transformers' names
    sched = get_scheduler(name, opt, num_warmup_steps=spec.warmup_steps, num_training_steps=spec.max_steps)
    losses = []
    for _ in range(spec.max_steps):  # PEFT's LoRA-FA projects in bf16 wherever bf16 is: the oracle in the test's dtype
        b = collate([0], [stream.next_batch()], PAD, dropout=[0.0], seeds=[0])
        out = model(input_ids=b.input_ids, attention_mask=b.attention_mask, labels=b.labels)
        out.loss.backward()
        losses.append(out.loss.item())
        if spec.max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(params, spec.max_grad_norm)
        with mock.patch("peft.optimizers.lorafa.is_bf16_available", lambda: False):
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
    from peft import LoraConfig, get_peft_model

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
    moments = {} if spec.lorafa else {  # LoRA-FA's optimizer keys its state by module name
        path: tuple((opt.state[w]["exp_avg"], opt.state[w]["exp_avg_sq"]) for w in pair) for path, pair in lora.items()}
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


def _lorafa_optimizer(model: nn.Module, spec: AdapterSpec) -> torch.optim.Optimizer:
    """PEFT's ``create_lorafa_optimizer`` (A frozen, B's gradient projected, HF-style AdamW with betas (0.9, 0.999)
    and eps 1e-6, which ``spec`` must have for the comparison to hold)."""
    from peft.optimizers import create_lorafa_optimizer

    assert spec.betas == (0.9, 0.999) and spec.eps == 1e-6, "PEFT's LoRA-FA optimizer fixes betas and eps"
    return create_lorafa_optimizer(model, r=spec.rank, lora_alpha=spec.alpha, lr=spec.lr,
                                   weight_decay=spec.weight_decay)


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
    from peft import PeftModel

    from lora_sweep.packer.api import Packer  # the export's merge, which a variant's checkpoint must take

    config, tensors = read_adapter(adapter_dir)
    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(model_dir)), str(adapter_dir))
    peft_model.eval()
    with torch.no_grad():
        theirs = peft_model(input_ids=IDS, attention_mask=torch.ones_like(IDS)).logits
        base = AutoModelForCausalLM.from_pretrained(str(model_dir)).eval()
        plain = base(input_ids=IDS).logits
        Packer.merge_adapter(base, config, tensors)
        merged = base(input_ids=IDS).logits
    assert (packed - plain).abs().max() > 1e-4, "the adapter must change the logits for the check to mean it"
    torch.testing.assert_close(packed, theirs, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(merged, theirs, rtol=1e-4, atol=1e-4)  # the merge in fp32, then the forward
    return config, tensors


# --------------------------------------------------------------- the contract

def _assert_same_run(got: tuple[list[float], dict], want: tuple[list[float], dict], rtol: float, atol: float,
                     what: str) -> None:
    """Per-step losses (relative ``rtol``) and final A, B (absolute ``atol``) of one job, ``got`` against ``want``."""
    (losses, weights), (ref_losses, ref_weights) = got, want
    try:
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=rtol, atol=0)
        assert weights.keys() == ref_weights.keys(), f"adapted modules {sorted(weights)} != {sorted(ref_weights)}"
        for path, (a, b) in weights.items():
            torch.testing.assert_close(a, ref_weights[path][0], rtol=0, atol=atol)
            torch.testing.assert_close(b, ref_weights[path][1], rtol=0, atol=atol)
    except AssertionError as e:
        raise AssertionError(f"{what}: {e}") from None


def check_alone_is_peft(spec: AdapterSpec, model_dir: Path | None = None) -> None:
    """Alone in a pack, the slot trains as PEFT's model of the same config (fp64; ``assert_trained_as_peft``)."""
    model_dir = model_dir or tiny_model_dir()
    with default_dtype(torch.float64):
        losses, final = run_packed(model_dir, slot_jobs([spec]), capacity=1)
        try:  # a fresh job: the same batches from the start
            assert_trained_as_peft(model_dir, slot_jobs([spec])[0], losses, final, min_steps=spec.max_steps)
        except AssertionError as e:
            raise AssertionError(f"alone = PEFT: {e}") from None


def check_mixed_is_alone(spec: AdapterSpec, model_dir: Path | None = None,
                         beside: Iterable[AdapterSpec] = BESIDE) -> None:
    """Packed first among slots of other variants (``BESIDE``), the slot trains as it does alone (fp64)."""
    model_dir = model_dir or tiny_model_dir()
    with default_dtype(torch.float64):
        specs = [spec, *beside]
        mixed = run_packed(model_dir, slot_jobs(specs), capacity=len(specs))
        alone = run_packed(model_dir, slot_jobs([spec]), capacity=1)
    _assert_same_run((mixed[0][0], mixed[1][0]), (alone[0][0], alone[1][0]), 1e-9, 1e-9, "mixed pack = alone")


def check_triton_is_torch(spec: AdapterSpec, steps: int = 3, device: str | None = None,
                          beside: Sequence[AdapterSpec] = BESIDE[:1]) -> None:
    """The Triton step trains the slot, and every slot ``beside`` it (default: a plain slot), as the torch step: fp32
    on a one-layer llama, ``steps`` steps, on ``device`` (default: CUDA where there is one; on CPU the kernels run in
    the interpreter: set ``TRITON_INTERPRET=1`` before anything imports them). Several variants checked in one pack
    (``beside``) cost the interpreter one run instead of one each."""
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    specs = [replace(s, max_steps=steps) for s in (spec, *beside)]
    runs = {}
    for impl in ("torch", "triton"):
        model, _ = load_base(str(tiny_model_dir("llama", num_layers=1)), attn_implementation="eager", device=device)
        pm = PackedModel(model, impl=impl, fused_base_ops=False)  # type: ignore[arg-type]
        queue, rec = slot_jobs(specs), Recorder(pm)
        train(pm, len(specs), lambda slot, q=queue: q.pop(0) if q else None, pad_id=PAD, on_step=rec.on_step,
              on_end=rec.on_end)
        runs[impl] = rec
    for key in range(len(specs)):
        # fp32, the same sums in another order
        _assert_same_run((runs["triton"].losses[key], runs["triton"].final[key]),
                         (runs["torch"].losses[key], runs["torch"].final[key]), 1e-5, 1e-5,
                         f"Triton = torch (slot {key})")


def check_checkpoint_loads_in_peft(spec: AdapterSpec, out_dir: Path, model_dir: Path | None = None) -> None:
    """The slot's saved directory loads in PEFT (``PeftModel.from_pretrained``) with the pack's logits, and so does
    the base with it merged (``assert_peft_and_merge_reproduce``)."""
    model_dir = model_dir or tiny_model_dir()
    saved, logits = train_and_save(model_dir, [replace(spec, max_steps=4)], Path(out_dir))
    try:
        assert_peft_and_merge_reproduce(model_dir, saved[0], logits[0])
    except AssertionError as e:
        raise AssertionError(f"checkpoint loads in PEFT: {e}") from None


def check_bucket_move(spec: AdapterSpec, model_dir: Path | None = None) -> None:
    """A later job's rank 32 outgrows the store's bucket of 16 while the slot trains: the slot moves to the new
    store with its weights, moments and variant buffers, and ends as it does alone (fp64)."""
    model_dir = model_dir or tiny_model_dir()
    spec = replace(spec, max_steps=8)
    short = replace(BESIDE[0], max_steps=3)  # ends at step 3; the wide job takes its slot then
    wide = replace(BESIDE[0], rank=32, alpha=32, targets=("q_proj", "o_proj"), max_steps=4)
    assert spec.rows <= 16, "the check needs a slot that fits the first bucket"
    with default_dtype(torch.float64):
        moved = run_packed(model_dir, slot_jobs([spec, short, wide]), capacity=2)
        assert len(moved[0][2]) == 4, "the wide job did not train"
        alone = run_packed(model_dir, slot_jobs([spec]), capacity=1)
    _assert_same_run((moved[0][0], moved[1][0]), (alone[0][0], alone[1][0]), 1e-9, 1e-9, "bucket move")


def check_variant(spec: AdapterSpec, out_dir: Path | None = None, triton: bool = True) -> None:
    """Every promise of the module docstring for the variant ``spec`` selects; ``triton``: the Triton check too."""
    check_alone_is_peft(spec)
    check_mixed_is_alone(spec)
    check_bucket_move(spec)
    with tempfile.TemporaryDirectory() as tmp:
        check_checkpoint_loads_in_peft(spec, Path(out_dir or tmp))
    if triton:
        check_triton_is_torch(spec)


class VariantContract:
    """The contract as a pytest suite: subclass it and provide a ``spec`` fixture (module docstring). The Triton
    check is marked ``slow`` (the interpreter steps a whole model)."""

    @pytest.fixture
    def spec(self) -> AdapterSpec:
        raise NotImplementedError("provide the variant's row: an AdapterSpec fixture named spec")

    def test_alone_is_peft(self, spec: AdapterSpec) -> None:
        check_alone_is_peft(spec)

    def test_mixed_pack_is_alone(self, spec: AdapterSpec) -> None:
        check_mixed_is_alone(spec)

    def test_state_survives_a_bucket_move(self, spec: AdapterSpec) -> None:
        check_bucket_move(spec)

    def test_checkpoint_loads_in_peft(self, spec: AdapterSpec, tmp_path: Path) -> None:
        check_checkpoint_loads_in_peft(spec, tmp_path)

    @pytest.mark.slow
    def test_triton_is_torch(self, spec: AdapterSpec) -> None:
        check_triton_is_torch(spec)
