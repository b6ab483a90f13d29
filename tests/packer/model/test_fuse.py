"""``packer.model.fuse``: swapping a base's RMSNorms and SiLU-gated MLPs for fused modules (and its RoPE, see
``test_fuse_rope.py``) changes no value, no gradient and no parameter path, and a pack on the Triton path trains to
the same losses with them."""

from __future__ import annotations

import importlib

import pytest
import torch

from tests.conftest import need_triton

need_triton()  # before anything imports the Triton kernel modules

from transformers import AutoConfig  # noqa: E402

from lora_sweep.packer.model.fuse import GATED_MLPS, RMS_NORMS, FusedGatedMLP, FusedRMSNorm, fuse_base_ops  # noqa: E402
from lora_sweep.packer.model.load import load_base  # noqa: E402
from lora_sweep.packer.model.packed import PackedModel  # noqa: E402
from lora_sweep.packer.plan import AdapterSpec  # noqa: E402
from lora_sweep.packer.step.train import FixedBatch, SlotJob, train  # noqa: E402
from lora_sweep.packer.tiny.models import build_tiny_model  # noqa: E402
from tests.conftest import Recorder, random_examples  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = dict(rtol=1e-5, atol=1e-5)  # fp32 everywhere: only the reduction order differs


def _family(class_name: str) -> str:
    """``Qwen2RMSNorm`` -> ``qwen2``: the transformers model type a listed class belongs to."""
    return class_name.removesuffix("RMSNorm").removesuffix("MLP").lower()


def _hf_class(class_name: str) -> type:
    family = _family(class_name)
    return getattr(importlib.import_module(f"transformers.models.{family}.modeling_{family}"), class_name)


def _x(*shape: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * 3 + 1).to(DEVICE).requires_grad_()


def _same_function(original: torch.nn.Module, fused: torch.nn.Module, width: int) -> None:
    """Equal outputs and input gradients of two modules on one input."""
    x = _x(2, 5, width)
    y, want = fused(x), original(x)
    torch.testing.assert_close(y, want, **TOL)
    dy = torch.randn_like(y)
    torch.testing.assert_close(torch.autograd.grad(y, x, dy)[0], torch.autograd.grad(want, x, dy)[0], **TOL)


@pytest.mark.parametrize("name", sorted(RMS_NORMS))
def test_every_listed_rms_norm_computes_what_the_kernel_does(name: str) -> None:
    """The allow-list is a claim about transformers' code: each class is checked, not trusted by its name."""
    norm = _hf_class(name)(48, eps=1e-5).to(DEVICE)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(48, generator=torch.Generator().manual_seed(1)))
    _same_function(norm, FusedRMSNorm(norm, "triton"), 48)


@pytest.mark.parametrize("name", sorted(GATED_MLPS))
def test_every_listed_mlp_computes_what_the_kernel_does(name: str) -> None:
    config = AutoConfig.for_model(_family(name), hidden_size=32, intermediate_size=48, num_attention_heads=4)
    torch.manual_seed(0)
    mlp = _hf_class(name)(config).to(DEVICE)
    _same_function(mlp, FusedGatedMLP(mlp, "triton"), 32)


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral"])
def test_fusing_a_model_keeps_its_logits_gradients_and_parameter_paths(tiny_dirs, family: str) -> None:
    plain, _ = load_base(str(tiny_dirs(family)), device=DEVICE)
    model, _ = load_base(str(tiny_dirs(family)), device=DEVICE)
    names = [n for n, _ in model.named_parameters()]
    fused = fuse_base_ops(model)
    layers = model.config.num_hidden_layers
    assert len(fused) == 4 * layers + 1  # two norms, an MLP and the attention's RoPE per layer, the final norm
    assert sum(isinstance(m, FusedRMSNorm) for m in model.modules()) == 2 * layers + 1
    assert [n for n, _ in model.named_parameters()] == names
    ids = torch.randint(3, 300, (2, 11), generator=torch.Generator().manual_seed(0)).to(DEVICE)
    outs = []
    for m in (model, plain):
        emb = m.get_input_embeddings()(ids).detach().requires_grad_()
        out = m(inputs_embeds=emb, labels=ids, use_cache=False)
        out.loss.backward()
        outs.append((out.logits, emb.grad))
    for got, want in zip(*outs, strict=True):
        torch.testing.assert_close(got, want, **TOL)


def test_fusing_skips_what_it_does_not_know_and_is_idempotent(tiny_dirs) -> None:
    gpt2, _ = load_base(str(tiny_dirs("gpt2")), device=DEVICE)
    assert fuse_base_ops(gpt2) == []  # LayerNorm and a GELU MLP: nothing to swap
    config = AutoConfig.for_model("llama", hidden_size=32, intermediate_size=48, num_attention_heads=4,
                                  num_hidden_layers=1, vocab_size=64, hidden_act="gelu")
    from transformers import AutoModelForCausalLM

    gelu = AutoModelForCausalLM.from_config(config)
    assert fuse_base_ops(gelu) == ["model.layers.0.self_attn", "model.layers.0.input_layernorm",
                                   "model.layers.0.post_attention_layernorm", "model.norm"]  # not the GELU MLP
    model, _ = load_base(str(tiny_dirs("llama")), device=DEVICE)
    first = fuse_base_ops(model)
    modules = dict(model.named_modules())
    assert fuse_base_ops(model) == first and dict(model.named_modules()) == modules  # nothing wrapped twice
    assert fuse_base_ops(model, "torch") == first  # an eager pack over the same model: the fused modules follow
    assert {m.impl for m in model.modules() if isinstance(m, (FusedRMSNorm, FusedGatedMLP))} == {"torch"}


def _losses(pm: PackedModel) -> Recorder:
    """Two slots (one with dropout, different ranks and targets), three steps each."""
    specs = [AdapterSpec(rank=4, targets=("all-linear",), max_steps=3, seed=1, lr=1e-2),
             AdapterSpec(rank=2, targets=("gate_proj", "up_proj", "down_proj"), dropout=0.1, max_steps=3, seed=2,
                         lr=1e-2)]
    jobs = [SlotJob(s, FixedBatch(random_examples(2, i)), key=i) for i, s in enumerate(specs)]
    rec = Recorder(pm)
    train(pm, 2, lambda s: jobs.pop(0) if jobs else None, pad_id=0, on_step=rec.on_step, on_end=rec.on_end)
    return rec


def test_a_pack_on_the_triton_path_fuses_and_trains_the_same(tmp_path_factory: pytest.TempPathFactory) -> None:
    # one decoder layer: every fused kind is in it, and each layer more is as many interpreted kernels again
    qwen2 = build_tiny_model("qwen2", tmp_path_factory.mktemp("tiny-qwen2-1"), seed=0, num_layers=1)
    fused_pm = PackedModel(load_base(str(qwen2), device=DEVICE)[0], impl="triton")
    plain_pm = PackedModel(load_base(str(qwen2), device=DEVICE)[0], impl="triton", fused_base_ops=False)
    assert len(fused_pm.fused) == 5 and plain_pm.fused == []  # 1 layer: 2 norms, a MLP, a RoPE; the final norm
    fused, plain = _losses(fused_pm), _losses(plain_pm)
    for key in (0, 1):
        assert len(fused.losses[key]) == 3
        torch.testing.assert_close(torch.tensor(fused.losses[key]), torch.tensor(plain.losses[key]), **TOL)
        # AdamW divides by the gradient's own scale, so reduction-order noise in a near-zero gradient moves a
        # weight by a visible fraction of a step (up to 6.5e-5 here): the bound of the PEFT oracle test
        for (a, b), (a0, b0) in zip(fused.final[key].values(), plain.final[key].values(), strict=True):
            torch.testing.assert_close(a, a0, rtol=0, atol=1e-4)
            torch.testing.assert_close(b, b0, rtol=0, atol=1e-4)
    again = PackedModel(fused_pm.model, impl="triton", fused_base_ops=False)  # a later eager pack over that model
    assert again.fused == []
    assert {m.impl for m in again.model.modules() if isinstance(m, (FusedRMSNorm, FusedGatedMLP))} == {"torch"}
    assert not any(hasattr(m, "_fused_rope_hooks") for m in again.model.modules())  # the RoPE hooks removed
    eager = PackedModel(load_base(str(qwen2), device=DEVICE)[0], impl="torch")
    assert eager.fused == [] and not any(isinstance(m, FusedRMSNorm) for m in eager.model.modules())
