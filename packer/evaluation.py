"""The packer's evaluation: every item's loss under every slot, and greedy decoding, on the training pack's fixed
shapes where they serve (``packer.step.eval_graph``), else per adapter.

What an evaluator asks of the packer (``packer.api.evaluation``); the evaluator keeps the metric. This module imports
no torch: each function imports the step's modules when it runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lora_sweep.kernels.meta import PackLayout
    from lora_sweep.packer.data.batch import PackBatch
    from lora_sweep.packer.model.packed import PackedModel

__all__ = ["row_losses", "greedy_decode"]


def row_losses(pm: PackedModel, slots: Sequence[int], examples: Sequence[Any], batch_size: int, pad_id: int, *,
               batched: bool) -> tuple[list[list[float]], list[list[float]]]:
    """Each item's mean token loss and target count under each slot: ``[g][i]`` for slot ``slots[g]``, item i.

    Args:
        pm: the packed model holding the slots.
        slots: the slots to score.
        examples: tokenized rows (``packer.data.rows.Example``), labels ``IGNORE_INDEX`` where not scored.
        batch_size: items of each slot per forward.
        pad_id: padding token id.
        batched: every slot's rows in the fewest forwards on the pack's fixed shapes
            (``packer.step.eval_graph.row_losses``) when the pack has them and the logits fit
            (``eval_graph.heldout_fits``); else, and when False, ``batch_size`` items of every slot per forward,
            rows sized to the scored adapters. Both give the same numbers.
    """
    from lora_sweep.packer.step import eval_graph

    seq = eval_graph.bucket(max((len(e.input_ids) for e in examples), default=1))
    if batched and bool(examples) and eval_graph.available(pm) and eval_graph.heldout_fits(pm, batch_size, seq):
        return eval_graph.row_losses(pm, slots, examples, batch_size, seq, pad_id)
    return _per_adapter(pm, slots, examples, batch_size, pad_id)


def greedy_decode(pm: PackedModel, slots: Sequence[int], prompts: Sequence[Sequence[int]], batch_size: int,
                  max_new_tokens: int, pad_id: int, cache_kwarg: str,
                  eos_id: int | None = None) -> list[list[list[int]]] | None:
    """``max_new_tokens`` greedy tokens after every prompt under every slot (``[g][i]``), decoded together on the
    pack's fixed shapes (``packer.step.eval_graph.greedy_decode``); None where those do not serve (no slot store, no
    prompt, or a mask one 4D mask cannot hold: ``eval_graph.generation_fits``): the caller then decodes per
    adapter."""
    from lora_sweep.packer.step import eval_graph

    if not prompts or not eval_graph.available(pm):
        return None
    width = eval_graph.bucket(max(len(p) for p in prompts))
    if not eval_graph.generation_fits(pm, width, max_new_tokens):
        return None
    return eval_graph.greedy_decode(pm, slots, prompts, batch_size, width, max_new_tokens, pad_id, cache_kwarg, eos_id)


def _per_adapter(pm: PackedModel, slots: Sequence[int], examples: Sequence[Any], batch_size: int,
                 pad: int) -> tuple[list[list[float]], list[list[float]]]:
    """``row_losses`` per adapter: ``batch_size`` items of every scored slot per forward (rows sized to the scored
    adapters)."""
    import torch

    from lora_sweep.packer.data.batch import collate
    from lora_sweep.packer.loss import slot_losses

    n = len(slots)
    losses: list[list[float]] = [[] for _ in slots]
    counts: list[list[float]] = [[] for _ in slots]
    with torch.no_grad():
        for start in range(0, len(examples), batch_size):
            rows: list[Any] = list(examples[start:start + batch_size])  # Example satisfies packer.data.batch.Row
            batch = collate(slots, [rows] * n, pad, dropout=[0.0] * n, seeds=[0] * n, device=pm.device)
            logits = pm.forward(batch.input_ids, batch.attention_mask, batch.layout)  # (B, L, V)
            means, tokens = slot_losses(logits, batch.labels, _one_segment_per_row(batch))  # (B,), (B,)
            row_loss, row_tokens = means.tolist(), tokens.tolist()
            for g, first in enumerate(batch.layout.row_start):
                losses[g] += row_loss[first:first + len(rows)]
                counts[g] += row_tokens[first:first + len(rows)]
    return losses, counts


def _one_segment_per_row(batch: PackBatch) -> PackLayout:
    """The layout that makes ``slot_losses`` see the batch as one segment per row: it returns per-row means and counts.

    A slot's mean over the whole set is then sum(row mean * row count) / sum(row count): exactly
    ``slot_losses`` over all its rows at once.
    """
    from lora_sweep.kernels.meta import PackLayout

    b = batch.input_ids.shape[0]
    return PackLayout(slots=tuple(range(b)), row_start=tuple(range(b)), n_rows=(1,) * b, own_len=(0,) * b,
                      dropout=(0.0,) * b, seed=(0,) * b)
