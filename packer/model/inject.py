"""Find a base model's target projections by leaf name and wrap them in ``PackedLoRALinear``.

PEFT's ``target_modules`` idea without its class tree: a target is a module's last name component
(``q_proj``, GPT-2's ``c_attn``); ``all-linear`` means every linear projection except the output
head. Works on any ``nn.Module`` made of ``nn.Linear`` or transformers' ``Conv1D``.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable

from torch import nn

from lora_sweep.errors import ConfigError
from lora_sweep.packer.loss import output_head
from lora_sweep.packer.model.layer import PackedLoRALinear, PackState
from lora_sweep.packer.model.quant import NF4Linear
from lora_sweep.packer.plan import ALL_LINEAR, adapter_param_count

__all__ = ["linear_shape", "projection_names", "resolve_targets", "inject", "all_linear_params"]


def _is_conv1d(module: nn.Module) -> bool:
    """Whether ``module`` is transformers' ``Conv1D``. Only a model built by transformers holds one, and building it
    imported the class: where transformers is not imported yet (a plan from the cache), nothing is one, and the
    check costs no import of transformers (a second of a cached plan)."""
    pytorch_utils = sys.modules.get("transformers.pytorch_utils")
    return pytorch_utils is not None and isinstance(module, pytorch_utils.Conv1D)


def linear_shape(module: nn.Module) -> tuple[int, int] | None:
    """(D_in, D_out) of a supported projection (wrapped in ``PackedLoRALinear`` or not), None for anything
    else. The planner counts adapter parameters after its probes have wrapped the model."""
    if isinstance(module, (PackedLoRALinear, nn.Linear, NF4Linear)):  # NF4Linear: a QLoRA base's (packer.model.quant)
        return module.in_features, module.out_features
    if _is_conv1d(module):  # GPT-2 stores weight as (D_in, D_out)
        return module.weight.shape[0], module.weight.shape[1]
    return None


def projection_names(model: nn.Module) -> dict[str, str]:
    """Full path -> leaf name of every adaptable projection, in module order (output head excluded)."""
    head = output_head(model)
    out: dict[str, str] = {}
    wrapped: set[str] = set()
    for path, module in model.named_modules():
        if isinstance(module, PackedLoRALinear):
            wrapped.add(f"{path}.base")
        elif path in wrapped or module is head or linear_shape(module) is None:
            continue
        out[path] = path.rsplit(".", 1)[-1]
    return out


def resolve_targets(model: nn.Module, targets: Iterable[str]) -> list[str]:
    """Full paths of the projections named by ``targets`` (leaf names or ``all-linear``), in module order.

    Raises:
        ConfigError: a target matches no projection; the message lists the names that exist.
    """
    projections = projection_names(model)
    leaves = set(projections.values())
    wanted = set(targets)
    if ALL_LINEAR in wanted:
        return list(projections)
    missing = sorted(wanted - leaves)
    if missing:
        others = sorted({p.rsplit(".", 1)[-1] for p, _ in model.named_modules() if p} - leaves)
        hint = f"; other modules, not adaptable: {', '.join(others[:20])}" if set(missing) & set(others) else ""
        raise ConfigError(
            f"targets: unknown target module {', '.join(repr(m) for m in missing)} for "
            f"{type(model).__name__}; its linear projections are: {', '.join(sorted(leaves)) or 'none'}{hint}"
        )
    return [p for p, leaf in projections.items() if leaf in wanted]


def inject(model: nn.Module, paths: Iterable[str], state: PackState,
           existing: dict[str, PackedLoRALinear]) -> dict[str, PackedLoRALinear]:
    """Wrap each projection in ``paths`` (once) and return all wrapped layers by path.

    Layer ids follow the model's module order, so they do not depend on which slot asked first.
    """
    order = {p: i for i, p in enumerate(projection_names(model))}
    for path in paths:
        if path in existing:
            continue
        parent_path, _, leaf = path.rpartition(".")
        parent = model.get_submodule(parent_path) if parent_path else model
        base = getattr(parent, leaf)
        if isinstance(base, PackedLoRALinear):  # wrapped by an earlier PackedModel over the same model
            base = base.base
        d_in, d_out = linear_shape(base)  # type: ignore[misc]
        layer = PackedLoRALinear(base, d_in, d_out, layer_id=order[path], state=state)
        setattr(parent, leaf, layer)
        existing[path] = layer
    return existing


def all_linear_params(model: nn.Module, rank: int) -> int:
    """Trainable parameters of a rank-``rank`` adapter on every linear projection of ``model`` (the
    widest slot a planner has to fit)."""
    shapes = [linear_shape(model.get_submodule(p)) for p in projection_names(model)]
    return adapter_param_count([s for s in shapes if s is not None], rank)

