"""Multiple choice by log-likelihood, lm-eval's convention, every slot in one packed forward per batch.

For a row ``{"prompt", "choices", "label"}`` the context is the prompt and the continuation of choice c is
``" " + c`` (lm-eval's ``target_delimiter``). Pairs are tokenized as lm-eval's ``_encode_pair`` does for a
causal model: trailing whitespace of the context moves to the continuation, ``whole = encode(context +
continuation)``, ``ctx = encode(context)``, continuation tokens ``whole[len(ctx):]``, with the tokenizer's
default special tokens (BOS on the context where the tokenizer adds one, as HFLM's ``tok_encode``). A
choice's score is the sum of its continuation tokens' log-probabilities. ``mc_acc``: the highest score is
the label; ``mc_acc_norm``: the same after dividing each score by the choice's length in characters (lm-eval
``acc_norm``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from lora_sweep.errors import ConfigError
from lora_sweep.evaluators._core import (
    MC_FORMAT,
    EvalData,
    EvalResult,
    Evaluator,
    check_format,
    chunks,
    make_options,
    pad_id,
    slot_layout,
)

if TYPE_CHECKING:  # torch and the model are imported where an evaluation runs: a study file is checked without them
    from lora_sweep.packer.api import PackedModel

__all__ = ["ChoiceOptions", "multiple_choice", "MULTIPLE_CHOICE", "choice_logprobs", "encode_pair", "METRICS"]

METRICS = {"mc_acc": "maximize", "mc_acc_norm": "maximize"}


@dataclass(frozen=True)
class ChoiceOptions:
    """Options of the ``multiple_choice`` evaluator."""

    batch_size: int = 16
    """(item, choice) pairs per slot in one forward."""
    delimiter: str = " "
    """Put between the prompt and each choice (lm-eval ``target_delimiter``)."""

    def __post_init__(self) -> None:
        if not (isinstance(self.batch_size, int) and self.batch_size >= 1):
            raise ConfigError(f"batch_size: must be an integer >= 1 (got {self.batch_size!r})")
        if not isinstance(self.delimiter, str):
            raise ConfigError(f"delimiter: must be a string (got {self.delimiter!r})")


def multiple_choice(model: PackedModel, slots: Sequence[int], data: EvalData, **options: Any) -> EvalResult:
    """Score every slot on multiple-choice rows ``{"prompt", "choices", "label"}``.

    Returns:
        ``mc_acc`` and ``mc_acc_norm`` per slot; per-item 0/1 values; samples with each choice's log-likelihood.
    """
    opts: ChoiceOptions = make_options(ChoiceOptions, options, "multiple_choice")
    check_format(data, (MC_FORMAT,), "multiple_choice")
    contexts = [row["prompt"] for row in data.rows]
    choices = [row["choices"] for row in data.rows]
    lls = choice_logprobs(model, slots, contexts, choices, data.tokenizer, delimiter=opts.delimiter,
                          batch_size=opts.batch_size)
    result = EvalResult()
    for slot in slots:
        acc, acc_norm, samples = [], [], []
        for row, scores in zip(data.rows, lls[slot], strict=True):
            pred = _argmax(scores)
            pred_norm = _argmax([s / len(c) for s, c in zip(scores, row["choices"], strict=True)])
            acc.append(float(pred == row["label"]))
            acc_norm.append(float(pred_norm == row["label"]))
            samples.append({"prompt": row["prompt"], "loglikelihoods": scores, "label": row["label"], "pred": pred,
                            "mc_acc": acc[-1], "mc_acc_norm": acc_norm[-1]})
        result.metrics[slot] = {"mc_acc": sum(acc) / len(acc), "mc_acc_norm": sum(acc_norm) / len(acc_norm)}
        result.per_item[slot] = {"mc_acc": acc, "mc_acc_norm": acc_norm}
        result.samples[slot] = samples
    return result


MULTIPLE_CHOICE = Evaluator("multiple_choice", ChoiceOptions, multiple_choice, metrics=lambda opts: dict(METRICS),
                            reports="`mc_acc`, `mc_acc_norm`")
"""The ``multiple_choice`` evaluator."""


def _argmax(values: Sequence[float]) -> int:
    """Index of the first maximum (``numpy.argmax``'s tie rule, which lm-eval uses)."""
    return max(range(len(values)), key=lambda i: (values[i], -i))


def encode_pair(tokenizer: Any, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """(context ids, continuation ids) as lm-eval's ``_encode_pair`` + HFLM ``tok_encode`` make them.

    An empty context becomes the BOS token (EOS if there is no BOS), lm-eval's ``prefix_token_id``.
    """
    if not context:
        prefix = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
        cont = tokenizer.encode(continuation, add_special_tokens=False)
        return ([prefix], cont) if cont[:1] != [prefix] else (cont[:1], cont[1:])
    n_spaces = len(context) - len(context.rstrip())
    if n_spaces:
        context, continuation = context[:-n_spaces], context[-n_spaces:] + continuation
    whole = tokenizer.encode(context + continuation)
    ctx = tokenizer.encode(context)
    return ctx, whole[len(ctx):]


def choice_logprobs(model: PackedModel, slots: Sequence[int], contexts: Sequence[str],
                    choices: Sequence[Sequence[str]], tokenizer: Any, *, delimiter: str = " ",
                    batch_size: int = 16) -> dict[int, list[list[float]]]:
    """Sum of continuation log-probabilities of every choice of every item, for every slot.

    Args:
        model: the packed model holding the slots.
        slots: slots to score.
        contexts: one context string per item.
        choices: the choice strings of each item.
        tokenizer: the base model's tokenizer.
        delimiter: put between context and choice.
        batch_size: (item, choice) pairs per slot in one forward.

    Returns:
        slot -> item -> one log-likelihood per choice.
    """
    import torch

    pairs = [(i, encode_pair(tokenizer, ctx, delimiter + c)) for i, ctx in enumerate(contexts) for c in choices[i]]
    flat: dict[int, list[float]] = {slot: [] for slot in slots}
    with torch.no_grad():
        for idx in chunks(len(pairs), batch_size):
            batch_pairs = [pairs[k][1] for k in idx]
            scores = _score_batch(model, slots, batch_pairs, pad_id(tokenizer))  # (N, n)
            for g, slot in enumerate(slots):
                flat[slot].extend(scores[g])
    out: dict[int, list[list[float]]] = {}
    for slot in slots:
        per_item: list[list[float]] = [[] for _ in contexts]
        for (item, _), score in zip(pairs, flat[slot], strict=True):
            per_item[item].append(score)
        out[slot] = per_item
    return out


def _score_batch(model: PackedModel, slots: Sequence[int], pairs: list[tuple[list[int], list[int]]],
                 pad: int) -> list[list[float]]:
    """Log-likelihood of each pair's continuation under each slot; rows right-padded, slot-major."""
    import torch

    inputs = [(ctx + cont)[:-1] for ctx, cont in pairs]  # the last token is only ever a target
    width = max(len(x) for x in inputs)
    n = len(pairs)
    ids = torch.tensor([x + [pad] * (width - len(x)) for x in inputs] * len(slots), device=model.device)  # (B, W)
    mask = (torch.arange(width) < torch.tensor([len(x) for x in inputs])[:, None]).long().repeat(len(slots), 1)
    logits = model.forward(ids, mask.to(model.device), slot_layout(slots, n, width))  # (B, W, V)
    sums = []
    for g in range(len(slots)):
        for k, (ctx, cont) in enumerate(pairs):
            rows = logits[g * n + k, len(ctx) - 1:len(ctx) - 1 + len(cont)].float()  # (C, V): predict cont
            tok = torch.tensor(cont, device=rows.device)[:, None]  # (C, 1)
            sums.append(torch.log_softmax(rows, dim=-1).gather(1, tok).sum())
    flat = torch.stack(sums).tolist()  # one device sync per batch
    return [flat[g * n:(g + 1) * n] for g in range(len(slots))]
