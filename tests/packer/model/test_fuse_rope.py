"""``packer.model.fuse``'s RoPE hooks: every listed attention class calls the function the kernel computes, a fused pack
gives the same logits and LoRA gradients (fp32), on every path into the model, and the swap of the module global
never outlives an attention call: not after an exception, not for a plain or PEFT model of the same class."""

from __future__ import annotations

import copy
import importlib

import pytest
import torch

from tests.conftest import need_triton

need_triton()  # before anything imports the Triton kernel modules

from peft import LoraConfig, get_peft_model  # noqa: E402
from transformers import AutoConfig, StaticCache  # noqa: E402

from lora_sweep.kernels import ops  # noqa: E402
from lora_sweep.kernels.ops import PackLayout  # noqa: E402
from lora_sweep.packer.model.fuse import ROPE_ATTENTIONS, RopeSwap, _hook_rope, fuse_base_ops  # noqa: E402
from lora_sweep.packer.model.load import load_base  # noqa: E402
from lora_sweep.packer.model.packed import PackedModel  # noqa: E402
from lora_sweep.packer.plan import AdapterSpec  # noqa: E402
from tests.conftest import add_slots_random_b, record_launches  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = dict(rtol=1e-5, atol=1e-5)  # fp32; the fused norms and MLPs sum in their own order
ROWS, SEQ = 3, 10
IDS = torch.randint(3, 260, (ROWS, SEQ), generator=torch.Generator().manual_seed(0))
MASK = torch.ones_like(IDS)
LAYOUT = PackLayout((0, 1), (0, 2), (2, 1), (SEQ, SEQ), (0.0, 0.0), (0, 0))
SPECS = {0: AdapterSpec(rank=4, alpha=8, targets=("all-linear",), seed=1),
         1: AdapterSpec(rank=2, alpha=4, targets=("q_proj", "k_proj", "v_proj"), seed=2)}


def _modeling(class_name: str):  # type: ignore[no-untyped-def]
    """``LlamaAttention`` -> transformers' ``modeling_llama`` module."""
    family = class_name.removesuffix("Attention").lower()
    return importlib.import_module(f"transformers.models.{family}.modeling_{family}")


def _rope_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """One entry per call of ``kernels.ops.rope`` (as ``packer.model.fuse`` calls it) from now on."""
    calls: list[int] = []
    real = ops.rope

    def spy(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(ops, "rope", spy)
    return calls


@pytest.mark.parametrize("name", sorted(ROPE_ATTENTIONS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_every_listed_attention_runs_the_fused_rope_with_the_same_bits(name: str, dtype: torch.dtype,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The allow-list is a claim about transformers' code, checked per class: its module's function equals the
    kernel bit for bit on the rotary module's own cos / sin, and the hooked attention calls the kernel once and
    gives the unhooked attention's output and input gradient."""
    modeling = _modeling(name)
    prefix = name.removesuffix("Attention")
    config = AutoConfig.for_model(prefix.lower(), hidden_size=32, intermediate_size=48, num_attention_heads=4,
                                  num_key_value_heads=2, head_dim=8)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    attn = getattr(modeling, name)(config, layer_idx=0).to(DEVICE, dtype)
    rotary = getattr(modeling, f"{prefix}RotaryEmbedding")(config).to(DEVICE)
    x = torch.randn(3, 7, 32, generator=torch.Generator().manual_seed(1)).to(DEVICE, dtype).requires_grad_()
    positions = torch.tensor([[0, 1, 2, 3, 0, 1, 2], [4, 5, 6, 7, 8, 9, 10], [0, 1, 0, 1, 2, 3, 4]], device=DEVICE)
    cos, sin = rotary(x, positions)
    assert cos.shape == (3, 7, 8) and cos.dtype == dtype  # what the kernel takes: (B, L, d) in the io dtype
    q = torch.randn(3, 7, 4, 8, generator=torch.Generator().manual_seed(2)).to(DEVICE, dtype).transpose(1, 2)
    k = torch.randn(3, 7, 2, 8, generator=torch.Generator().manual_seed(3)).to(DEVICE, dtype).transpose(1, 2)
    for got, want in zip(ops.rope(q, k, cos, sin, impl="triton"), modeling.apply_rotary_pos_emb(q, k, cos, sin),
                         strict=True):
        assert torch.equal(got, want)

    def run() -> tuple[torch.Tensor, torch.Tensor]:
        out = attn(x, position_embeddings=(cos, sin), attention_mask=None)[0]
        return out, torch.autograd.grad(out, x, torch.ones_like(out))[0]

    want = run()
    calls = _rope_calls(monkeypatch)
    assert fuse_base_ops(copy.deepcopy(torch.nn.ModuleList([attn])))[0] == "0"  # listed (Qwen3's q/k norms follow)
    assert _hook_rope(attn, "triton")  # the hooks alone: the norms of Qwen3 stay eager, so bf16 stays exact
    got = run()
    assert len(calls) == 1
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, **(TOL if dtype == torch.float32 else dict(rtol=0, atol=0)))


def _pack(model_dir, fused: bool, checkpointing: bool = False) -> PackedModel:  # noqa: ANN001
    """Both slots of ``SPECS`` on the Triton path, random B (PEFT's zero init would leave the LoRA terms out)."""
    pm = add_slots_random_b(PackedModel(load_base(str(model_dir), device=DEVICE)[0], impl="triton",
                                        fused_base_ops=fused), SPECS)
    pm.set_activation_checkpointing(checkpointing)
    return pm


def _step(pm: PackedModel, positions: torch.Tensor | None = None) -> list[torch.Tensor]:
    """Logits and the input embeddings' gradient of one packed forward and backward on the per-adapter path (the
    gradient runs back through every layer's rope and LoRA term)."""
    emb = pm.model.get_input_embeddings().weight
    emb.requires_grad_()
    emb.grad = None
    logits = pm.forward(IDS.to(DEVICE), MASK.to(DEVICE), LAYOUT, positions)
    (logits * torch.linspace(-1, 1, logits.shape[-1], device=DEVICE)).sum().backward()
    return [logits.detach(), emb.grad]


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_a_fused_pack_gives_the_same_logits_and_input_gradients(tiny_dirs, family: str,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """One rope kernel per layer forward and one backward; restarting positions (sample packing) and activation
    checkpointing (the recompute runs in the backward, outside the model's call) included."""
    plain = _pack(tiny_dirs(family), fused=False)
    layers = plain.model.config.num_hidden_layers
    positions = torch.arange(SEQ).remainder(6)[None].expand(ROWS, SEQ).to(DEVICE)  # two examples per row
    for checkpointing in (False, True):
        fused = _pack(tiny_dirs(family), fused=True, checkpointing=checkpointing)
        assert sum(p.endswith("self_attn") for p in fused.fused) == layers
        for pos in (None, positions):
            want = _step(plain, pos)
            launches = record_launches(monkeypatch)
            got = _step(fused, pos)
            ropes = sum(v[0] == "_rope_kernel" for _, v in launches)
            assert ropes == (3 if checkpointing else 2) * layers  # forward, backward (and the recompute)
            monkeypatch.undo()
            torch.testing.assert_close(got[0], want[0], **TOL)
            # the embeddings' gradient sums every token's through the layers (and the tied head's): 1e-5 of its largest
            torch.testing.assert_close(got[1], want[1], rtol=TOL["rtol"], atol=1e-5 * float(want[1].abs().max()))


def test_the_global_is_restored_after_forward_and_after_an_exception(tiny_dirs) -> None:
    pm = _pack(tiny_dirs("llama"), fused=True)
    modeling = _modeling("LlamaAttention")
    eager = modeling.apply_rotary_pos_emb
    seen = []
    attn = pm.model.model.layers[0].self_attn
    attn.o_proj.register_forward_pre_hook(lambda *_: seen.append(modeling.apply_rotary_pos_emb))
    pm.forward(IDS.to(DEVICE), MASK.to(DEVICE), LAYOUT)
    assert seen and seen[0] is not eager and seen[0].func.__name__ == "fused_rope"  # swapped while it ran
    assert modeling.apply_rotary_pos_emb is eager

    def fail(*_: object) -> None:
        raise RuntimeError("boom")

    handle = attn.o_proj.register_forward_pre_hook(fail)
    with pytest.raises(RuntimeError, match="boom"):
        pm.forward(IDS.to(DEVICE), MASK.to(DEVICE), LAYOUT)
    handle.remove()
    assert modeling.apply_rotary_pos_emb is eager
    swaps = [m._fused_rope_hooks[0] for m in pm.model.modules() if hasattr(m, "_fused_rope_hooks")]
    assert swaps and all(isinstance(s, RopeSwap) and s.saved == [] for s in swaps)


def test_plain_and_peft_models_in_the_same_process_are_untouched(tiny_dirs, monkeypatch: pytest.MonkeyPatch) -> None:
    pm = _pack(tiny_dirs("llama"), fused=True)
    plain, _ = load_base(str(tiny_dirs("llama")), device=DEVICE)
    peft = get_peft_model(load_base(str(tiny_dirs("llama")), device=DEVICE)[0],
                          LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))
    calls = _rope_calls(monkeypatch)
    pm.forward(IDS.to(DEVICE), MASK.to(DEVICE), LAYOUT)
    assert len(calls) == pm.model.config.num_hidden_layers
    for other in (plain, peft):
        other(input_ids=IDS.to(DEVICE), use_cache=False)
    assert len(calls) == pm.model.config.num_hidden_layers  # neither called the kernel


def test_hooks_follow_fuse_base_ops_and_a_deep_copy(tiny_dirs, monkeypatch: pytest.MonkeyPatch) -> None:
    """Installed once however often the model is fused, removed by an eager pack over it; a deep copy gets hooks
    of its own."""
    model, _ = load_base(str(tiny_dirs("llama")), device=DEVICE)
    first = fuse_base_ops(model)
    attentions = [m for m in model.modules() if type(m).__name__ == "LlamaAttention"]
    assert fuse_base_ops(model) == first and all(len(a._forward_pre_hooks) == 1 for a in attentions)
    twin = copy.deepcopy(model)
    assert fuse_base_ops(model, "torch") == first  # the paths it fused, now eager again
    assert all(not a._forward_pre_hooks and not a._forward_hooks for a in attentions)
    calls = _rope_calls(monkeypatch)
    model(input_ids=IDS.to(DEVICE), use_cache=False)
    assert calls == []
    twin(input_ids=IDS.to(DEVICE), use_cache=False)
    assert len(calls) == model.config.num_hidden_layers
    assert "model.layers.0.self_attn" not in fuse_base_ops(model, "torch")


def test_a_cached_decode_runs_the_fused_rope_with_the_same_logits(tiny_dirs, monkeypatch: pytest.MonkeyPatch) -> None:
    """A prompt then one token at a time on a StaticCache (the captured decode's cache): cos / sin of the prompt's
    length, then of L = 1."""
    models = [load_base(str(tiny_dirs("qwen2")), device=DEVICE)[0] for _ in range(2)]
    fuse_base_ops(models[0])
    calls = _rope_calls(monkeypatch)
    outs = []
    for model in models:
        cache = StaticCache(config=model.config, max_cache_len=SEQ + 4)
        logits = [model(input_ids=IDS[:, :SEQ].to(DEVICE), past_key_values=cache, use_cache=True).logits]
        token = logits[-1][:, -1:].argmax(-1)
        for step in range(3):
            position = torch.full((ROWS, 1), SEQ + step, device=DEVICE)
            logits.append(model(input_ids=token, past_key_values=cache, position_ids=position,
                                cache_position=position[0], use_cache=True).logits)
            token = logits[-1][:, -1:].argmax(-1)
        outs.append(logits)
    assert len(calls) == 4 * models[0].config.num_hidden_layers
    for got, want in zip(*outs, strict=True):
        torch.testing.assert_close(got, want, **TOL)
