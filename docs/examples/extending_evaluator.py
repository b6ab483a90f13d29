"""A new evaluator end to end: define it, name it in a study file, run a 4-trial study on a tiny model with it.

``number_rate`` scores each adapter by the share of its greedy answers that read as a number (the arithmetic task's
answers are numbers). Run it from the checkout's root: ``python docs/examples/extending_evaluator.py``;
tests/docs/test_extending.py runs it, and the evaluator contract on its evaluator.
"""

from __future__ import annotations

import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

import lora_sweep
from lora_sweep.api import STUDIES
from lora_sweep.errors import ConfigError
from lora_sweep.evaluators.generation import build_prompts, generate_texts, generation_cost
from lora_sweep.evaluators.registry import EvalData, EvalResult, Evaluator
from lora_sweep.evaluators.scorers import extract_number
from lora_sweep.packer.model.packed import PackedModel
from lora_sweep.packer.tiny.models import build_tiny_model

HERE = Path(__file__).resolve()


# --8<-- [start:evaluator]
@dataclass(frozen=True)
class NumberRateOptions:
    """Options of the ``number_rate`` evaluator (the study file's ``options:``)."""

    max_new_tokens: int = 4
    """Tokens generated at most per answer."""

    def __post_init__(self) -> None:  # a bad value is one line naming the key
        if not (isinstance(self.max_new_tokens, int) and self.max_new_tokens >= 1):
            raise ConfigError(f"max_new_tokens: must be an integer >= 1 (got {self.max_new_tokens!r})")


def number_rate(model: PackedModel, slots: Sequence[int], data: EvalData, **options: Any) -> EvalResult:
    """Every slot answers every held-out prompt (one packed forward per decoding step); per slot, the share of
    answers holding a number, and the 0/1 of each item (paired statistics compare adapters item by item)."""
    opts = NumberRateOptions(**options)  # the sweep checked them at load (NUMBER_RATE.load)
    texts = generate_texts(model, slots, build_prompts(data), data.tokenizer, max_new_tokens=opts.max_new_tokens)
    result = EvalResult()
    for slot in slots:
        items = [float(extract_number(text) is not None) for text in texts[slot]]
        result.metrics[slot] = {"number_rate": sum(items) / len(items)}
        result.per_item[slot] = {"number_rate": items}
    return result


NUMBER_RATE = Evaluator("number_rate", NumberRateOptions, number_rate,
                        metrics=lambda opts: {"number_rate": "maximize"}, reports="`number_rate`",
                        cost=lambda opts: generation_cost(opts.max_new_tokens, 8, "number_rate"))
# it scores data.eval's rows (needs_eval_data: True, the default); its cost is greedy decoding's, which sweep plan
# times where the study was loaded for a run (sweep plan itself imports no user code)
# --8<-- [end:evaluator]


def study_file(work: Path) -> Path:
    """A 4-trial study of the tiny Llama that names the evaluator object by this file's path."""
    model = build_tiny_model("llama", work / "model", seed=0)
    data = STUDIES / "data"
    evals = (data / "arith-eval.jsonl").read_text().splitlines(keepends=True)[:24]  # a quick held-out set
    (work / "eval.jsonl").write_text("".join(evals))
    doc = {
        "name": "extending-evaluator", "seed": 0,
        "model": {"path": str(model), "device": "cpu"},
        "data": {"train": str(data / "arith-train.jsonl"), "eval": str(work / "eval.jsonl"),
                 "format": "prompt_completion", "max_length": 48},
        "search": {"rank": [2, 4, 8], "lr": {"low": 1e-3, "high": 3e-2, "log": True}},
        "train": {"max_steps": 8, "micro_batch": 4},
        # --8<-- [start:study]
        "evaluators": [{"name": f"{HERE}:NUMBER_RATE", "options": {"max_new_tokens": 4}}],
        "objectives": [{"metric": "number_rate", "direction": "maximize"},
                       {"metric": "adapter_params", "direction": "minimize"}],
        # --8<-- [end:study]
        "budget": {"trials": 4}, "pruning": {"kind": "none"}, "pack": {"max_slots": 4},
        "output": str(work / "runs"),
    }
    path = work / "study.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def main(work: Path) -> None:
    summary = lora_sweep.run(study_file(work), log=lambda line: None)
    assert summary.complete == 4, summary
    trials = lora_sweep.open_results(work / "runs").trials("COMPLETE")
    rates = {t.number: t.metrics["number_rate"] for t in trials if t.metrics}
    assert len(rates) == 4 and all(0.0 <= r <= 1.0 for r in rates.values()), rates
    assert all(t.objective_values and t.objective_values[0] == rates[t.number] for t in trials)
    print("number_rate per trial:", {n: round(r, 3) for n, r in sorted(rates.items())})


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as tmp:
        main(Path(tmp))
