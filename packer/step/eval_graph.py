"""Evaluation forwards on a pack's buffers: held-out losses and greedy decoding of all its adapters together.

While a pack trains on the fixed-shape step (``packer.step.loop``), every slot's adapter lives in the
pack's ``SlotStore`` (``PackedModel.store``). The evaluators the sweep runs at rungs, ``eval_every`` steps and slot
ends then use the same machinery as the training step instead of the per-adapter path: a batch of C segments x
``rows`` rows (segment k owns rows ``k * rows ..``) x a padded length. Which adapter a segment applies is data, not
shape: its row of the segment tables holds that slot's rank, scale and rank rows (``SegInt.rank_off``; the torch path
reads ``ShapeBuffers.slot_of``), and a segment no pair needs has rank 0 and scale 0 (the kernels skip it; the torch
path scales its term by 0). So the (slot, item) pairs of an evaluation are packed densely, ``rows`` items of one slot
per segment and C segments per forward (``plan``): scoring one finished slot costs its own rows, not every slot's, and
one shape serves every evaluation whichever slots it scores; on CUDA one captured graph per shape replays it
(``torch.cuda.CUDAGraph``, the PyTorch CUDA-graph recipe: static inputs, warm-up on a side stream). A pack that has
held a DoRA slot keeps segment k on slot k (its magnitudes are indexed by segment).

- ``row_losses``: per-(slot, item) mean next-token cross-entropy and target counts of held-out rows, right-padded
  to a fixed length (what ``packer.loss.slot_losses`` computes per row).
- ``greedy_decode``: every slot continues every prompt. The prompts are left-padded to a fixed width P, the
  KV cache is transformers' ``StaticCache`` of P + T positions, and the attention mask is a 4D additive mask
  the step computes on the device from a step counter (key k is visible to a query at cache index q when
  k <= q and k is not padding; a padding position sees itself, so no row is fully masked). The prefill (from
  prompt buffers the host fills per forward) and each decoding step (embed, the layers, the head, argmax, the next
  input written back) are one graph replay each. The device notes which rows have decoded EOS; every ``STOP_CHECK``
  steps the host asks whether all of a forward's rows have (one sync) and stops it there. The tokens of every forward
  are read once, after the last one, and cut at EOS / stop strings on the host exactly where the eager loop
  (``evaluators.generation``) would have stopped each row.

The host writes each forward's inputs and tables through pinned memory without waiting for the device, and reads the
results once per evaluation, so it queues the next forward while the device runs the last. Free rows (a segment with
fewer items than ``rows``, segments no pair needs) hold padding or a copy of a prompt and are dropped. Nothing here
changes the adapters, the optimizer state or the training graphs.
"""

from __future__ import annotations

import time
import warnings
import weakref
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np
import torch
import torch.nn.functional as F

from lora_sweep.kernels.ops import FREE_FLT, SEG_FLT_COL, SEG_INT_COL, resolve_impl, to_device_async
from lora_sweep.packer.data.batch import IGNORE_INDEX
from lora_sweep.packer.loss import output_head
from lora_sweep.packer.model.packed import PackedModel
from lora_sweep.packer.model.shard import is_sharded
from lora_sweep.packer.model.store import ShapeBuffers, SlotStore, fused_loss_head, head_losses
from lora_sweep.packer.step.capture import capture, capture_failure, precompile

__all__ = ["available", "heldout_fits", "row_losses", "greedy_decode", "generation_fits", "bucket", "plan", "Segment",
           "graphs",
           "EVAL_MULTIPLE", "LOGITS_BYTES", "HELDOUT_BYTES_PER_LOGIT"]

STOP_CHECK = 4
"""Decoding steps between the host's checks whether every row of a forward has decoded EOS (one sync each)."""
EVAL_MULTIPLE = 16
"""Padded lengths (held-out rows, prompt widths, cache lengths) are multiples of this: few shapes."""
LOGITS_BYTES = 2 << 30
"""Largest memory of one fixed-shape held-out forward's logits (C x rows x L x vocab x ``HELDOUT_BYTES_PER_LOGIT``): a
captured graph keeps its pool for the pack's life, and the fixed shape always holds every slot's rows, scored or
not. Larger shapes (many slots, long rows, a large vocabulary) take the per-adapter path, which holds the scored slots'
rows only."""
HELDOUT_BYTES_PER_LOGIT = {"triton": 2.5, "torch": 10.0}
"""Peak GPU memory of a fixed-shape held-out evaluation per logit, by how it takes the loss, measured on the H200
(``python -m lora_sweep.benchmarks.eval_memory``, 16 slots of SmolLM2's shape, 2-16 x 10^8 logits): the Triton path's
fused
loss head (``store.fused_loss_head``) keeps bf16 logits, 2.05-2.52 B (the most at the fewest logits); full logits
(the torch path, or a head the fused loss cannot take) are the bf16 logits, an fp32 copy and cross-entropy's fp32
intermediates, 9.96-10.04 B."""

_CACHES: weakref.WeakKeyDictionary[SlotStore, dict[tuple, Any]] = weakref.WeakKeyDictionary()
"""Per store: its evaluation shapes, caches and captured graphs (they die with the store)."""


def bucket(n: int, multiple: int = EVAL_MULTIPLE) -> int:
    return -(-max(n, 1) // multiple) * multiple


def available(pm: PackedModel) -> bool:
    """Whether the pack has a slot store whose fixed shapes evaluation can run on (``PackedModel.ensure_store``)."""
    return pm.store is not None


def heldout_fits(pm: PackedModel, rows: int, seq_len: int) -> bool:
    """Whether a (C x ``rows``, ``seq_len``) held-out forward's logits stay within ``LOGITS_BYTES`` on this
    pack's path (``HELDOUT_BYTES_PER_LOGIT``)."""
    store = pm.store
    if store is None:
        return False
    head = output_head(pm.model)
    vocab = getattr(getattr(head, "weight", None), "shape", (getattr(pm.model.config, "vocab_size", 0),))[0]
    fused = _triton(pm) and fused_loss_head(pm.model) is not None  # as row_losses chooses its loss
    per_logit = HELDOUT_BYTES_PER_LOGIT["triton" if fused else "torch"]
    return store.capacity * rows * seq_len * vocab * per_logit <= LOGITS_BYTES


def _cache(store: SlotStore) -> dict[tuple, Any]:
    return _CACHES.setdefault(store, {})


class Segment(NamedTuple):
    """One segment of an evaluation forward: rows ``seg * rows .. seg * rows + n`` hold items ``item0 .. item0 + n``
    under slot ``slot``'s adapter."""

    seg: int
    slot: int
    item0: int
    n: int


def plan(slots: Sequence[int], n_items: int, rows: int, capacity: int, remap: bool = True) -> list[list[Segment]]:
    """The forwards that score every item under every slot, each a list of at most ``capacity`` segments.

    ``remap``: each slot's items in pieces of ``rows``, slot by slot, packed into consecutive segments (the fewest
    forwards: ``ceil(len(slots) * ceil(n_items / rows) / capacity)``). Otherwise segment k holds slot k's items,
    ``rows`` of them per forward (a pack with DoRA slots, whose magnitudes the forward reads by segment).
    """
    starts = range(0, n_items, rows)
    if not remap:
        return [[Segment(g, g, i0, min(rows, n_items - i0)) for g in slots] for i0 in starts]
    pieces = [(slot, i0, min(rows, n_items - i0)) for slot in slots for i0 in starts]
    return [[Segment(k, *piece) for k, piece in enumerate(pieces[f:f + capacity])]
            for f in range(0, len(pieces), capacity)]


def _remaps(store: SlotStore) -> bool:
    """Whether a segment may apply any slot's adapter: not once the pack has held a DoRA slot (``plan``)."""
    return store.mag is None


def _buffers(store: SlotStore, rows: int, seq_len: int) -> ShapeBuffers:
    """The store's (C x rows, seq_len) evaluation buffers, made on first use (a graph reads their addresses)."""
    key = ("shape", rows, seq_len)
    cache = _cache(store)
    if key not in cache:
        shape = store.shape_buffers(rows, seq_len)
        shape.slot_of = torch.arange(store.capacity, device=shape.ints.device)
        cache[key] = shape
    return cache[key]


def _shape(pm: PackedModel, store: SlotStore, segments: Sequence[Segment], rows: int, seq_len: int) -> ShapeBuffers:
    """The (C x rows, seq_len) evaluation buffers, their tables set so that each of ``segments`` applies its slot's
    adapter and every other segment none (queued on the device without a host sync)."""
    shape = _buffers(store, rows, seq_len)
    c, rb = store.capacity, store.rank_bucket
    ints = torch.zeros((3, c), dtype=torch.int64)  # rank, rank_off, slot per segment
    flt = torch.tensor([FREE_FLT] * c, dtype=torch.float32)  # (C, SEG_FLT)
    ints[1] = torch.arange(c) * rb
    ints[2] = torch.arange(c)
    for s in segments:
        spec = pm.specs[s.slot]
        ints[:, s.seg] = torch.tensor([spec.rows, s.slot * rb, s.slot])  # a frozen correction's rows too
        flt[s.seg, SEG_FLT_COL.scale] = spec.scale
    ints, flt = to_device_async(ints, shape.ints.device), to_device_async(flt, shape.ints.device)
    shape.meta.seg_int[:, SEG_INT_COL.rank].copy_(ints[0])
    shape.meta.seg_int[:, SEG_INT_COL.rank_off].copy_(ints[1])
    shape.meta.seg_int[:, SEG_INT_COL.seed].zero_()
    shape.meta.seg_flt.copy_(flt)
    shape.rank.copy_(ints[0])
    assert shape.slot_of is not None
    shape.slot_of.copy_(ints[2])
    return shape


def _graph(pm: PackedModel, store: SlotStore, fn: Callable[[], None]) -> _Graph:
    """A new ``_Graph`` of ``fn``, counted among the store's (``graphs``)."""
    graph = _Graph(fn, _capturable(pm), _triton(pm))
    _cache(store).setdefault(("graphs",), []).append(graph)
    return graph


def graphs(pm: PackedModel) -> tuple[int, int]:
    """(evaluation graphs made, of which captured as CUDA graphs) for the pack's store: one held-out forward per
    (rows, seq_len), one prefill and one decoding step per (rows, width, new tokens), whichever slots are scored."""
    made = _cache(pm.store).get(("graphs",), []) if pm.store is not None else []
    return len(made), sum(1 for g in made if g.graph is not None)


def _to_device(host: np.ndarray, out: torch.Tensor) -> None:
    """Copy ``host`` into the device buffer ``out`` through pinned memory, without a host sync."""
    out.copy_(to_device_async(torch.from_numpy(host), out.device).view(out.shape))


def _triton(pm: PackedModel) -> bool:
    return resolve_impl(pm.state.impl, pm.device) == "triton"


def _forward(pm: PackedModel, store: SlotStore, shape: ShapeBuffers, body: bool = False, **kwargs: Any) -> Any:
    """``pm.model(**kwargs)`` (``body``: its decoder body, ``pm.model.base_model``, without the head) routed through
    the step's tables of ``shape``, every wrapped projection adapted (a slot's rows of a layer it does not target
    are zero, so this is exact for every slot)."""
    active = store.active
    store.active = frozenset(store.paths)
    try:
        with store.stepping(shape, False), torch.no_grad():
            return (pm.model.base_model if body else pm.model)(**kwargs)
    finally:
        store.active = active


def _capturable(pm: PackedModel) -> bool:
    """On CUDA, unless FSDP shards the base (``packer.model.shard``): its per-layer all-gathers allocate and free their
    buffers and run in Python hooks a replay would skip, and every rank must evaluate the same way (a capture
    failing on one rank alone would leave the others in a collective), so a sharded pack evaluates eagerly."""
    return pm.device.type == "cuda" and not is_sharded(pm.model)


class _Graph:
    """``fn`` captured as a CUDA graph on first use (after two warm-up runs on a side stream), eager on CPU or
    when capture fails (one warning). ``reset`` runs before the real work after a capture (warm-up and capture
    ran ``fn`` on the live buffers). ``triton``: ``fn`` launches the Triton kernels, compiled in parallel
    (``packer.step.capture.precompile``) before the warm-ups, which otherwise compile them one after another (a
    cold cache's cost to a sweep's evaluations)."""

    def __init__(self, fn: Callable[[], None], cuda: bool, triton: bool) -> None:
        self.fn, self.graph, self.cuda, self.triton = fn, None, cuda, triton
        self.capture_s = 0.0

    def ready(self) -> bool:
        """Capture if needed; True when a capture just ran (the caller restores its inputs)."""
        if not self.cuda or self.graph is not None:
            return False
        t0 = time.perf_counter()
        if self.triton:
            precompile(self.fn)  # its writes are those of a warm-up run: the capture's runs rewrite them
        try:
            self.graph = capture(self.fn).graph
        except Exception as err:  # any failure: eager from now on
            warnings.warn(f"evaluation CUDA graph capture failed, evaluating eagerly: {capture_failure(err)}",
                          stacklevel=3)
            self.cuda = False
        self.capture_s += time.perf_counter() - t0
        return True

    def __call__(self) -> None:
        if self.graph is not None:
            self.graph.replay()
        else:
            self.fn()


# -- held-out loss ----------------------------------------------------------------------------
def row_losses(pm: PackedModel, slots: Sequence[int], examples: Sequence[Any], rows: int, seq_len: int,
               pad_id: int) -> tuple[list[list[float]], list[list[float]]]:
    """Mean next-token loss and target count of every item under every slot, the pairs packed densely (``plan``).

    Args:
        pm: a pack training on the step (``available``).
        slots: slots to score.
        examples: the items (``input_ids``, ``labels``), each no longer than ``seq_len``.
        rows: rows per segment of the shape (the evaluator's batch size: one shape for every evaluation).
        seq_len: padded length (a multiple of ``EVAL_MULTIPLE`` covering the longest example).

    Returns:
        (means, counts): ``means[g][i]`` is slot ``slots[g]``'s mean loss on item i.
    """
    store = pm.store
    assert store is not None
    b = store.capacity * rows
    graph, out = _loss_graph(pm, store, rows, seq_len)
    results: list[tuple[list[Segment], torch.Tensor]] = []
    for segments in plan(slots, len(examples), rows, store.capacity, _remaps(store)):
        shape = _shape(pm, store, segments, rows, seq_len)
        host = np.empty((3, b, seq_len), dtype=np.int64)
        ids, labels, mask = host
        ids.fill(pad_id)
        labels.fill(IGNORE_INDEX)
        mask.fill(0)
        mask[:, 0] = 1  # a padding row attends to one token (no fully masked row)
        for s in segments:
            for i in range(s.n):
                ex, r = examples[s.item0 + i], s.seg * rows + i
                n = len(ex.input_ids)
                ids[r, :n], labels[r, :n], mask[r, :n] = ex.input_ids, ex.labels, 1
        _to_device(host.reshape(-1), shape.ints[:3 * b * seq_len])
        graph.ready()  # warm-up and capture ran on these same inputs: nothing to restore
        graph()
        results.append((segments, out.clone()))
    per = _per_item([(segs, v.tolist()) for segs, v in _read(results)], slots, len(examples), rows)
    return [[v[0] for v in p] for p in per], [[v[1] for v in p] for p in per]


def _loss_graph(pm: PackedModel, store: SlotStore, rows: int, seq_len: int) -> tuple[_Graph, torch.Tensor]:
    """The held-out forward of a (C x rows, seq_len) shape and its (B, 2) output (row mean loss, target count)."""
    cache = _cache(store)
    key = ("loss", rows, seq_len, store.mag is not None)  # the last: whether the forward has DoRA's rescale
    if key in cache:
        return cache[key]
    shape = _buffers(store, rows, seq_len)
    b = store.capacity * rows
    out = torch.zeros((b, 2), device=pm.device)
    head = fused_loss_head(pm.model) if _triton(pm) else None

    def fn() -> None:
        if head is not None:  # no fp32 logits: the fused forward, each row its own group (``capacity`` = B)
            hidden = _forward(pm, store, shape, body=True, input_ids=shape.ids, attention_mask=shape.mask,
                              use_cache=False).last_hidden_state
            out.copy_(torch.stack(head_losses(hidden, head, shape.labels, b), dim=1))
            return
        logits = _forward(pm, store, shape, input_ids=shape.ids, attention_mask=shape.mask, use_cache=False).logits
        shift = shape.labels[:, 1:]
        ce = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), shift.reshape(-1),
                             ignore_index=IGNORE_INDEX, reduction="none").view(b, seq_len - 1)
        counts = (shift != IGNORE_INDEX).sum(dim=1).float()
        out.copy_(torch.stack([ce.sum(dim=1) / counts.clamp(min=1.0), counts], dim=1))

    cache[key] = (_graph(pm, store, fn), out)
    return cache[key]


def _read(results: list[tuple[list[Segment], torch.Tensor]]) -> list[tuple[list[Segment], torch.Tensor]]:
    """The forwards' device outputs on the host, in one copy (one sync per evaluation, not per forward)."""
    if not results:
        return []
    host = torch.stack([v for _, v in results]).cpu()
    return [(segs, host[k]) for k, (segs, _) in enumerate(results)]


def _per_item(results: list[tuple[list[Segment], list]], slots: Sequence[int], n_items: int,
              rows: int) -> list[list[Any]]:
    """Per-row outputs of the forwards (row ``seg * rows + i`` of each) regrouped as ``[g][i]``: slot ``slots[g]``,
    item i."""
    index = {slot: g for g, slot in enumerate(slots)}
    per: list[list[Any]] = [[None] * n_items for _ in slots]
    for segments, values in results:
        for s in segments:
            for i in range(s.n):
                per[index[s.slot]][s.item0 + i] = values[s.seg * rows + i]
    return per


# -- greedy decoding --------------------------------------------------------------------------
class _Decoder:
    """Buffers, cache and captured step of greedy decoding for one (rows, P, T) shape."""

    def __init__(self, pm: PackedModel, store: SlotStore, shapes: tuple[ShapeBuffers, ShapeBuffers], width: int,
                 new_tokens: int, cache_kwarg: str) -> None:
        from transformers import StaticCache

        self.pm, self.store, self.width, self.new_tokens = pm, store, width, new_tokens
        self.prefill_shape, self.step_shape = shapes  # (C x rows, P) and (C x rows, 1)
        self.cache_kwarg = cache_kwarg
        b, dev = store.capacity * self.step_shape.rows, pm.device
        k = width + new_tokens
        self.k = k
        self.cache = StaticCache(config=pm.model.config, max_cache_len=k)
        self.dtype = next(pm.model.parameters()).dtype
        self.key_ok = torch.zeros((b, k), dtype=torch.bool, device=dev)  # not padding
        self.key_idx = torch.arange(k, device=dev)
        self.limit = torch.zeros((1,), dtype=torch.long, device=dev)  # cache index of the token being fed
        self.pos = torch.zeros((b, 1), dtype=torch.long, device=dev)
        self.tok = torch.zeros((b, 1), dtype=torch.long, device=dev)
        self.out = torch.zeros((b, new_tokens), dtype=torch.long, device=dev)
        self.ids = torch.zeros((b, width), dtype=torch.long, device=dev)  # the prompts, left-padded
        self.ids_mask = torch.zeros((b, width), dtype=torch.long, device=dev)
        self.live = torch.zeros((b,), dtype=torch.bool, device=dev)  # rows holding a (slot, prompt) pair
        self.eos = torch.full((1,), -1, dtype=torch.long, device=dev)  # -1: no EOS (never a token)
        self.done = torch.zeros((b,), dtype=torch.bool, device=dev)  # free, or has decoded EOS
        self.prefill_graph = _graph(pm, store, self._prefill)
        self.graph = _graph(pm, store, self._step)

    def _mask(self, q_idx: torch.Tensor) -> torch.Tensor:
        """(B, 1, Q, K) additive mask for queries at cache indices ``q_idx`` (Q,)."""
        seen = (self.key_idx[None, :] <= q_idx[:, None])[None] & self.key_ok[:, None, :]  # (B, Q, K)
        seen = seen | (self.key_idx[None, :] == q_idx[:, None])[None]
        neg = torch.finfo(self.dtype).min
        return torch.zeros(seen.shape, dtype=self.dtype, device=seen.device).masked_fill(~seen, neg)[:, None]

    def _logits(self, ids: torch.Tensor, positions: torch.Tensor, q_idx: torch.Tensor) -> torch.Tensor:
        shape = self.step_shape if ids.shape[1] == 1 else self.prefill_shape
        out = _forward(self.pm, self.store, shape, input_ids=ids, attention_mask=self._mask(q_idx),
                       position_ids=positions, use_cache=True, logits_to_keep=1, **{self.cache_kwarg: self.cache})
        return out.logits[:, -1].float()  # (B, V)

    def _step(self) -> None:
        """One decoding step on device buffers only: feed ``tok`` at cache index ``limit + 1``."""
        self.limit.add_(1)
        self.pos.add_(1)
        nxt = self._logits(self.tok, self.pos, self.limit).argmax(dim=-1, keepdim=True)  # (B, 1)
        self.tok.copy_(nxt)
        self.out.index_copy_(1, self.limit - (self.width - 1), nxt)
        self.done.logical_or_(nxt[:, 0] == self.eos)

    def _prefill(self) -> None:
        """The prompts in ``ids`` / ``ids_mask`` (B, P), on device buffers only: resets the cache, runs the prompt,
        sets the step's inputs. The same inputs give the same state however often it runs (capture runs it three
        times), so it is captured as a graph too: eagerly it is one host-bound forward per chunk of prompts."""
        self.cache.reset()
        self.key_ok.fill_(True)
        self.key_ok[:, :self.width] = self.ids_mask.bool()
        positions = (self.ids_mask.cumsum(-1) - 1).clamp(min=0)
        q_idx = torch.arange(self.width, device=self.ids.device)
        first = self._logits(self.ids, positions, q_idx).argmax(dim=-1, keepdim=True)
        self.tok.copy_(first)
        self.out[:, :1].copy_(first)
        self.done.copy_(~self.live | (first[:, 0] == self.eos))
        self.pos.copy_(positions[:, -1:])
        self.limit.fill_(self.width - 1)

    def prefill(self, ids: np.ndarray, mask: np.ndarray) -> None:
        """ids, mask: (B, P) left-padded prompts, copied into the prefill's buffers, then ``_prefill`` (replayed)."""
        _to_device(ids, self.ids)
        _to_device(mask, self.ids_mask)
        self.prefill_graph.ready()  # a capture ran the prefill on these inputs: running it again is the same
        self.prefill_graph()

    def run(self, ids: np.ndarray, mask: np.ndarray, live: np.ndarray, eos_id: int | None) -> torch.Tensor:
        """Decode up to ``new_tokens`` after the (B, P) prompts of the ``live`` (B,) rows; returns a (B, T) device copy
        of the tokens. With ``eos_id``, every ``STOP_CHECK`` steps the host asks whether every live row has decoded
        it (one sync) and stops there: a row's tokens after its EOS, which the caller cuts, are then stale."""
        _to_device(live, self.live)
        self.eos.fill_(-1 if eos_id is None else eos_id)
        self.prefill(ids, mask)
        if self.new_tokens > 1 and self.graph.ready():
            self.prefill_graph()  # the warm-up and capture decoded from this prefill: start it again
        for t in range(1, self.new_tokens):
            if eos_id is not None and t % STOP_CHECK == 0 and bool(self.done.all()):
                break
            self.graph()
        return self.out.clone()


def greedy_decode(pm: PackedModel, slots: Sequence[int], prompts: Sequence[Sequence[int]], rows: int, width: int,
                  new_tokens: int, pad_id: int, cache_kwarg: str, eos_id: int | None = None) -> list[list[list[int]]]:
    """``new_tokens`` greedy tokens after every prompt under every slot, the pairs packed densely (``plan``).

    Args:
        pm: a pack training on the step (``available``).
        slots: slots that answer every prompt.
        prompts: prompts (token ids), none longer than ``width``.
        rows: prompts per segment of the shape (one shape for every evaluation).
        width: P, the prompts' padded width (a multiple of ``EVAL_MULTIPLE``).
        new_tokens: T, tokens decoded (the caller cuts each answer at EOS or a stop string).
        pad_id: left-padding id.
        cache_kwarg: the model's KV-cache argument name (``cache`` or ``past_key_values``).
        eos_id: the token that ends an answer, or None; a forward whose rows have all decoded it stops early.

    Returns:
        ``tokens[g][i]``: T tokens, slot ``slots[g]``'s continuation of prompt i, exact up to its first ``eos_id``
        (the caller cuts there; after it, stale tokens where the forward stopped early).
    """
    store = pm.store
    assert store is not None and len(prompts) > 0 and new_tokens >= 1
    b = store.capacity * rows
    results: list[tuple[list[Segment], torch.Tensor]] = []
    for segments in plan(slots, len(prompts), rows, store.capacity, _remaps(store)):
        shapes = _shape(pm, store, segments, rows, width), _shape(pm, store, segments, rows, 1)
        cache = _cache(store)
        key = ("decode", rows, width, new_tokens, store.mag is not None)
        if key not in cache:
            cache[key] = _Decoder(pm, store, shapes, width, new_tokens, cache_kwarg)
        ids = np.full((b, width), pad_id, dtype=np.int64)
        mask = np.zeros((b, width), dtype=np.int64)
        live = np.zeros((b,), dtype=np.bool_)
        fill = {s.seg: s for s in segments}
        for k in range(store.capacity):
            s = fill.get(k)
            for i in range(rows):  # free rows decode a copy of their segment's (or the first) prompt
                p = prompts[s.item0 + (i if i < s.n else 0)] if s is not None else prompts[0]
                ids[k * rows + i, width - len(p):], mask[k * rows + i, width - len(p):] = p, 1
                live[k * rows + i] = s is not None and i < s.n
        results.append((segments, cache[key].run(ids, mask, live, eos_id)))
    return _per_item([(segs, v.tolist()) for segs, v in _read(results)], slots, len(prompts), rows)


def generation_fits(pm: PackedModel, width: int, new_tokens: int) -> bool:
    """Whether one 4D mask serves every layer: no sliding-window attention shorter than the cache, and no ALiBi
    position bias (Bloom, and Falcon with ``alibi``), which the model builds from a 2D padding mask itself."""
    config = getattr(pm.model, "config", None)
    if config is None or config.model_type == "bloom" or getattr(config, "alibi", False):
        return False
    window = getattr(config, "sliding_window", None)
    return not window or width + new_tokens <= window
