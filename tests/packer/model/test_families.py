"""Every tiny family: all-linear resolves as PEFT's does, and a slot trained in a pack by ``train()`` is PEFT's adapter
trained alone: its losses, gradients (through AdamW's moments) and updated weights.

The oracle is PEFT on a fresh copy of the base with torch AdamW (``tests.helpers``; fp32, eager attention). Each
family is a stock transformers architecture (``packer.tiny.models`` / ``packer.tiny.families``): fused QKV and gate/up,
biases, tied heads, Conv1D, OPT's MLP fed flattened (B·L, D) hidden states, logits post-processed after the head.

Run: python -m pytest tests/packer/model/test_families.py -q
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.conftest import Recorder, add_slots_random_b, need_triton, random_examples
from tests.helpers import PAD, initial_a, run_peft

need_triton()  # before anything imports the Triton kernel modules

from lora_sweep.errors import ConfigError  # noqa: E402
from lora_sweep.kernels.ops import PackLayout  # noqa: E402
from lora_sweep.packer.data.rows import SlotStream  # noqa: E402
from lora_sweep.packer.loss import check_plain_head, chunked_slot_losses, slot_losses  # noqa: E402
from lora_sweep.packer.model.layer import PackedLoRALinear, PackState  # noqa: E402
from lora_sweep.packer.model.load import load_base  # noqa: E402
from lora_sweep.packer.model.packed import PackedModel  # noqa: E402
from lora_sweep.packer.plan import AdapterSpec  # noqa: E402
from lora_sweep.packer.step.train import SlotJob, train  # noqa: E402
from lora_sweep.packer.tiny.models import FAMILIES, _init_model, tiny_config  # noqa: E402

TRITON_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # on CPU the kernels run in the interpreter
ROWS, SEQ = 3, 10
IDS = torch.randint(3, 260, (ROWS, SEQ), generator=torch.Generator().manual_seed(0))
MASK = torch.ones_like(IDS)
MASK[2, 7:] = 0  # right padding on slot 1's row, as collate pads
LAYOUT = PackLayout((0, 1), (0, 2), (2, 1), (SEQ, 7), (0.0, 0.0), (0, 0))
SLOT_ROWS = {0: slice(0, 2), 1: slice(2, 3)}
SPECS = {0: AdapterSpec(rank=4, alpha=8, targets=("all-linear",), seed=1),
         1: AdapterSpec(rank=2, alpha=4, rslora=True, targets=("all-linear",), seed=2)}
# Weights the loss gives each logit: a random direction, so every logit's gradient is checked.
DIRECTION = torch.randn(ROWS, SEQ, 1, generator=torch.Generator().manual_seed(1))


def _loss(logits: torch.Tensor, rows: slice) -> torch.Tensor:
    w = DIRECTION[rows] * MASK[rows, :, None]  # (n, L, 1): real tokens only
    return (logits * w * torch.linspace(-1, 1, logits.shape[-1])).sum()


def _packed(model_dir, impl: str = "auto", device: str = "cpu") -> PackedModel:  # noqa: ANN001
    """Both slots of ``SPECS`` with random B (PEFT's zero init would leave B's gradient alone to check)."""
    return add_slots_random_b(PackedModel(load_base(str(model_dir), attn_implementation="eager", device=device)[0],
                                          impl=impl), SPECS)


STEP_SPECS = [
    AdapterSpec(rank=4, alpha=8, lr=1e-2, micro_batch=2, max_steps=2, seed=1, weight_decay=0.1, max_grad_norm=None),
    AdapterSpec(rank=2, alpha=4, rslora=True, lr=3e-3, micro_batch=1, max_steps=2, seed=2, max_grad_norm=0.05,
                betas=(0.8, 0.95)),
]


def _step_jobs() -> list[SlotJob]:
    return [SlotJob(spec, SlotStream(random_examples(6, seed=50 + i), spec.micro_batch, seed=spec.seed), key=i)
            for i, spec in enumerate(STEP_SPECS)]


def _trained(model_dir) -> tuple[dict, dict, dict]:  # noqa: ANN001
    """Per key: the losses, final weights and final AdamW moments of ``STEP_SPECS`` trained in one pack of 2 slots."""
    pm = PackedModel(load_base(str(model_dir), attn_implementation="eager")[0], impl="torch")
    rec, moments = Recorder(pm), {}

    def on_end(ends) -> None:  # noqa: ANN001
        rec.on_end(ends)
        for e in ends:
            moments[e.job.key] = {p: tuple(tuple(t.clone() for t in mv) for mv in pair)
                                  for p, pair in pm.slot_moments(e.slot).items()}

    queue = _step_jobs()
    train(pm, 2, lambda slot: queue.pop(0) if queue else None, pad_id=PAD, on_step=rec.on_step, on_end=on_end)
    return rec.losses, rec.final, moments


@pytest.mark.parametrize("family", FAMILIES)
def test_a_packed_slot_trains_as_peft_alone(tiny_dirs, family: str) -> None:
    """Two steps of a pack of two all-linear slots (ranks 4 and 2, rsLoRA, other learning rates, betas, decay and
    clipping) through ``train()``: each slot's losses, AdamW moments and weights equal PEFT + torch AdamW's for that
    adapter alone on the same rows. B starts at zero, so the first step moves only B; the second step's moments hold
    both steps' gradients of A and B (``exp_avg`` is their (1 - beta1)-weighted sum), so every gradient is checked,
    not only the sign AdamW's first update keeps of it."""
    model_dir = tiny_dirs(family)
    losses, final, moments = _trained(model_dir)
    for job in _step_jobs():
        ref = run_peft(model_dir, job.spec, job.stream, initial_a(model_dir, job.spec), targets="all-linear")
        assert final[job.key].keys() == ref.weights.keys(), "all-linear must adapt the modules PEFT's all-linear adapts"
        torch.testing.assert_close(torch.tensor(losses[job.key]), torch.tensor(ref.losses), rtol=1e-6, atol=0)
        for path, pair in moments[job.key].items():
            for name, (m, v), (rm, rv), w, rw in zip("AB", pair, ref.moments[path], final[job.key][path],
                                                     ref.weights[path], strict=True):
                where = f"{family} slot {job.key} {path} {name}"
                assert rm.abs().max() > 0 and rw.abs().max() > 0, f"{where}: nothing to compare"
                # fp32, the same GEMMs but the LoRA scale applied at another point: the difference travels through
                # the layers and the first update into the second step's gradient, up to 1.5e-4 of the largest
                # moment (gpt2, phi3, starcoder2) and 8e-5 of a weight (gemma; a step moves a weight by up to lr, 1e-2)
                for got, want, what in ((m, rm, "exp_avg"), (v, rv, "exp_avg_sq")):
                    torch.testing.assert_close(got, want, rtol=1e-4, atol=5e-4 * float(want.abs().max()),
                                               msg=lambda s, w=where, n=what: f"{w} {n}: {s}")
                torch.testing.assert_close(w, rw, rtol=0, atol=2e-4, msg=lambda s, w=where: f"{w} weight: {s}")


@pytest.mark.parametrize("family", FAMILIES)
def test_chunked_loss_runs_only_where_the_head_makes_the_logits(tiny_dirs, family: str) -> None:
    """``check_plain_head`` passes exactly for the families whose logits are ``head(last hidden state)``; there the
    chunked loss equals the plain one. The others (Gemma-2's soft-capping, Granite's scaling) are refused."""
    pm = _packed(tiny_dirs(family))
    labels = IDS.masked_fill(MASK == 0, -100)
    with torch.no_grad():
        logits = pm.forward(IDS, MASK, LAYOUT)
        hidden = pm.forward_hidden(IDS, MASK, LAYOUT)
        head = pm.model.get_output_embeddings()
        plain = torch.allclose(head(hidden), logits, rtol=0, atol=1e-6)
    if not plain:
        with pytest.raises(ConfigError, match="post-processes its logits"):
            check_plain_head(pm.model.config)
        return
    check_plain_head(pm.model.config)
    losses, counts = slot_losses(logits, labels, LAYOUT)
    with torch.no_grad():
        chunked, chunked_counts = chunked_slot_losses(hidden, pm.output_head(), labels, LAYOUT, chunk_tokens=5)
    torch.testing.assert_close(chunked, losses, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(chunked_counts, counts)


D_IN, D_OUT = 12, 10


def _layer(impl: str, device: str) -> PackedLoRALinear:
    gen = torch.Generator().manual_seed(0)
    base = nn.Linear(D_IN, D_OUT).requires_grad_(False)
    base.weight.copy_(torch.randn(D_OUT, D_IN, generator=gen))
    base.bias.copy_(torch.randn(D_OUT, generator=gen))
    layer = PackedLoRALinear(base.to(device), D_IN, D_OUT, layer_id=3,
                             state=PackState(impl=impl, scales={0: 2.0, 1: 0.5}))
    for slot, r in ((0, 3), (1, 2)):
        a, bt = torch.randn(r, D_IN, generator=gen), torch.randn(r, D_OUT, generator=gen)
        layer.add_slot(slot, a.to(device), bt.to(device), torch.zeros_like(a, device=device),
                       torch.zeros_like(bt, device=device))
    return layer


@pytest.mark.parametrize("impl", ["torch", "loop", "triton"])
def test_flattened_tokens_route_like_the_batch(impl: str) -> None:
    """On the per-adapter path, a (B·L, D_in) input (OPT's fc1/fc2) gives the (B, L, D_in) input's output and input
    gradient, LoRA dropout masks included: row i·L + t is token t of row i. (The step's routing of such inputs, and its
    slot gradients, are checked on OPT by ``test_a_packed_slot_trains_as_peft_alone``.)"""
    layout = PackLayout((0, 1), (0, 2), (2, 1), (5, 4), (0.25, 0.0), (11, 12))
    device = TRITON_DEVICE if impl == "triton" else "cpu"
    x = torch.randn(3, 5, D_IN, generator=torch.Generator().manual_seed(1)).to(device)
    grads = []
    for shape in ((3, 5, D_IN), (15, D_IN), (3, 5, 1, D_IN)):
        layer = _layer(impl, device)
        layer.state.layout = layout
        xi = x.reshape(shape).clone().requires_grad_()
        y = layer(xi)
        assert y.shape == (*shape[:-1], D_OUT)
        (y.reshape(3, 5, D_OUT) * torch.arange(D_OUT, device=device)).sum().backward()
        grads.append([y.reshape(3, 5, D_OUT), xi.grad.reshape(x.shape)])
    for other in grads[1:]:
        for got, want in zip(other, grads[0], strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    layer = _layer(impl, device)
    layer.state.layout = layout
    with pytest.raises(ValueError, match=r"shape \(14, 12\).*3 rows"):
        layer(torch.randn(14, D_IN, device=device))  # not 3 rows of tokens: e.g. those routed to one MoE expert


@pytest.mark.parametrize("family", FAMILIES)
def test_tiny_sizes(family: str) -> None:
    """Every family at the tiny size: 2 layers of width 64, 4 heads, the vocabulary asked for, ~0.1M parameters."""
    config = tiny_config(family, 300)
    model = _init_model(config, seed=0)
    assert (config.num_hidden_layers, config.hidden_size, config.num_attention_heads) == (2, 64, 4)
    assert model.get_input_embeddings().weight.shape == (300, 64) and model.dtype == torch.float32
    assert sum(p.numel() for p in model.parameters()) < 160_000
    assert (config.pad_token_id, config.bos_token_id, config.eos_token_id) == (0, 1, 2)


@pytest.mark.parametrize("family", ["opt", "phi3", "qwen3", "gpt2", "falcon"])
def test_triton_path_equals_torch_path(tiny_dirs, family: str) -> None:
    """On the per-adapter path the Triton kernels give the masked-dense path's logits and input-embedding gradients:
    OPT's flattened MLP input, fused QKV and gate/up, Conv1D, Qwen3's fused norms and MLP."""
    results = []
    for impl in ("torch", "triton"):
        pm = _packed(tiny_dirs(family), impl, TRITON_DEVICE)
        ids, mask = IDS.to(TRITON_DEVICE), MASK.to(TRITON_DEVICE)
        emb = pm.model.get_input_embeddings().weight.requires_grad_()  # the gradient through every adapted layer
        logits = pm.forward(ids, mask, LAYOUT)
        sum(_loss(logits[rows].cpu(), rows) for rows in SLOT_ROWS.values()).backward()
        results.append([logits.detach().cpu(), emb.grad.cpu()])
    assert bool(pm.fused) == (family == "qwen3"), "Qwen3's RMSNorms and SiLU MLPs run on the fused kernels"
    for got, want in zip(results[1], results[0], strict=True):
        # fp32; the kernels sum in their own order (tiles, split-K): 1e-5 of the largest entry
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5 * float(want.abs().max()))
