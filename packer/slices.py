"""Shared-input groups: sibling projections that read the same input run as one packed call.

An attention block calls ``q_proj(x)``, ``k_proj(x)`` and ``v_proj(x)`` on one x, a gated MLP ``gate_proj(x)`` and
``up_proj(x)``. Run one by one, each streams x through its own LoRA shrink and weight gradient and writes its own
dx, which autograd then adds up; ``kernels.packed_lora_linear_slices`` does each once for the group.

No model code is patched. The first member called computes every member's output on its x and keeps the
others'; a member called next with that same x (same object, not modified since) takes its output, and a
member called with any other input computes its own, so a model that calls its projections differently stays
correct and only pays for the outputs it did not use. The group runs where the pack is on the Triton kernels
and no slot adapting the group has LoRA dropout (PEFT draws a mask per projection; one pass over x cannot);
otherwise each member runs alone, as before.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import nn

from lora_sweep.kernels import LayerRanks, PackLayout, packed_lora_linear_slices, resolve_impl
from lora_sweep.packer.layer import PackedLoRALinear, stacked_leaf

__all__ = ["SHARED_INPUT", "SliceGroup", "link_groups"]

SHARED_INPUT: tuple[tuple[str, ...], ...] = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"), ("w1", "w3"))
"""Leaf names of sibling projections that read one input, in the order a group stacks them: Llama, Qwen2,
Mistral, Gemma attention and gated MLPs, and Mixtral's experts (w1, w3)."""


class _Stacked(NamedTuple):
    """A group's weights for one layout, cached until the slots change."""

    gathered: tuple
    """Each member's ``PackedLoRALinear.gathered`` for the layout (its B^T parts; the cache key)."""
    slices: tuple[LayerRanks, ...]
    a: list[torch.Tensor]
    """Every slot's A, slot by slot, slice by slice (``kernels.group_rows``)."""
    grad_a: list[torch.Tensor | None]
    rows: list[int]


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
        self._cache: _Stacked | None = None

    def forget(self) -> None:
        """Drop what the group holds (the stacked views of slot weights, outputs kept for a member): a
        member's slots changed. A removed slot's buffers must not outlive it here."""
        self._cache, self._x, self._pending = None, None, {}

    def output(self, member: PackedLoRALinear, x: torch.Tensor) -> torch.Tensor | None:
        """``member(x)`` from a group call, or None where the group does not apply (the member runs alone)."""
        i = next(j for j, m in enumerate(self.members) if m is member)
        if x is self._x and x._version == self._version and i in self._pending:
            out = self._pending.pop(i)
            if not self._pending:
                self._x = None
            return out
        outs = self._call(x)
        if outs is None:
            return None
        self._pending = {j: y for j, y in enumerate(outs) if j != i}
        self._x, self._version = x, x._version
        return outs[i]

    def applies(self, layout: PackLayout | None, device: torch.device) -> bool:
        """Whether a forward over ``layout`` runs as one group call."""
        state = self.members[0].state
        if layout is None or resolve_impl(state.impl, device) != "triton":
            return False
        ranks = [s.rank for s in self._stacked(layout.slots).slices]
        if any(not any(r) for r in ranks):  # a member no slot adapts: it is the plain base projection
            return False
        return not any(p > 0 and any(r[g] for r in ranks) for g, p in enumerate(layout.dropout))

    def _stacked(self, slots: tuple[int, ...]) -> _Stacked:
        gathered = tuple(m.gathered(slots) for m in self.members)  # cached per member; new after a slot change
        if self._cache is not None and all(a is b for a, b in zip(self._cache.gathered, gathered, strict=True)):
            return self._cache
        parts = [m.slot_weights(s) for s in slots for m in self.members if m.has_slot(s)]
        self._cache = _Stacked(gathered, tuple(g.ranks for g in gathered), [p.a for p in parts],
                               [p.grad_a for p in parts], [p.a.shape[0] for p in parts])
        return self._cache

    def _call(self, x: torch.Tensor) -> tuple[torch.Tensor, ...] | None:
        layout = self.members[0].state.layout
        if not self.applies(layout, x.device):
            return None
        st = self._stacked(layout.slots)  # type: ignore[union-attr]
        a_group = stacked_leaf(st.a, st.grad_a, st.rows)
        bt_cats = [stacked_leaf(g.bt, g.grad_bt, g.rows) for g in st.gathered]
        bases = [m.base for m in self.members]
        return packed_lora_linear_slices(x, tuple(b.weight for b in bases), tuple(b.bias for b in bases), a_group,
                                         tuple(bt_cats), layout, st.slices, impl="triton")  # type: ignore[arg-type]

    def kernel_probe(self, layout: PackLayout, rows: int, seq_len: int) -> tuple[tuple, Callable[[], None]] | None:
        """As ``PackedLoRALinear.kernel_probe``, for a group call; None where the group does not apply."""
        first = self.members[0]
        device = first.base.weight.device
        if not self.applies(layout, device):
            return None
        st = self._stacked(layout.slots)
        act, master = first.base.weight.dtype, st.a[0].dtype
        key = ("slices", tuple((m.in_features, m.out_features, m.base.bias is not None) for m in self.members), act,
               master, tuple(s.rank for s in st.slices))

        def run() -> None:  # the group call on placeholders
            x = torch.empty(rows, seq_len, first.in_features, dtype=act, device=device, requires_grad=True)
            a = torch.empty(sum(st.rows), first.in_features, dtype=master, device=device, requires_grad=True)
            bts = tuple(torch.empty(sum(s.rank), m.out_features, dtype=master, device=device, requires_grad=True)
                        for s, m in zip(st.slices, self.members, strict=True))
            with torch.enable_grad():
                ys = packed_lora_linear_slices(x, tuple(m.base.weight for m in self.members),
                                               tuple(m.base.bias for m in self.members), a, bts, layout, st.slices,
                                               impl="triton")
                torch.autograd.backward(ys, [torch.empty_like(y) for y in ys])

        return key, run


def link_groups(layers: dict[str, PackedLoRALinear]) -> list[SliceGroup]:
    """Group the wrapped projections of ``layers`` (path -> layer) that ``SHARED_INPUT`` names as siblings
    under one parent, where at least two are wrapped, all are plain ``nn.Linear`` and share D_in; set each
    layer's ``group`` (None for the rest). Idempotent: call it again after wrapping more projections."""
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
