"""Shared-input groups: sibling projections that read the same input run as one call on the static step.

An attention block calls ``q_proj(x)``, ``k_proj(x)`` and ``v_proj(x)`` on one x, a gated MLP ``gate_proj(x)`` and
``up_proj(x)``. Run one by one, each runs its own base GEMM and writes its own dx, which autograd then adds up.
On the static step (``packer.model.static.StaticStore.group_forward``, every device) the members' base GEMMs run as one
over their weights, which ``lay_out_groups`` lays out adjacently (``SliceGroup.base_cat``), each member's LoRA term
as its own static call computes it (so with its own dropout mask, as PEFT draws one per projection) and the
backward writes one dx (``kernels.ops.packed_lora_static_group`` on the Triton path; one ``F.linear`` split by columns
on the torch path). The per-batch forwards evaluation falls back to (rows off the static shapes, sampled
generation, a pack without a static store) run each member alone, which is exact.

No model code is patched. The first member called computes every member's output on its x and keeps the
others'; a member called next with that same x (same object, not modified since) takes its output, and a
member called with any other input computes its own, so a model that calls its projections differently stays
correct and only pays for the outputs it did not use.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from lora_sweep.packer.model.layer import PackedLoRALinear

__all__ = ["SHARED_INPUT", "SliceGroup", "link_groups", "lay_out_groups"]

SHARED_INPUT: tuple[tuple[str, ...], ...] = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"), ("w1", "w3"))
"""Leaf names of sibling projections that read one input, in the order a group stacks them: Llama, Qwen2,
Mistral, Gemma attention and gated MLPs, and Mixtral's experts (w1, w3)."""


class SliceGroup:
    """Two or more ``PackedLoRALinear`` siblings of plain ``nn.Linear`` bases with the same input width.

    Args:
        members: the projections, in stacking order.
    """

    def __init__(self, members: list[PackedLoRALinear]) -> None:
        self.members = members
        self._x: torch.Tensor | None = None
        self._version = -1
        self._pending: dict[int, torch.Tensor] = {}
        self._base_cat: tuple[tuple, tuple[torch.Tensor, torch.Tensor | None] | None] | None = None
        """(the members' weight and bias addresses, ``base_cat``'s answer for them)."""

    def forget(self) -> None:
        """Drop the outputs kept for a member: a member's slots changed, so they may hold a removed slot's
        weights' graph, which must not outlive it here."""
        self._x, self._pending = None, {}

    def output(self, member: PackedLoRALinear, x: torch.Tensor,
               call: Callable[[SliceGroup, torch.Tensor], tuple[torch.Tensor, ...] | None]) -> torch.Tensor | None:
        """``member(x)`` from a group call, or None where the group does not apply (the member runs alone).

        Args:
            member: the projection called.
            x: (B, L, D_in) its input.
            call: computes every member's output on x, or None where the group does not apply (the static step's
                ``packer.model.static.StaticStore.group_forward``).
        """
        i = next(j for j, m in enumerate(self.members) if m is member)
        if x is self._x and x._version == self._version and i in self._pending:
            out = self._pending.pop(i)
            if not self._pending:
                self._x = None
            return out
        outs = call(self, x)
        if outs is None:
            return None
        self._pending = {j: y for j, y in enumerate(outs) if j != i}
        self._x, self._version = x, x._version
        return outs[i]

    def base_cat(self) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """The members' base weights as one (sum D_s, D_in) tensor and their biases as one (sum D_s,) (or None
        without biases): views of the memory ``lay_out_groups`` laid them out in, or None where they no longer are
        adjacent (the model was moved or its weights replaced since; the members then run alone)."""
        bases = [m.base for m in self.members]
        key = tuple((b.weight.data_ptr(), None if b.bias is None else b.bias.data_ptr()) for b in bases)
        if self._base_cat is None or self._base_cat[0] != key:
            w = _adjacent([b.weight for b in bases])
            biases = [b.bias for b in bases]
            b = None if all(t is None for t in biases) else _adjacent(biases)  # type: ignore[arg-type]
            ok = w is not None and (b is not None or all(t is None for t in biases))
            self._base_cat = (key, (w, b) if ok else None)  # type: ignore[assignment]
        return self._base_cat[1]


def link_groups(layers: dict[str, PackedLoRALinear]) -> list[SliceGroup]:
    """Group the wrapped projections of ``layers`` (path -> layer) that ``SHARED_INPUT`` names as siblings
    under one parent, where at least two are wrapped, all are plain ``nn.Linear`` and share D_in; set each
    layer's ``group`` (None for the rest). Idempotent: call it again after wrapping more projections.

    A quantised base (NF4's ``Linear4bit``) is not a plain ``nn.Linear``: its projections run alone."""
    found: dict[tuple[str, int], list[tuple[int, PackedLoRALinear]]] = {}
    for path, layer in layers.items():
        parent, _, leaf = path.rpartition(".")
        for k, names in enumerate(SHARED_INPUT):
            if leaf in names:
                found.setdefault((parent, k), []).append((names.index(leaf), layer))
    for layer in layers.values():
        layer.group = None
    groups = []
    for members in found.values():
        ms = [m for _, m in sorted(members, key=lambda p: p[0])]
        if len(ms) > 1 and all(type(m.base) is nn.Linear for m in ms) and len({m.in_features for m in ms}) == 1:
            group = SliceGroup(ms)
            for m in ms:
                m.group = group
            groups.append(group)
    return groups


def lay_out_groups(model: nn.Module) -> None:
    """Lay the base weights (and biases) of each set of ``SHARED_INPUT`` siblings out as adjacent rows of one tensor,
    each parameter a view of its rows, the values unchanged, so the static step runs a group's base GEMM as one
    (``SliceGroup.base_cat``). Siblings are plain ``nn.Linear`` modules (or ones a ``PackedLoRALinear`` wraps) of one
    input width under one parent. Done once as a pack is made (``PackedModel``), before anything measures memory: the
    copy allocates the group's weights once more, the old storage is freed after."""
    for module in model.modules():
        for names in SHARED_INPUT:
            found = [getattr(module, n, None) for n in names]
            bases = [m.base if isinstance(m, PackedLoRALinear) else m for m in found if m is not None]
            plain = all(type(b) is nn.Linear for b in bases)
            if len(bases) < 2 or not plain or len({b.in_features for b in bases}) > 1:
                continue
            _lay_out_adjacent([b.weight for b in bases])
            if all(b.bias is not None for b in bases):
                _lay_out_adjacent([b.bias for b in bases])


def _adjacent(parts: list[torch.Tensor]) -> torch.Tensor | None:
    """``torch.cat(parts)`` without a copy: a view of the memory they share when they are contiguous, of one dtype,
    and follow one another in it; else None."""
    first = parts[0]
    storage, off = first.untyped_storage(), first.storage_offset()
    for t in parts:
        if (not t.is_contiguous() or t.dtype != first.dtype or t.shape[1:] != first.shape[1:]
                or t.untyped_storage().data_ptr() != storage.data_ptr() or t.storage_offset() != off):
            return None
        off += t.numel()
    rows = sum(t.shape[0] for t in parts)
    return torch.empty(0, dtype=first.dtype, device=first.device).set_(storage, first.storage_offset(),
                                                                       (rows, *first.shape[1:]), first.stride())


@torch.no_grad()
def _lay_out_adjacent(params: list[nn.Parameter]) -> None:
    """Move the frozen ``params`` into one new buffer, one after another, each parameter a view of its part (no-op
    where they are already adjacent, or differ in dtype, device or trailing shape). Memory: the old storage is freed
    once nothing else holds it, so the group's weights are held once."""
    first = params[0]
    if _adjacent(list(params)) is not None or any(
            p.dtype != first.dtype or p.device != first.device or p.shape[1:] != first.shape[1:] for p in params):
        return
    cat = torch.cat([p.data for p in params])
    for p, part in zip(params, cat.split([p.shape[0] for p in params]), strict=True):
        p.data = part
