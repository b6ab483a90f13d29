"""Every tiny family: all-linear resolves as PEFT's does, and a packed slot is PEFT's adapter, forward and backward.

The oracle is PEFT on a fresh copy of the base with the slot's weights copied in (fp32, eager attention). Each
family is a stock transformers architecture (``packer.tiny.models`` / ``packer.tiny.families``): fused QKV and gate/up,
biases, tied heads, Conv1D, OPT's MLP fed flattened (B·L, D) hidden states, logits post-processed after the head.

Run: python -m pytest tests/packer/model/test_families.py -q
"""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model
from torch import nn
from transformers import AutoModelForCausalLM
from transformers.pytorch_utils import Conv1D

from tests.conftest import add_slots_random_b, need_triton

need_triton()  # before anything imports the Triton kernel modules

from lora_sweep.errors import ConfigError  # noqa: E402
from lora_sweep.kernels.ops import PackLayout  # noqa: E402
from lora_sweep.packer.loss import check_plain_head, chunked_slot_losses, slot_losses  # noqa: E402
from lora_sweep.packer.model.layer import PackedLoRALinear, PackState  # noqa: E402
from lora_sweep.packer.model.packed import PackedModel, load_base  # noqa: E402
from lora_sweep.packer.plan import AdapterSpec  # noqa: E402
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


def _peft(model_dir, pm: PackedModel, slot: int) -> tuple[nn.Module, dict[str, tuple[nn.Parameter, nn.Parameter]]]:  # noqa: ANN001
    """PEFT's ``all-linear`` adapter with the slot's hyperparameters and weights; path -> its (A, B)."""
    spec = SPECS[slot]
    base = AutoModelForCausalLM.from_pretrained(str(model_dir), attn_implementation="eager")
    conv1d = any(isinstance(m, Conv1D) for m in base.modules())
    model = get_peft_model(base, LoraConfig(r=spec.rank, lora_alpha=spec.alpha, use_rslora=spec.rslora,
                                            target_modules="all-linear", lora_dropout=0.0, fan_in_fan_out=conv1d))
    model.eval()
    params = dict(model.named_parameters())
    lora = {path.removeprefix("base_model.model.").removesuffix(".lora_A.default.weight"):
            (params[path], params[path.replace(".lora_A.", ".lora_B.")])
            for path in params if path.endswith(".lora_A.default.weight")}
    with torch.no_grad():
        for path, (a, b) in pm.slot_weights(slot).items():
            lora[path][0].copy_(a)
            lora[path][1].copy_(b)
    return model, lora


@pytest.mark.parametrize("family", FAMILIES)
def test_packed_slots_equal_peft_forward_and_backward(tiny_dirs, family: str) -> None:
    model_dir = tiny_dirs(family)
    pm = _packed(model_dir)
    logits = pm.forward(IDS, MASK, LAYOUT)  # (B, L, V)
    with torch.no_grad():
        base_logits = pm.forward(IDS, MASK, None)
    assert (logits - base_logits).abs().max() > 1e-2, "the adapters must move the logits for the check to mean much"
    sum(_loss(logits[rows], rows) for rows in SLOT_ROWS.values()).backward()
    for slot, rows in SLOT_ROWS.items():
        peft_model, lora = _peft(model_dir, pm, slot)
        assert set(lora) == set(pm.slot_paths[slot]), "all-linear must adapt the modules PEFT's all-linear adapts"
        # The whole batch through PEFT, the loss on the slot's rows: the same GEMM shapes as the pack's, and rows
        # never mix, so the other rows change nothing of the slot's logits or gradients.
        ref = peft_model(input_ids=IDS, attention_mask=MASK).logits[rows]
        _loss(ref, rows).backward()
        real = MASK[rows].bool()
        torch.testing.assert_close(logits[rows][real], ref[real], rtol=1e-5, atol=1e-5)
        pairs = [(f"{path} {name}", got, want) for path, (a, b) in pm.slot_weights(slot).items()
                 for name, got, want in (("A", a.grad, lora[path][0].grad), ("B", b.grad, lora[path][1].grad))]
        assert all(want is not None and want.abs().max() > 0 for _, _, want in pairs), "a gradient is missing"
        # fp32, the same GEMMs but the LoRA scale applied at another point (rsLoRA's s = 4/sqrt(2) rounds): the
        # difference travels through the layers, up to ~1e-5 of the slot's largest gradient entry
        scale = max(float(want.abs().max()) for _, _, want in pairs)
        for where, got, want in pairs:
            torch.testing.assert_close(got, want, rtol=1e-4, atol=2e-5 * scale,
                                       msg=lambda m, w=where: f"{family} {w} grad: {m}")


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
    """A (B·L, D_in) input (OPT's fc1/fc2) gives the (B, L, D_in) input's output and gradients, LoRA dropout
    masks included: row i·L + t is token t of row i."""
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
        w = [layer.slot_weights(s) for s in (0, 1)]
        grads.append([y.reshape(3, 5, D_OUT), xi.grad.reshape(x.shape)] + [g for s in w for g in (s.grad_a, s.grad_bt)])
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
    """The Triton kernels give the masked-dense path's logits and slot gradients: OPT's flattened MLP input, fused
    QKV and gate/up, Conv1D, Qwen3's fused norms and MLP."""
    results = []
    for impl in ("torch", "triton"):
        pm = _packed(tiny_dirs(family), impl, TRITON_DEVICE)
        ids, mask = IDS.to(TRITON_DEVICE), MASK.to(TRITON_DEVICE)
        logits = pm.forward(ids, mask, LAYOUT)
        sum(_loss(logits[rows].cpu(), rows) for rows in SLOT_ROWS.values()).backward()
        results.append([logits.detach().cpu()] + [pm.flat_buffers(slot)[1].cpu() for slot in SPECS])
    assert bool(pm.fused) == (family == "qwen3"), "Qwen3's RMSNorms and SiLU MLPs run on the fused kernels"
    for got, want in zip(results[1], results[0], strict=True):
        # fp32; the kernels sum in their own order (tiles, split-K): 1e-5 of the largest entry
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5 * float(want.abs().max()))
