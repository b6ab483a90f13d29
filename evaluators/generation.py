"""Generation with a KV cache for many adapters at once, and the generation evaluator.

Every slot answers every prompt: a batch holds ``batch_size`` prompts repeated once per slot, rows grouped
by slot (``kernels.ops.PackLayout``), so one forward per decoding step runs every adapter on its own rows.
Prompts are left-padded; position ids count real tokens only (``cumsum(mask) - 1``, what transformers'
``generate`` derives from the attention mask), so a padded row decodes exactly as it would alone. Rows
never leave the batch (a finished row keeps decoding into the void), so one layout is valid for the
prefill and every ``(B, 1)`` step.

That is the per-adapter path: each batch is sized to the scored adapters' rows. With ``batched`` on, while the
pack trains on the fixed-shape step (``PackedModel.store``), greedy decoding of all the scored adapters runs on its
fixed shapes instead (``packer.step.eval_graph``: every (slot, prompt) row packed into the fewest batches whichever
slots are scored, prompts left-padded to a multiple of 16, a static KV cache, the prefill and each decoding step one
CUDA-graph replay, the tokens read once per evaluation and cut where this loop would stop each row): the same tokens.

Prompts are the training prompts: the rows go through ``packer.data.rows.tokenize_rows`` and the prompt is every
token before the last response span (alpaca template, ``prompt``, or the chat template up to the last
assistant turn with ``add_generation_prompt``), so the model sees at evaluation what it saw in training.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from lora_sweep.errors import ConfigError, DataError
from lora_sweep.evaluators._core import (
    TEXT_FORMATS,
    Batched,
    EvalData,
    EvalResult,
    Evaluator,
    check_batched,
    check_format,
    chunks,
    make_options,
    pad_id,
    routed,
    slot_layout,
    uses_batched,
)
from lora_sweep.evaluators.cost import EvalCost
from lora_sweep.evaluators.scorers import SCORERS
from lora_sweep.packer.api import data as packer_data
from lora_sweep.packer.api import evaluation

if TYPE_CHECKING:  # torch and the model are imported where an evaluation runs: a study file is checked without them
    import torch

    from lora_sweep.packer.api import PackedModel

__all__ = ["GenerationOptions", "generation", "GENERATION", "generate_ids", "generate_texts", "build_prompts",
           "references", "METRICS", "generation_cost"]

METRICS = {name: "maximize" for name in SCORERS}


@dataclass(frozen=True)
class GenerationOptions:
    """Options of the ``generation`` evaluator."""

    max_new_tokens: int = 32
    """Tokens generated at most per answer (EOS ends an answer earlier)."""
    batch_size: int = 8
    """Prompts of one slot per batch segment: per-adapter, a batch holds ``batch_size`` prompts of every slot;
    batched, ``batch_size`` prompts of one slot per segment, as many segments as the pack has slots."""
    stop: tuple[str, ...] = ()
    """Strings that end an answer; the answer is cut before the first one (lm-eval's ``until``)."""
    scorers: tuple[str, ...] = ("exact_match",)
    """Metrics to report, names of ``evaluators.scorers.SCORERS``."""
    temperature: float = 0.0
    """0: greedy. Above 0: sampling, each item with its own generator seeded by ``seed`` and its index."""
    seed: int = 0
    """Seed of sampling."""
    batched: bool | Literal["auto"] = "auto"
    """True: greedy decoding while the pack trains on the fixed-shape step scores all the slots' adapters together on
    its fixed shapes (``packer.step.eval_graph``: the (slot, prompt) rows packed into the fewest batches, a static KV
    cache, the prefill and each decoding step replayed as CUDA graphs, one per shape); False: always the per-adapter
    path (batches sized to the scored adapters' rows, run eagerly); auto: true on CUDA, false on the CPU
    (``evaluators._core.uses_batched``). The tokens are the same either way."""
    ALIASES: ClassVar[dict[str, str]] = {"static_shapes": "batched"}

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop", _strings(self.stop, "stop"))
        object.__setattr__(self, "scorers", _strings(self.scorers, "scorers"))
        for key in ("max_new_tokens", "batch_size"):
            value = getattr(self, key)
            if not (isinstance(value, int) and value >= 1):
                raise ConfigError(f"{key}: must be an integer >= 1 (got {value!r})")
        unknown = [s for s in self.scorers if s not in SCORERS]
        if unknown or not self.scorers:
            raise ConfigError(f"scorers: unknown metric {unknown[0] if unknown else None!r} "
                              f"(expected some of: {', '.join(SCORERS)})")
        if not (isinstance(self.temperature, int | float) and self.temperature >= 0):
            raise ConfigError(f"temperature: must be >= 0 (got {self.temperature!r})")
        check_batched(self.batched)


def _strings(value: object, key: str) -> tuple[str, ...]:
    items = (value,) if isinstance(value, str) else value
    if not (isinstance(items, list | tuple) and all(isinstance(s, str) and s for s in items)):
        raise ConfigError(f"{key}: must be a list of non-empty strings (got {value!r})")
    return tuple(items)


def generation(model: PackedModel, slots: Sequence[int], data: EvalData, **options: Any) -> EvalResult:
    """Generate an answer to every held-out prompt with every slot and score it against the reference.

    Args:
        model: the packed model holding the slots.
        slots: slots to score.
        data: rows with a prompt and a response (alpaca, prompt_completion, chat).
        **options: ``GenerationOptions`` fields.

    Returns:
        The mean of each scorer per slot; per-item scores; samples ``{prompt, generation, reference, <scores>}``.
    """
    opts: GenerationOptions = make_options(GenerationOptions, options, "generation")
    prompts, refs = build_prompts(data), references(data)
    texts = generate_texts(model, slots, prompts, data.tokenizer, max_new_tokens=opts.max_new_tokens,
                           stop=opts.stop, batch_size=opts.batch_size, temperature=opts.temperature, seed=opts.seed,
                           batched=opts.batched)
    result = EvalResult()
    for slot in slots:
        scores = {name: [SCORERS[name](text, ref) for text, ref in zip(texts[slot], refs, strict=True)]
                  for name in opts.scorers}
        result.metrics[slot] = {name: sum(vals) / len(vals) for name, vals in scores.items()}
        result.per_item[slot] = scores
        result.samples[slot] = [{"prompt": data.tokenizer.decode(p), "generation": t, "reference": r,
                                 **{name: vals[i] for name, vals in scores.items()}}
                                for i, (p, t, r) in enumerate(zip(prompts, texts[slot], refs, strict=True))]
    return result


def generation_cost(max_new_tokens: int, batch_size: int, who: str = "generation") -> EvalCost:
    """Greedy decoding's cost: per batch of ``batch_size`` prompts of each slot, the prompts' forward and
    ``max_new_tokens`` one-token forwards (EOS may end it sooner: the plan counts them all)."""
    return EvalCost(batch_size, forwards=1 + max_new_tokens, new_tokens=max_new_tokens,
                    what=f"{who} of {max_new_tokens} tokens for {{rows}} prompts")


GENERATION = Evaluator("generation", GenerationOptions, generation,
                       metrics=lambda opts: {s: METRICS[s] for s in opts.scorers},
                       reports="the chosen `scorers` (" + ", ".join(f"`{s}`" for s in SCORERS) + ")",
                       cost=lambda opts: generation_cost(opts.max_new_tokens, opts.batch_size))
"""The ``generation`` evaluator."""


def build_prompts(data: EvalData) -> list[list[int]]:
    """Token ids of each row's prompt, exactly the tokens before the response in training.

    Raises:
        DataError: a format without a response (``text``), or a row without a response.
    """
    check_format(data, TEXT_FORMATS, "generation")
    examples = packer_data.tokenize_rows(data.rows, data.fmt, data.tokenizer, max_length=1 << 30, source=data.source)
    if len(examples) != len(data.rows):
        raise DataError(f"{data.source}: every row needs a response to compare a generation with")
    prompts = []
    for ex in examples:
        start = len(ex.labels)  # start of the last run of response (trained) tokens
        while start > 0 and ex.labels[start - 1] == packer_data.IGNORE_INDEX:
            start -= 1
        while start > 0 and ex.labels[start - 1] != packer_data.IGNORE_INDEX:
            start -= 1
        prompts.append(list(ex.input_ids[:start]))
    return prompts


def references(data: EvalData) -> list[str]:
    """Each row's reference answer: ``completion``, ``output``, or the last assistant message."""
    check_format(data, TEXT_FORMATS, "generation")
    if data.fmt == "chat":
        return [[m["content"] for m in row["messages"] if m["role"] == "assistant"][-1] for row in data.rows]
    return [row["completion" if data.fmt == "prompt_completion" else "output"] for row in data.rows]


def generate_texts(model: PackedModel, slots: Sequence[int], prompts: Sequence[Sequence[int]], tokenizer: Any, *,
                   max_new_tokens: int = 32, stop: Sequence[str] = (), batch_size: int = 8,
                   temperature: float = 0.0, seed: int = 0,
                   batched: Batched = "auto") -> dict[int, list[str]]:
    """``generate_ids`` decoded (special tokens skipped) and cut before the first stop string.

    Returns:
        slot -> one answer per prompt.
    """
    def stopped(ids: list[int]) -> bool:
        text = tokenizer.decode(ids, skip_special_tokens=True)
        return any(s in text for s in stop)

    ids = generate_ids(model, slots, prompts, eos_id=tokenizer.eos_token_id, pad_id=pad_id(tokenizer),
                       max_new_tokens=max_new_tokens, batch_size=batch_size, should_stop=stopped if stop else None,
                       temperature=temperature, seed=seed, batched=batched)
    return {slot: [_cut(tokenizer.decode(row, skip_special_tokens=True), stop) for row in rows]
            for slot, rows in ids.items()}


def _cut(text: str, stop: Sequence[str]) -> str:
    for s in stop:
        text = text.split(s)[0]
    return text


def generate_ids(model: PackedModel, slots: Sequence[int], prompts: Sequence[Sequence[int]], *, eos_id: int | None,
                 pad_id: int, max_new_tokens: int = 32, batch_size: int = 8,
                 should_stop: Callable[[list[int]], bool] | None = None, temperature: float = 0.0,
                 seed: int = 0, batched: Batched = "auto") -> dict[int, list[list[int]]]:
    """Every slot continues every prompt; one packed forward per decoding step.

    Args:
        model: the packed model holding the slots.
        slots: slots that answer (each answers every prompt).
        prompts: token ids of each prompt (special tokens included).
        eos_id: token that ends an answer (not included in it); None: only ``max_new_tokens`` ends it.
        pad_id: id used for left padding.
        max_new_tokens: tokens generated at most per answer.
        batch_size: prompts per slot in one batch.
        should_stop: called with an answer's ids after each new token; True ends that answer.
        temperature: 0 greedy; else sampling from ``softmax(logits / temperature)``.
        seed: sampling seed; item i draws from its own generator, so a slot samples the same
            answers packed or alone.
        batched: greedy decoding of all slots' adapters together on the training pack's fixed shapes when it trains
            on them (``packer.step.eval_graph``; "auto": on CUDA only, ``evaluators._core.uses_batched``), else the
            per-adapter path; the answers are the same tokens.

    Returns:
        slot -> generated ids of each prompt, in prompt order.
    """
    import torch

    out: dict[int, list[list[int]]] = {slot: [] for slot in slots}
    if not slots:
        return out
    if any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token (e.g. BOS)")
    if uses_batched(batched, model) and temperature <= 0:  # every slot's rows in the fewest forwards, read once
        tokens = evaluation.greedy_decode(model, slots, prompts, batch_size, max_new_tokens, pad_id,
                                          _cache_kwarg(model.model), eos_id)
        if tokens is not None:
            return {slot: [_answer(t, eos_id, should_stop) for t in tokens[g]] for g, slot in enumerate(slots)}
    for idx in chunks(len(prompts), batch_size):
        rows = [list(prompts[i]) for i in idx]
        gens = ([torch.Generator().manual_seed(seed * 1_000_003 + i) for _ in slots for i in idx]
                if temperature > 0 else None)
        answers = _decode(model, slots, rows, eos_id=eos_id, pad_id=pad_id, max_new_tokens=max_new_tokens,
                          should_stop=should_stop, temperature=temperature, gens=gens)
        for g, slot in enumerate(slots):
            out[slot].extend(answers[g * len(rows):(g + 1) * len(rows)])
    return out


def _decode(model: PackedModel, slots: Sequence[int], rows: list[list[int]], *, eos_id: int | None, pad_id: int,
            max_new_tokens: int, should_stop: Callable[[list[int]], bool] | None, temperature: float,
            gens: list[torch.Generator] | None) -> list[list[int]]:
    """Decode one batch: ``rows`` repeated for each slot, grouped by slot. Returns B answers, slot-major."""
    import torch

    device = model.device
    width = max(len(r) for r in rows)
    batch = [r for _ in slots for r in rows]
    ids = torch.tensor([[pad_id] * (width - len(r)) + r for r in batch], device=device)  # (B, P) left-padded
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in batch], device=device)  # (B, P)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)  # (B, P) real tokens count from 0
    answers: list[list[int]] = [[] for _ in batch]
    done = torch.zeros(len(batch), dtype=torch.bool)
    cache_key = _cache_kwarg(model.model)
    cache, step_ids = None, ids
    with torch.no_grad(), routed(model, slot_layout(slots, len(rows), width)):
        for _ in range(max_new_tokens):
            past: dict[str, Any] = {cache_key: cache} if cache is not None else {}
            out = model.model(input_ids=step_ids, attention_mask=mask, position_ids=positions, use_cache=True,
                              logits_to_keep=1, **past)
            cache = getattr(out, cache_key)
            nxt = _next_tokens(out.logits[:, -1].float(), temperature, gens).cpu()  # (B,)
            for i, tok in enumerate(nxt.tolist()):
                if done[i]:
                    continue
                if tok == eos_id:
                    done[i] = True
                    continue
                answers[i].append(tok)
                if should_stop is not None and should_stop(answers[i]):
                    done[i] = True
            if bool(done.all()):
                break
            step_ids = nxt.masked_fill(done, pad_id).to(device)[:, None]  # (B, 1)
            mask = torch.cat([mask, mask.new_ones((len(batch), 1))], dim=1)  # (B, P + t)
            positions = positions[:, -1:] + 1  # (B, 1)
    return answers


def _answer(tokens: list[int], eos_id: int | None, should_stop: Callable[[list[int]], bool] | None) -> list[int]:
    """A row's answer from all its decoded tokens, cut where ``_decode`` stops that row: before EOS, or after the
    token at which ``should_stop`` first says so."""
    answer: list[int] = []
    for tok in tokens:
        if tok == eos_id:
            break
        answer.append(tok)
        if should_stop is not None and should_stop(answer):
            break
    return answer


def _cache_kwarg(module: torch.nn.Module) -> str:
    """Name of the KV-cache argument and output field: ``cache`` (transformers >= 5.2x) or ``past_key_values``."""
    return "cache" if "cache" in inspect.signature(module.forward).parameters else "past_key_values"


def _next_tokens(logits: torch.Tensor, temperature: float, gens: list[torch.Generator] | None) -> torch.Tensor:
    """logits: (B, V) -> (B,) next token ids (greedy, or each row sampled with its own generator)."""
    import torch

    if temperature <= 0 or gens is None:
        return logits.argmax(dim=-1)
    probs = torch.softmax(logits / temperature, dim=-1).cpu()  # (B, V)
    return torch.stack([torch.multinomial(p, 1, generator=gens[i]).squeeze(0)
                        for i, p in enumerate(probs)])
