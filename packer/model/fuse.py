"""Run the frozen base's RMSNorms, SiLU-gated MLP middles and rotary embeddings as fused Triton kernels.

Once the LoRA side of a pack is cheap, a large base's step is its GEMMs plus eager elementwise ops:
on a Llama-3-8B step the base's elementwise kernels took a large share of the kernel time, most of it RMSNorm's
fp32 passes (BENCHMARKS.md, "GPU training throughput (W1) and the memory model"). ``fuse_base_ops``
swaps, in place, each module of a class known to compute exactly transformers' Llama RMSNorm or
SiLU-gated MLP for a module that calls ``kernels.ops.rms_norm`` / ``kernels.ops.silu_mul`` (Liger-Kernel's
idea; torchtune reaches the same with ``torch.compile``). The swapped modules hold the original
parameters and children under the same names, so parameter paths and the projections the packer
wraps do not change. Modules of other classes (GPT-2's LayerNorm, Gemma's ``1 + w`` norm, a GELU
MLP) are left alone.

Attention modules of a class known to call its module's ``apply_rotary_pos_emb(q, k, cos, sin)`` with
transformers' Llama formula get the fused RoPE (``kernels.ops.rope``, the same bits as eager): that function is a
module global, looked up when the forward runs, so it is swapped for the length of each such module's forward
call (``RopeSwap``) and put back after, an exception included. Hooks on the attention module, not on the
top-level model, because every path runs through its call and not all through the model's: the step,
the captured decode, generation and lm-eval call ``pm.model`` directly, ``forward_hidden`` its body, and
activation checkpointing recomputes decoder layers in the backward, outside any model call. The global is then
swapped only while this model's attention runs: a PEFT model, or a plain model of the same class elsewhere in the
process, runs the eager function (another thread running one at that very moment would see the fused one, with
the same results).
"""

from __future__ import annotations

import functools
import inspect
import sys
from collections.abc import Callable

import torch
from torch import nn

from lora_sweep.kernels import ops
from lora_sweep.kernels.ops import Impl
from lora_sweep.packer.families import FAMILIES

__all__ = ["RMS_NORMS", "GATED_MLPS", "ROPE_ATTENTIONS", "FusedRMSNorm", "FusedGatedMLP", "RopeSwap", "fuse_base_ops",
           "fused_rope"]

_FUSED = tuple(f.fuses for f in FAMILIES if f.fuses is not None)
"""Class-name prefixes of the families whose norms, MLPs and attention fuse (``packer.families``)."""
RMS_NORMS = frozenset(f"{prefix}RMSNorm" for prefix in _FUSED)
"""Classes whose forward is ``weight * (x * rsqrt(mean(x^2) + eps)).to(x.dtype)`` with the mean in fp32 (checked
against each by ``tests/packer/model/test_fuse.py``)."""
GATED_MLPS = frozenset(f"{prefix}MLP" for prefix in _FUSED)
"""Classes whose forward is ``down_proj(act_fn(gate_proj(x)) * up_proj(x))``; fused when ``act_fn`` is SiLU."""
ROPE_ATTENTIONS = frozenset(f"{prefix}Attention" for prefix in _FUSED)
"""Classes whose forward calls its module's ``apply_rotary_pos_emb(q, k, cos, sin)`` on q, k of (B, H, L, d) and
the rotary module's (B, L, d) cos, sin, that function being ``q * cos + rotate_half(q) * sin`` (the same for k)
with ``unsqueeze_dim=1`` (checked against each by ``tests/packer/model/test_fuse_rope.py``)."""

_ROPE = "apply_rotary_pos_emb"
_HOOKS = "_fused_rope_hooks"
"""Attribute of a hooked attention module: its ``RopeSwap`` and the two hook handles."""


class FusedRMSNorm(nn.Module):
    """An RMSNorm of one of ``RMS_NORMS`` on ``kernels.ops.rms_norm``; same ``weight`` and ``variance_epsilon``."""

    def __init__(self, norm: nn.Module, impl: Impl) -> None:
        super().__init__()
        self.weight = norm.weight
        self.variance_epsilon = float(norm.variance_epsilon)
        self.impl = impl

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (..., D) -> (..., D)."""
        return ops.rms_norm(x, self.weight, self.variance_epsilon, impl=self.impl)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}, impl={self.impl}"


class FusedGatedMLP(nn.Module):
    """A SiLU-gated MLP of one of ``GATED_MLPS`` whose middle is ``kernels.ops.silu_mul``; same three projections."""

    def __init__(self, mlp: nn.Module, impl: Impl) -> None:
        super().__init__()
        self.gate_proj = mlp.gate_proj
        self.up_proj = mlp.up_proj
        self.down_proj = mlp.down_proj
        self.impl = impl

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (..., D) -> (..., D); the intermediate (..., I) is ``silu(gate_proj(x)) * up_proj(x)``."""
        return self.down_proj(ops.silu_mul(self.gate_proj(x), self.up_proj(x), impl=self.impl))



def fused_rope(eager: Callable, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               unsqueeze_dim: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' ``apply_rotary_pos_emb`` on ``kernels.ops.rope`` (Triton) where it takes the operands as they are;
    else ``eager``, the function it stands in for (another ``unsqueeze_dim``, cos in another dtype, cos that
    trains: eager broadcasts, promotes, differentiates).

    Args:
        eager: the module's own ``apply_rotary_pos_emb``.
        q: (B, H, L, d); k: (B, Hk, L, d); cos, sin: (B or 1, L, d).
    """
    if unsqueeze_dim == 1 and ops.rope_problem(q, k, cos, sin) is None:
        return ops.rope(q, k, cos, sin, impl="triton")
    return eager(q, k, cos, sin, unsqueeze_dim)


class RopeSwap:
    """The forward pre-hook (``enter``) and always-called forward hook (``leave``) of one attention module: its
    module's ``apply_rotary_pos_emb`` is ``fused_rope`` over the current one while the module's forward runs.

    Holds the module's name, not its namespace, so a deep copy of the model copies the hooks (a module cannot be
    copied); what ``enter`` found is kept on a stack, so ``leave`` restores exactly that.
    """

    def __init__(self, namespace: str) -> None:
        self.namespace = namespace
        self.saved: list[Callable] = []

    def enter(self, module: nn.Module, args: tuple) -> None:
        scope = sys.modules[self.namespace].__dict__
        eager = scope[_ROPE]
        self.saved.append(eager)
        scope[_ROPE] = functools.partial(fused_rope, eager)

    def leave(self, module: nn.Module, args: tuple, output: object) -> None:
        if self.saved:  # empty only if ``enter`` itself failed
            sys.modules[self.namespace].__dict__[_ROPE] = self.saved.pop()


def _rope_namespace(attention: nn.Module) -> str | None:
    """Name of the module whose global ``apply_rotary_pos_emb`` ``attention``'s forward calls, when that global
    is the module's own function (not one patched in by another library, whose math we do not know); else None."""
    forward = inspect.unwrap(type(attention).forward)  # under transformers' argument-deprecation wrappers
    scope = getattr(forward, "__globals__", {})
    eager = scope.get(_ROPE)
    if _ROPE not in getattr(getattr(forward, "__code__", None), "co_names", ()) or not callable(eager) \
            or getattr(eager, "__module__", None) != scope.get("__name__"):
        return None
    return scope["__name__"]


def _hook_rope(attention: nn.Module, impl: Impl) -> bool:
    """Install (``impl == "triton"``) or remove (any other) the ``RopeSwap`` hooks of one attention module of
    ``ROPE_ATTENTIONS``; whether it has them, or had them before removing them."""
    hooks = getattr(attention, _HOOKS, None)
    if impl != "triton":
        if hooks is not None:
            for handle in hooks[1:]:
                handle.remove()
            delattr(attention, _HOOKS)
        return hooks is not None
    if hooks is None:
        namespace = _rope_namespace(attention)
        if namespace is None:
            return False
        swap = RopeSwap(namespace)
        setattr(attention, _HOOKS, (swap, attention.register_forward_pre_hook(swap.enter),
                                    attention.register_forward_hook(swap.leave, always_call=True)))
    return True


def _is_silu(act: nn.Module) -> bool:
    """transformers' ``ACT2FN["silu"]``: ``nn.SiLU`` or, in some versions, its own ``SiLUActivation``."""
    return isinstance(act, nn.SiLU) or type(act).__name__ == "SiLUActivation"


def fuse_base_ops(model: nn.Module, impl: Impl = "triton") -> list[str]:
    """Swap every known RMSNorm and SiLU-gated MLP of ``model`` for its fused module, in place, and set ``impl``
    on every fused module, new or swapped in before (by an earlier pack over the same model); hook every known
    attention module onto the fused RoPE (``RopeSwap``), or unhook it where ``impl`` is not ``triton``.

    Args:
        model: a transformers causal LM (any module tree works; unknown classes are skipped).
        impl: what the fused modules call: ``triton`` (CUDA, or the interpreter) swaps and hooks; any other
            implementation swaps nothing and makes modules swapped or hooked before compute eagerly again
            (``kernels.reference``; the hooks are removed).

    Returns:
        Paths of the fused modules and hooked attention modules (for another ``impl``: those fused or hooked
        before), in module order (empty for a model with none of these classes).
    """
    swaps: list[tuple[str, nn.Module]] = []
    fused: list[str] = []
    for path, module in model.named_modules():
        name = type(module).__name__
        if isinstance(module, (FusedRMSNorm, FusedGatedMLP)):
            module.impl = impl
            fused.append(path)
        elif name in ROPE_ATTENTIONS:
            if _hook_rope(module, impl):
                fused.append(path)
        elif impl == "triton" and name in RMS_NORMS:
            swaps.append((path, FusedRMSNorm(module, impl)))
        elif impl == "triton" and name in GATED_MLPS and _is_silu(module.act_fn):
            swaps.append((path, FusedGatedMLP(module, impl)))
    for path, new in swaps:  # after the walk: never change a tree while iterating it
        parent_path, _, leaf = path.rpartition(".")
        setattr(model.get_submodule(parent_path) if parent_path else model, leaf, new)
    order = {p: i for i, (p, _) in enumerate(model.named_modules())}
    return sorted(fused + [p for p, _ in swaps], key=order.__getitem__)
