"""Fixed-shape storage of a pack: every slot's adapter in preallocated buffers, per-step values in device tables.

A captured CUDA graph replays fixed kernels on fixed addresses. So that one graph serves every step of a shape
while slots finish, are pruned and are refilled, nothing a slot changes may be a shape, an address or a Python
value read by the step: it must be data in a buffer the step reads.

**Layout.** One fp32 buffer ``flat`` holds, layer by layer (every projection ``all-linear`` names, wrapped up
front so layer ids and offsets never move), that layer's A for all C slots, ``(C * RB, D_in)``, then its B^T,
``(C * RB, D_out)``; slot g owns rows ``g * RB : g * RB + r_g`` of each, RB the pack's rank bucket. ``grad``,
``exp_avg`` and ``exp_avg_sq`` have the same layout. Why this one:

- each layer's ``a_cat`` / ``bt_cat`` is a contiguous view of ``flat`` (the kernels' row-major operand, no
  gather or copy per step), and a per-layer leaf whose ``.grad`` is a view of ``grad``: the Triton kernels add
  the weight gradients into it in place (the torch path: autograd's AccumulateGrad does). A bf16 model's
  kernels read a bf16 copy of ``flat`` (``flat_op``), cast once as each step (or evaluation forward) starts;
- a slot's rows sit at fixed offsets, so a refill writes new weights into the same memory (no re-capture), and
  the slot's parameters that the rest of the packer sees (``PackedModel.slot_weights``, evaluation, saving) are
  views of those rows: ``(r_g, D)``, exactly the shapes of a slot trained alone;
- padding to the bucket is exact: rank rows ``r_g .. RB`` of A and B^T, and every row of a layer the slot does
  not target, start at zero and stay zero. Their outputs are ``x A_pad^T = 0``; their gradients are
  ``dB^T_pad = H_pad^T dY = 0`` and ``dA_pad = (s dY B_pad)^T X = 0`` (each has a zero factor), so AdamW sees
  g = 0 with m = v = 0 and moves nothing (weight decay of 0 is 0). A slot therefore trains as it would alone,
  and one segment table serves every layer: per slot its rank (0 for a free slot), scale, dropout p and seed;
- the optimizer walks only each slot's first ``r_g`` rows (``kernels.triton_adamw``), so its traffic follows the
  real ranks: a large bucket costs memory, not time.

**Per-step data** (``ShapeBuffers``): token ids, labels, attention mask, positions (restarting at every example
of a sample-packed row), the segment tables (ranks, scales, dropout p and seeds), each slot's loss weight
(gradient accumulation: its micro-batch's share of its optimizer step's target tokens), the optimizer table
(``kernels.triton_adamw.OPT_FIELDS``: decay, betas, bias corrections, step size, clip norm, whether the
gradient is kept for the next micro-batch, B's decay and step size at its LoRA+ learning rate) and the
ring-buffer row. The host writes them into pinned staging memory and copies them with two non-blocking copies
before each step (``packer.step.loop``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from lora_sweep.errors import ConfigError
from lora_sweep.kernels import ops
from lora_sweep.kernels.meta import rank_bucket_for
from lora_sweep.kernels.ops import SEG_FLT_COL, SEG_FLT_FIELDS, SEG_INT_FIELDS, SegmentMeta, resolve_impl, segment_meta
from lora_sweep.kernels.reference import dropout_keep_mask
from lora_sweep.packer.data.batch import IGNORE_INDEX
from lora_sweep.packer.loss import plain_output_head
from lora_sweep.packer.model.inject import inject, resolve_targets
from lora_sweep.packer.model.layer import PackedLoRALinear, PackState
from lora_sweep.packer.plan import ALL_LINEAR
from lora_sweep.packer.variants import SlotState, Variant
from lora_sweep.packer.variants.magnitude import Magnitudes, torch_term, triton_rescale

__all__ = ["SlotStore", "rank_bucket_for", "ShapeBuffers", "OPT_FIELDS", "SEG_INT", "SEG_FLT", "slot_losses",
           "head_losses", "fused_loss_head", "shift_targets"]

OPT_FIELDS = 11
"""Columns of the optimizer table, as ``kernels.triton_adamw.OPT_FIELDS``."""
SEG_INT, SEG_FLT = SEG_INT_FIELDS, SEG_FLT_FIELDS
"""Columns of the segment tables (``kernels.ops.SegInt`` / ``kernels.ops.SegFlt``: the one list of their names)."""


@dataclass
class ShapeBuffers:
    """Device buffers of one step shape (C slots x ``rows`` rows x ``seq_len`` positions), all views of two
    blocks (``ints``, ``floats``) that one copy each fills from the host.

    Attributes:
        ids, labels, mask: (B, L) int64, B = C * rows.
        pos: (B, L) int64 positions: 0.. per example of a sample-packed row, 0..L-1 on every other row.
        meta: the kernels' tables; ``meta.seg_int`` (C, SEG_INT) and ``meta.seg_flt`` (C, SEG_FLT) are views of the
            blocks, one ``kernels.ops.SegInt`` / ``SegFlt`` per slot.
        rank: (C,) int64 per-slot rank (0: free slot).
        ring_row: (1,) int64, the ring-buffer row this step writes.
        opt: (C, OPT_FIELDS) fp32 optimizer table.
        loss_w: (C,) fp32 factor of each slot's mean loss in the backward (1 without accumulation).
        slot_of: (C,) int64 slot whose adapter segment g applies on the torch path (the kernels read it as
            ``seg_int``'s ``rank_off``), or None: segment g is slot g (the training step). Evaluation shapes
            (``packer.step.eval_graph``) route any scored slot through any segment.
    """

    rows: int
    seq_len: int
    ints: torch.Tensor
    floats: torch.Tensor
    ids: torch.Tensor
    labels: torch.Tensor
    mask: torch.Tensor
    pos: torch.Tensor
    meta: SegmentMeta
    rank: torch.Tensor
    ring_row: torch.Tensor
    opt: torch.Tensor
    loss_w: torch.Tensor
    slot_of: torch.Tensor | None = None


class SlotStore:
    """Preallocated adapter storage and per-step tables of a pack (module docstring).

    Args:
        model: the frozen base (its projections are all wrapped here, once).
        state: the pack's shared ``PackState``.
        layers: the pack's wrapped layers by path (filled here).
        capacity: C, slots.
        rank_bucket: RB, rows per slot and layer; every slot's rank must be <= RB.
        device: where everything lives.
    """

    def __init__(self, model: nn.Module, state: PackState, layers: dict[str, PackedLoRALinear], capacity: int,
                 rank_bucket: int, device: torch.device) -> None:
        self.capacity, self.rank_bucket, self.device, self.state = capacity, rank_bucket, device, state
        self.paths = resolve_targets(model, (ALL_LINEAR,))
        inject(model, self.paths, state, layers)
        self.layers = {p: layers[p] for p in self.paths}
        self.path_of = {id(layer): p for p, layer in self.layers.items()}
        rows = capacity * rank_bucket
        offsets, off = {}, 0
        for p, layer in self.layers.items():
            offsets[p] = (off, off + rows * layer.in_features)
            off += rows * (layer.in_features + layer.out_features)
        self.flat, self.grad, self.exp_avg, self.exp_avg_sq = (torch.zeros(off, device=device) for _ in range(4))
        self.a: dict[str, nn.Parameter] = {}
        self.bt: dict[str, nn.Parameter] = {}
        segs = []
        for p, layer in self.layers.items():
            (oa, ob), d_in, d_out = offsets[p], layer.in_features, layer.out_features
            self.a[p] = self._leaf(oa, rows, d_in)
            self.bt[p] = self._leaf(ob, rows, d_out)
            segs += [(oa, d_in, 0), (ob, d_out, 1)]
        self.segs = torch.tensor(segs, dtype=torch.int64, device=device)  # (S, 3): offset, width, B^T (LoRA+'s lr)
        self._mag: Magnitudes | None = None
        self.states: dict[Variant, SlotState] = {}
        """Variant -> its per-slot buffers (``Variant.state``), made when the first slot of the variant arrives: a
        pack without one holds none."""
        self.active: frozenset[str] = frozenset()
        """Paths some live slot targets; the others run their base projection alone."""
        self.shape: ShapeBuffers | None = None
        """The shape of the step being run (set by the loop)."""
        self.dropout = False
        """Whether the step's kernels include the dropout branch (some live slot has p > 0)."""
        self.host_layout: ops.PackLayout | None = None
        """Per-slot dropout p and seeds of this step as Python values: only the eager torch path, which draws its
        masks with torch generators, reads them."""
        self.flat_op: torch.Tensor | None = None
        """``flat`` in the Triton kernels' operand dtype (``use_operands``), cast once per step, or None: the kernels
        then read (and cast) the fp32 masters, per layer call."""
        self.a_op: dict[str, torch.Tensor] = {}
        self.bt_op: dict[str, torch.Tensor] = {}
        self._slot_rows: dict[int, list[torch.Tensor]] = {}
        """Slot -> its rows of every leaf in the four buffers (``reset_slot``)."""

    def use_operands(self, act: torch.dtype) -> None:
        """Keep a copy of every layer's A and B^T in the dtype the Triton kernels' dots read them in for
        activations of ``act`` (bf16 for a bf16 model; nothing for fp32), refreshed by ``cast_operands`` as each
        step or evaluation forward enters ``stepping``. One cast of the whole buffer instead of one per layer call
        and direction (420 small casts a step in the SmolLM2-shaped pack of BENCHMARKS.md, 1.25 ms); the cast is
        the one the kernels made, so the same bits."""
        dtype = ops.lora_operand_dtype(act)
        if dtype == torch.float32:
            return
        self.flat_op = torch.zeros_like(self.flat, dtype=dtype)
        for p in self.paths:
            for leaf, views in ((self.a[p], self.a_op), (self.bt[p], self.bt_op)):
                off = (leaf.data.data_ptr() - self.flat.data_ptr()) // self.flat.element_size()
                views[p] = self.flat_op[off:off + leaf.numel()].view(leaf.shape)

    def cast_operands(self) -> None:
        """Refresh the operand copy from the fp32 weights (the optimizer or a refill changed them)."""
        if self.flat_op is not None:
            self.flat_op.copy_(self.flat)

    def _leaf(self, off: int, rows: int, d: int) -> nn.Parameter:
        leaf = nn.Parameter(self.flat[off:off + rows * d].view(rows, d))
        leaf.grad = self.grad[off:off + rows * d].view(rows, d)
        return leaf

    # -- slots --------------------------------------------------------------------------------
    def slot_rows(self, slot: int, path: str, rank: int) -> tuple[torch.Tensor, ...]:
        """(A (r, D_in), B^T (r, D_out), their gradient views) of ``slot`` in layer ``path``."""
        r0 = slot * self.rank_bucket
        a, bt = self.a[path], self.bt[path]
        return (a.data[r0:r0 + rank], bt.data[r0:r0 + rank], a.grad[r0:r0 + rank],  # type: ignore[index]
                bt.grad[r0:r0 + rank])  # type: ignore[index]

    def slot_moments(self, slot: int, path: str, rank: int) -> tuple[torch.Tensor, ...]:
        """AdamW's (exp_avg, exp_avg_sq) of ``slot``'s A (r, D_in), then of its B^T (r, D_out), in layer ``path``:
        views of the store's moment buffers."""
        r0 = slot * self.rank_bucket
        (_, _, m_a, v_a), (_, _, m_bt, v_bt) = self._views(self.a[path]), self._views(self.bt[path])
        return m_a[r0:r0 + rank], v_a[r0:r0 + rank], m_bt[r0:r0 + rank], v_bt[r0:r0 + rank]

    @property
    def mag(self) -> Magnitudes | None:
        """DoRA's per-slot magnitudes (``packer.variants.magnitude``; 16 B per output feature, slot and layer) once the
        store has held a DoRA slot, else None: the forward's rescale term reads them."""
        return self._mag

    def _add_state(self, variant: Variant) -> None:
        self.states[variant] = variant.state(self)  # type: ignore[misc]
        if variant.name == "dora":  # kept as an attribute: every layer call of the forward asks for it
            self._mag = self.states[variant]  # type: ignore[assignment]

    @property
    def variant_key(self) -> tuple[str, ...]:
        """Names of the variants whose buffers the store holds: each adds work to the step (a part of its key)."""
        return tuple(v.name for v in self.states)

    @torch.no_grad()
    def reset_slot(self, slot: int, variants: tuple[Variant, ...] = ()) -> None:
        """Zero the slot's rows (weights, gradients, moments) in every layer: a fresh slot starts from the zero
        padding the layout relies on. The buffers of ``variants`` (the slot's) are made if the store has none yet;
        the slot's share of every variant's buffers is reset, on for its own.

        One multi-tensor zero over views kept per slot: a ``zero_`` per view (4 buffers x 2 leaves x 210 layers
        of SmolLM2) took seconds of host time over a sweep, with the GPU idle at each refill."""
        if slot not in self._slot_rows:
            r0, r1 = slot * self.rank_bucket, (slot + 1) * self.rank_bucket
            self._slot_rows[slot] = [buf[r0:r1] for p in self.paths for leaf in (self.a[p], self.bt[p])
                                     for buf in self._views(leaf)]
        torch._foreach_zero_(self._slot_rows[slot])
        for variant in variants:
            if variant.state is not None and variant not in self.states:
                self._add_state(variant)
        for variant, state in self.states.items():
            state.reset_slot(slot, variant in variants)

    def _views(self, leaf: nn.Parameter) -> list[torch.Tensor]:
        """The leaf's rows in all four buffers (weights, gradients, exp_avg, exp_avg_sq)."""
        off = leaf.data.data_ptr() - self.flat.data_ptr()
        off //= self.flat.element_size()
        n = leaf.numel()
        return [buf[off:off + n].view(leaf.shape) for buf in (self.flat, self.grad, self.exp_avg, self.exp_avg_sq)]

    def copy_slot_from(self, other: SlotStore, slot: int, rank: int, paths: list[str]) -> None:
        """Move a live slot's weights and moments from ``other`` (a smaller bucket) into this store's rows."""
        for variant, state in other.states.items():
            if variant not in self.states:
                self._add_state(variant)
            self.states[variant].copy_slot_from(state, slot)
        with torch.no_grad():
            for p in paths:
                for leaf, old_leaf in ((self.a[p], other.a[p]), (self.bt[p], other.bt[p])):
                    new, old = self._views(leaf), other._views(old_leaf)
                    for n, o in zip(new, old, strict=True):
                        n[slot * self.rank_bucket:slot * self.rank_bucket + rank] = \
                            o[slot * other.rank_bucket:slot * other.rank_bucket + rank]

    # -- shapes -------------------------------------------------------------------------------
    def shape_buffers(self, rows: int, seq_len: int) -> ShapeBuffers:
        """Fresh device buffers for a (C x rows, seq_len) step; the kernels' tile maps are built here, once."""
        c, b = self.capacity, self.capacity * rows
        bl = b * seq_len
        n_int = 4 * bl + c * SEG_INT + c + 1
        ints = torch.zeros(n_int, dtype=torch.int64, device=self.device)
        floats = torch.zeros(c * (SEG_FLT + OPT_FIELDS + 1), dtype=torch.float32, device=self.device)
        base = segment_meta(c, rows, seq_len, self.rank_bucket, self.device, dropout=True)
        seg_int = ints[4 * bl:4 * bl + c * SEG_INT].view(c, SEG_INT)
        seg_flt = floats[:c * SEG_FLT].view(c, SEG_FLT)
        seg_int.copy_(base.seg_int)
        seg_flt.copy_(base.seg_flt)
        block = [ints[i * bl:(i + 1) * bl].view(b, seq_len) for i in range(4)]  # ids, labels, mask, pos
        opt_end = c * (SEG_FLT + OPT_FIELDS)
        return ShapeBuffers(rows, seq_len, ints, floats, *block, base._replace(seg_int=seg_int, seg_flt=seg_flt),
                            ints[4 * bl + c * SEG_INT:4 * bl + c * SEG_INT + c], ints[-1:],
                            floats[c * SEG_FLT:opt_end].view(c, OPT_FIELDS), floats[opt_end:])

    @contextlib.contextmanager
    def stepping(self, shape: ShapeBuffers, dropout: bool) -> Iterator[None]:
        """Route the wrapped layers through the step's tables while a step (or an evaluation forward on the same
        buffers) runs; first refresh the kernels' bf16 weight copy, so every forward reads the current weights."""
        self.cast_operands()
        self.shape, self.dropout = shape, dropout
        self.state.store = self
        try:
            yield
        finally:
            self.state.store = None

    # -- the layer call -----------------------------------------------------------------------
    def forward(self, layer: PackedLoRALinear, x: torch.Tensor) -> torch.Tensor:
        """``layer(x)`` for x (B, L, D_in): its base plus every slot's LoRA term, from the step's tables."""
        path = self.path_of[id(layer)]
        if path not in self.active:
            return layer.base(x)
        shape = self.shape
        assert shape is not None
        a, bt = self.a[path], self.bt[path]
        b, seq, d_in = x.shape
        if resolve_impl(self.state.impl, x.device) == "triton":
            meta = shape.meta._replace(layer_id=layer.layer_id, has_dropout=self.dropout)
            x2 = x.reshape(b * seq, d_in).contiguous()  # the kernels read row-major operands (no copy if dense)
            grads = (a.grad, bt.grad)  # the store's gradient views: the kernels add into them, no AccumulateGrad
            operands = None
            if self.flat_op is not None and x.dtype == self.flat_op.dtype:
                operands = (self.a_op[path], self.bt_op[path])
            dora = self.mag is not None and path in self.mag.wsq  # a pack that has held a DoRA slot
            # DoRA slots with dropout: the LoRA kernels and DoRA's base term read the same bits
            bits = ops.dropout_bits(meta, x2) if dora and self.dropout and self.mag.drop_slots else None
            if type(layer.base) is nn.Linear:
                y = ops.packed_lora(x2, None, layer.base.weight, layer.base.bias, a, bt, meta, grads, operands,
                                    bits)
            else:
                y = ops.packed_lora(x2, layer.base(x).reshape(b * seq, -1), None, None, a, bt, meta,
                                    grads, operands, bits)
            if dora:  # rescale the DoRA slots' columns (r = 1 for every other slot)
                c, rb = self.capacity, self.rank_bucket
                y = triton_rescale(self.mag, path, layer.base, x2, y, bits, meta, a.detach().view(c, rb, -1),
                                   bt.detach(), self.a_op.get(path))
            return y.view(b, seq, -1)
        masks = self._masks(layer, x) if self.dropout and self.host_layout is not None else None
        base_out, lora = layer.base(x), self._lora_term(layer, path, x, masks)
        if self.mag is None:  # a pack that has held a DoRA slot adds the term (zero for a plain slot), as above
            return base_out + lora
        c, rb, shape = self.capacity, self.rank_bucket, self.shape
        assert shape is not None
        return base_out + lora + torch_term(self.mag, path, layer.base, base_out, lora, x, masks, self.a[path].view(
            c, rb, -1), self.bt[path].view(c, rb, -1), shape.meta.seg_flt[:, SEG_FLT_COL.scale])

    def _masks(self, layer: PackedLoRALinear, x: torch.Tensor) -> torch.Tensor:
        """Every slot's dropout multiplier ``M / (1 - p)`` of this layer call on x (B, L, D_in): (B, L, D_in) fp32, ones
        on the rows of a slot without dropout. Drawn by ``dropout_keep_mask`` (torch's generator seeded by the slot's
        step and the layer, as the kernels seed theirs: the same distribution, not the Triton kernels' bits)."""
        lay, shape, (_, seq, d_in) = self.host_layout, self.shape, x.shape
        assert lay is not None and shape is not None
        return torch.cat([dropout_keep_mask(lay, g, layer.layer_id, d_in, seq, x.device) if lay.dropout[g] > 0
                          else torch.ones((shape.rows, seq, d_in), device=x.device) for g in range(self.capacity)])

    def _lora_term(self, layer: PackedLoRALinear, path: str, x: torch.Tensor,
                   masks: torch.Tensor | None) -> torch.Tensor:
        """The torch LoRA term of ``layer`` on x (B, L, D_in), its input dropped by ``masks`` (``_masks``, or None):
        (B, L, D_out). Slot g's rows meet only its own bucket's RB columns, in two batched products, scaled by its
        scale in the shape's segment table (a view: a captured graph reads the value each step writes; 0 for a free
        or unscored slot, which therefore adds nothing)."""
        a, bt, shape = self.a[path], self.bt[path], self.shape
        assert shape is not None
        xin, (_, seq, d_in) = x.to(a.dtype), x.shape
        if masks is not None:
            xin = xin * masks.to(xin.dtype)
        c, m, rb = self.capacity, shape.rows, self.rank_bucket
        scale = shape.meta.seg_flt[:, SEG_FLT_COL.scale, None, None]  # (C, 1, 1)
        a_seg, bt_seg = a.view(c, rb, d_in), bt.view(c, rb, -1)
        if shape.slot_of is not None:  # an evaluation shape: segment g applies slot ``slot_of[g]``'s adapter
            a_seg, bt_seg = a_seg.index_select(0, shape.slot_of), bt_seg.index_select(0, shape.slot_of)
        h = torch.bmm(xin.reshape(c, m * seq, d_in), a_seg.transpose(1, 2)) * scale  # (C, M * L, RB)
        return torch.bmm(h, bt_seg).view(c * m, seq, -1).to(x.dtype)  # (B, L, D_out)


def slot_losses(logits: torch.Tensor, labels: torch.Tensor, capacity: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-slot mean next-token cross-entropy of a fixed-shape batch (slot g owns a fixed block of rows).

    Args:
        logits: (B, L, V).
        labels: (B, L) unshifted, ``IGNORE_INDEX`` where no loss is taken (all of a padding row).
        capacity: C; B is a multiple of it.

    Returns:
        (C,) fp32 losses (0 for a slot without target tokens) and (C,) fp32 target counts.
    """
    b, seq, vocab = logits.shape
    shift = labels[:, 1:]
    ce = F.cross_entropy(logits[:, :-1].reshape(-1, vocab).float(), shift.reshape(-1), ignore_index=IGNORE_INDEX,
                         reduction="none")
    sums = ce.view(capacity, -1).sum(dim=1)
    counts = (shift != IGNORE_INDEX).view(capacity, -1).sum(dim=1).float()
    return sums / counts.clamp(min=1.0), counts


def shift_targets(labels: torch.Tensor) -> torch.Tensor:
    """(B * L,) int64 next-token targets of (B, L) unshifted labels: row b, position l predicts ``labels[b, l + 1]``;
    the last position of every row predicts nothing (``IGNORE_INDEX``)."""
    return F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX).reshape(-1)


def fused_loss_head(model: nn.Module) -> nn.Linear | None:
    """The frozen linear output head ``head_losses`` can take ``model``'s loss through, or None where the step
    must compute full logits (``slot_losses``): a model without a decoder body (``base_model``) or output head,
    one whose logits are not the head's output (``packer.loss.plain_output_head``, as ``PackedModel.output_head``), a
    head that is not a plain frozen ``nn.Linear``."""
    try:
        head = plain_output_head(model)
    except ConfigError:
        return None
    if getattr(model, "base_model", model) is model or not isinstance(head, nn.Linear):
        return None
    return None if any(p.requires_grad for p in head.parameters()) else head


def head_losses(hidden: torch.Tensor, head: nn.Linear, labels: torch.Tensor, capacity: int,
                       impl: str = "triton", chunk: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``slot_losses(head(hidden), labels, capacity)`` without materialising fp32 logits:
    ``kernels.ops.linear_ce`` (on the Triton path the logits exist only inside its forward, in the model's
    dtype).

    Args:
        hidden: (B, L, H) final hidden states (after the last norm); slot g owns rows ``g * B / C ..``.
        head: the frozen output projection (``fused_loss_head``).
        labels: (B, L) unshifted, ``IGNORE_INDEX`` where no loss is taken.
        capacity: C; B is a multiple of it.
        impl: as ``kernels.ops.linear_ce``.
        chunk: as ``kernels.ops.linear_ce``: logits of at most this many token rows at a time.

    Returns:
        (C,) fp32 losses (0 for a slot without target tokens) and (C,) fp32 target counts.
    """
    b, seq, h = hidden.shape
    return ops.linear_ce(hidden.reshape(b * seq, h), head.weight, head.bias, shift_targets(labels),
                                    capacity, impl=impl, chunk=chunk)  # type: ignore[arg-type]
