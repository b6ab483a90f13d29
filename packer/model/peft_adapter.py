"""A saved PEFT LoRA adapter converted: to vLLM's rules (``vllm_adapter``), or folded into its base
(``merge_adapter``). The tensors are a PEFT ``adapter_model.safetensors``' (``checkpoint.read_adapter``): keys
``base_model.model.<module path>.lora_{A,B}[.<adapter name>].weight``, A (r, D_in), B (D_out, r), plus each variant's
extra tensors under its ``peft_key`` (DoRA's ``lora_magnitude_vector``, (D_out,)).

vLLM's rules (a rank from its ``max_lora_rank`` choices, one rank and alpha per adapter, keys without adapter names)
are met without changing the adapter's function: a rank outside ``VLLM_RANKS`` is zero-padded to the next allowed
one (extra rows of A, columns of B) with alpha rescaled so the scale s stays (alpha' = s·r', or s·sqrt(r') with
rsLoRA); rank/alpha patterns are folded into B; adapter names are dropped from keys.
"""

from __future__ import annotations

import math
import re
from typing import Any

import torch

from lora_sweep.errors import UserError
from lora_sweep.packer.variants import BUILT_IN

__all__ = ["VLLM_RANKS", "vllm_refusal", "vllm_adapter", "merge_adapter"]

VLLM_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""Values vLLM accepts for ``max_lora_rank`` (vllm/config/lora.py)."""

_KEY = re.compile(r"base_model\.model\.(.+)\.lora_([AB])(?:\.[^.]+)?\.weight")  # an adapter name may sit before .weight

_EXTRA = {f".{v.peft_key}": v for v in BUILT_IN if v.peft_key}
"""Key suffix -> the variant whose extra tensors a checkpoint holds under it."""


def _modules(tensors: dict[str, torch.Tensor], why: str) -> tuple[dict[str, list[torch.Tensor]], bool]:
    """Module path -> [A (r, D_in), B (D_out, r)], and whether any key carried an adapter name; ``why``: the end of
    the message refusing a tensor that is neither."""
    out: dict[str, list[torch.Tensor]] = {}
    named = False
    for key, t in tensors.items():
        m = _KEY.fullmatch(key)
        if m is None:
            raise UserError(f"export: tensor {key!r} is not a LoRA A/B weight ({why})")
        named |= not key.endswith(f".lora_{m.group(2)}.weight")
        out.setdefault(m.group(1), [torch.empty(0), torch.empty(0)])["AB".index(m.group(2))] = t
    return out, named


def _pattern_value(patterns: dict[str, Any], path: str, default: float) -> float:
    for key, value in patterns.items():  # PEFT's get_pattern_key: a suffix of dotted module names
        if re.match(rf"(.*\.)?({key})$", path):
            return float(value)
    return default


def _scale(config: dict[str, Any], path: str, rank: int) -> float:
    """The module's LoRA scale s as PEFT computes it: alpha/r, or alpha/sqrt(r) with rsLoRA."""
    alpha = _pattern_value(config.get("alpha_pattern") or {}, path, float(config["lora_alpha"]))
    return alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)


def vllm_refusal(config: dict[str, Any], tensors: dict[str, torch.Tensor]) -> str | None:
    """Why vLLM cannot serve the adapter without changing its function (DoRA, biases, ``modules_to_save``, a rank
    above vLLM's largest ``max_lora_rank``), as words after "the adapter uses"; None when it can."""
    for bad, why in ((config.get("use_dora"), "DoRA"), (config.get("modules_to_save"), "modules_to_save"),
                     (config.get("bias", "none") != "none", f"bias={config.get('bias')!r}")):
        if bad:
            return f"{why}, which vLLM does not support"
    rank = max((t.shape[0] for k, t in tensors.items() if k.endswith(".lora_A.weight") or ".lora_A." in k), default=0)
    if rank > VLLM_RANKS[-1]:
        return f"rank {rank}, above vLLM's largest max_lora_rank {VLLM_RANKS[-1]}"
    return None


def vllm_adapter(config: dict[str, Any], tensors: dict[str, torch.Tensor], hint: str = "use vllm=False"
                 ) -> tuple[dict[str, Any], dict[str, torch.Tensor], list[str]]:
    """The same adapter function under vLLM's rules: (config, tensors, list of the changes made). ``hint``: how the
    caller's user asks for the adapter as trained instead (the end of a refusal's message).

    Raises:
        UserError: an adapter vLLM cannot take without changing the function (``vllm_refusal``).
    """
    why = vllm_refusal(config, tensors)
    if why is not None:
        raise UserError(f"export: the adapter uses {why}; {hint}")
    modules, named = _modules(tensors, f"vLLM rejects it; {hint}")
    rank = max(a.shape[0] for a, _ in modules.values())
    target = next(r for r in VLLM_RANKS if r >= rank)
    s = float(config["lora_alpha"]) / (math.sqrt(config["r"]) if config.get("use_rslora") else config["r"])
    changes = []
    if target != config["r"]:
        changes.append(f"rank {config['r']} zero-padded to {target} (alpha rescaled, same scale {s:.6g})")
    if config.get("rank_pattern") or config.get("alpha_pattern"):
        changes.append("rank/alpha patterns folded into lora_B (vLLM ignores patterns)")
    if named:
        changes.append("adapter names dropped from tensor keys")
    out: dict[str, torch.Tensor] = {}
    for path, (a, b) in modules.items():
        r = a.shape[0]
        ratio = _scale(config, path, r) / s  # 1.0 unless patterns give this module its own scale
        a2 = torch.zeros((target, a.shape[1]), dtype=a.dtype)  # (r', D_in): extra rows are zero
        b2 = torch.zeros((b.shape[0], target), dtype=b.dtype)  # (D_out, r'): extra columns are zero
        a2[:r] = a
        b2[:, :r] = b if ratio == 1.0 else (b.double() * ratio).to(b.dtype)
        out[f"base_model.model.{path}.lora_A.weight"] = a2
        out[f"base_model.model.{path}.lora_B.weight"] = b2
    alpha = s * (math.sqrt(target) if config.get("use_rslora") else target)
    new = {**config, "r": target, "lora_alpha": int(alpha) if float(alpha).is_integer() else alpha,
           "rank_pattern": {}, "alpha_pattern": {}, "bias": "none", "modules_to_save": None, "use_dora": False,
           "target_modules": sorted({p.rsplit(".", 1)[-1] for p in modules})}
    return new, out, changes


def merge_adapter(model: torch.nn.Module, config: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
    """Fold the adapter into ``model`` in place: W += s·B·A (transposed for GPT-2's Conv1D, which stores W as
    (D_in, D_out)), then each variant's extra tensors of the module through its ``merge`` hook (DoRA: every output
    row rescaled to its magnitude, PEFT's merge); computed in fp32 and cast back to the weight's dtype.

    Raises:
        UserError: a module of the adapter is missing from the model or has another shape, or the checkpoint holds
            a variant's tensors the variant cannot merge.
    """
    from transformers.pytorch_utils import Conv1D

    extras: dict[str, list[tuple[Any, torch.Tensor]]] = {}  # module path -> [(variant, its tensor)]
    lora: dict[str, torch.Tensor] = {}
    for key, t in tensors.items():
        suffix = next((s for s in _EXTRA if key.endswith(s)), None)
        if suffix is None:
            lora[key] = t
        else:
            path = key.removeprefix("base_model.model.").removesuffix(suffix)
            extras.setdefault(path, []).append((_EXTRA[suffix], t))
    modules, _ = _modules(lora, "no variant of the pack merges it")
    with torch.no_grad():
        for path, (a, b) in modules.items():
            try:
                module = model.get_submodule(path)
            except AttributeError as err:
                raise UserError(f"export: the base model has no module {path!r}") from err
            w: torch.Tensor = module.weight  # type: ignore[assignment]
            delta = _scale(config, path, a.shape[0]) * (b.float() @ a.float())  # (D_out, D_in)
            conv1d = isinstance(module, Conv1D)
            if (delta := delta.T if conv1d else delta).shape != w.shape:  # Conv1D: (D_in, D_out), as W
                raise UserError(f"export: {path}: adapter gives {tuple(delta.shape)}, model has {tuple(w.shape)}")
            merged = (w.float() + delta.to(w.device)).T if conv1d else w.float() + delta.to(w.device)  # (D_out, D_in)
            for variant, extra in extras.get(path, ()):
                if variant.merge is None:
                    raise UserError(f"export: {path}: {variant.name}'s {variant.peft_key} cannot be merged")
                merged = variant.merge(merged, extra.float().to(w.device))
            w.copy_((merged.T if conv1d else merged).to(w.dtype))
