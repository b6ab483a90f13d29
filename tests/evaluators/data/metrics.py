"""Custom metrics used by the tests, loaded as ``tests/evaluators/data/metrics.py:<function>``, and a user's own
evaluator object (``SAYS_YES``)."""

from __future__ import annotations

from dataclasses import dataclass

from lora_sweep.errors import ConfigError
from lora_sweep.evaluators._core import make_options
from lora_sweep.evaluators.generation import build_prompts, generate_texts
from lora_sweep.evaluators.registry import EvalResult, Evaluator


def says_yes(generation: str, row: dict) -> float:
    """1.0 when the answer is yes, whatever the question."""
    return float(generation.strip() == "yes")


def no_yes_allowed(generation: str, row: dict) -> float:
    """Raises on a yes answer: the adapter that always says yes fails, the others are scored."""
    if "yes" in generation:
        raise ValueError(f"cannot score {generation!r}\nfor {row['prompt']!r}")
    return 1.0


def share_of_yes(generations: list[str], rows: list[dict]) -> float:
    """Whole-set metric: the share of yes answers."""
    return sum(g.strip() == "yes" for g in generations) / len(generations)


def not_a_number(generation: str, row: dict) -> str:
    return "high"


@dataclass(frozen=True)
class YesOptions:
    """Options of ``SAYS_YES``."""

    max_new_tokens: int = 4
    """Tokens generated per answer."""

    def __post_init__(self) -> None:
        if not (isinstance(self.max_new_tokens, int) and self.max_new_tokens >= 1):
            raise ConfigError(f"max_new_tokens: must be an integer >= 1 (got {self.max_new_tokens!r})")


def yes_rate(model, slots, data, **options) -> EvalResult:  # noqa: ANN001
    """The share of a slot's greedy answers that are yes (``says_yes`` per item)."""
    opts = make_options(YesOptions, options, "says_yes_eval")
    texts = generate_texts(model, slots, build_prompts(data), data.tokenizer, max_new_tokens=opts.max_new_tokens)
    result = EvalResult()
    for slot in slots:
        items = [says_yes(text, row) for text, row in zip(texts[slot], data.rows, strict=True)]
        result.metrics[slot] = {"yes_rate": sum(items) / len(items)}
        result.per_item[slot] = {"yes_rate": items}
    return result


SAYS_YES = Evaluator("says_yes_eval", YesOptions, yes_rate, metrics=lambda opts: {"yes_rate": "maximize"},
                     reports="`yes_rate`")
"""A user's evaluator object, named in a study as ``tests/evaluators/data/metrics.py:SAYS_YES``."""
