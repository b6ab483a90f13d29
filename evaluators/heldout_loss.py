"""Held-out loss and perplexity of every slot, all slots in one packed forward per batch.

The loss is training's: rows tokenized and prompt-masked by ``packer.data.rows.tokenize_rows`` with the study's
``max_length`` and ``train_on_prompt``, next-token cross-entropy from ``packer.loss.slot_losses``. A slot's
``eval_loss`` is the mean over all target tokens of the held-out set (sum of token losses / token count),
so it does not depend on the batch size; ``perplexity`` is ``exp(eval_loss)``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from lora_sweep.errors import ConfigError
from lora_sweep.evaluators._core import (
    EvalData,
    EvalResult,
    Evaluator,
    check_batched,
    check_format,
    make_options,
    pad_id,
    uses_batched,
)
from lora_sweep.evaluators.cost import EvalCost
from lora_sweep.packer.api import data as packer_data
from lora_sweep.packer.api import evaluation, supported

if TYPE_CHECKING:  # torch and the model are imported where an evaluation runs: a study file is checked without them
    from lora_sweep.packer.api import PackedModel

__all__ = ["HeldoutOptions", "heldout_loss", "HELDOUT_LOSS", "METRICS"]

METRICS = {"eval_loss": "minimize", "perplexity": "minimize"}


@dataclass(frozen=True)
class HeldoutOptions:
    """Options of the ``heldout_loss`` evaluator."""

    batch_size: int = 8
    """Held-out rows of one slot per forward segment: per-adapter, a forward holds ``batch_size`` rows of every scored
    slot; batched, ``batch_size`` rows of one slot per segment, as many segments as the pack has slots."""
    batched: bool | Literal["auto"] = "auto"
    """True: while the pack trains on the fixed-shape step, score all the slots' adapters together on its fixed
    shapes (``packer.step.eval_graph``: the scored (slot, item) rows packed into the fewest forwards of
    ``slots x batch_size`` rows, padded to a multiple of 16 tokens, one CUDA graph per shape on CUDA) when their logits
    fit ``packer.step.eval_graph.LOGITS_BYTES``; False: always the per-adapter path (forwards sized to the scored
    adapters' rows, run eagerly); auto: true on CUDA, false on the CPU (``evaluators._core.uses_batched``). The
    losses are the same either way."""
    ALIASES: ClassVar[dict[str, str]] = {"static_shapes": "batched"}

    def __post_init__(self) -> None:
        if not (isinstance(self.batch_size, int) and self.batch_size >= 1):
            raise ConfigError(f"batch_size: must be an integer >= 1 (got {self.batch_size!r})")
        check_batched(self.batched)


def heldout_loss(model: PackedModel, slots: Sequence[int], data: EvalData, **options: Any) -> EvalResult:
    """Mean next-token cross-entropy over the target tokens of the held-out rows, per slot.

    Args:
        model: the packed model holding the slots.
        slots: slots to score.
        data: held-out rows in a ``packer.data.rows`` format.
        **options: ``HeldoutOptions`` fields.

    Returns:
        ``eval_loss`` and ``perplexity`` per slot; ``per_item["eval_loss"]``: each row's mean token loss.

    Raises:
        ConfigError: unknown or invalid option.
        DataError: rows of the wrong format.
    """
    opts: HeldoutOptions = make_options(HeldoutOptions, options, "heldout_loss")
    check_format(data, supported.FORMATS, "heldout_loss")
    examples = packer_data.tokenize_rows(data.rows, data.fmt, data.tokenizer, max_length=data.max_length,
                                         train_on_prompt=data.train_on_prompt, source=data.source)
    per_item, counts = evaluation.row_losses(model, slots, examples, opts.batch_size, pad_id(data.tokenizer),
                                             batched=uses_batched(opts.batched, model) and bool(examples))
    result = EvalResult()
    for g, slot in enumerate(slots):
        loss_sum = sum(loss * n for loss, n in zip(per_item[g], counts[g], strict=True))
        mean = loss_sum / max(sum(counts[g]), 1.0)
        result.metrics[slot] = {"eval_loss": mean, "perplexity": math.exp(min(mean, 700.0))}
        result.per_item[slot] = {"eval_loss": per_item[g]}
    return result


def heldout_cost(opts: HeldoutOptions) -> EvalCost:
    """One forward per ``batch_size`` rows of each slot, no generated tokens."""
    return EvalCost(opts.batch_size, what="heldout_loss over {rows} rows")


HELDOUT_LOSS = Evaluator("heldout_loss", HeldoutOptions, heldout_loss, metrics=lambda opts: dict(METRICS),
                         reports="`eval_loss`, `perplexity`", cost=heldout_cost, curve="eval_loss")
"""The ``heldout_loss`` evaluator."""
