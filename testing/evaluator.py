"""What every evaluator promises, as checks a user's own evaluator can run from another repository.

Two ways in, the same checks::

    from lora_sweep.testing.evaluator import check_evaluator
    check_evaluator(MY_EVALUATOR, data_file="heldout.jsonl", bad_option=("max_new_tokens", 0),
                    options={"max_new_tokens": 2})                 # raises AssertionError naming the broken promise

or, under pytest, a class that subclasses the suite and provides four fixtures (Optuna's ``StorageTestCase`` style)::

    from lora_sweep.testing.evaluator import EvaluatorContract

    class TestMyEvaluatorContract(EvaluatorContract):
        @pytest.fixture
        def evaluator(self) -> Evaluator: return MY_EVALUATOR
        @pytest.fixture
        def options(self) -> dict: return {"max_new_tokens": 2}      # valid, and quick on the tiny model
        @pytest.fixture
        def data_file(self) -> Path: return Path("heldout.jsonl")    # held-out rows it can score
        @pytest.fixture
        def bad_option(self) -> tuple[str, object]: return ("max_new_tokens", 0)   # a value the options reject

The pack is the llama-family tiny model of ``packer.tiny`` (built in code, random init, once per process) with two
adapters whose B is drawn at random, so the slots score differently from the base and from each other. Nothing in
the library imports this module (an import contract).
"""

from __future__ import annotations

import atexit
import dataclasses
import functools
import math
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import torch

from lora_sweep.errors import ConfigError
from lora_sweep.evaluators.registry import EvalCost, EvalResult, Evaluator, load_eval_data
from lora_sweep.packer.api import AdapterSpec, open_base, tiny_base

__all__ = ["SLOTS", "check_evaluator", "check_declarations", "check_option_errors", "check_scores", "score_twice",
           "tiny_model_dir", "EvaluatorContract"]

SLOTS = (0, 1)
"""The slots of the pack the evaluator scores."""


@functools.cache
def tiny_model_dir() -> Path:
    """The tiny Llama, built once per process in a temporary directory removed at exit."""
    root = Path(tempfile.mkdtemp(prefix="lora-sweep-contract-"))
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    return tiny_base("llama", root / "tiny-llama", seed=0)


def score_twice(evaluator: Evaluator, options: Mapping[str, Any], data_file: str | Path,
                work_dir: str | Path | None = None,
                model_dir: str | Path | None = None) -> tuple[EvalResult, EvalResult]:
    """The evaluator run twice on the same two-adapter pack of the tiny model (or of ``model_dir``)."""
    packer = open_base(str(model_dir or tiny_model_dir()))
    pm, tok = packer.model, packer.tokenizer
    gen = torch.Generator().manual_seed(2)
    for slot in SLOTS:
        pm.add_slot(slot, AdapterSpec(rank=4, alpha=8, targets=("all-linear",), seed=slot))
        with torch.no_grad():  # PEFT's zero B would leave every slot scoring as the base
            for _, b in pm.slot_weights(slot).values():
                b.copy_(torch.randn(b.shape, generator=gen) * 0.2)
    data = load_eval_data(data_file, tok, max_length=48, work_dir=work_dir)
    return (evaluator.score(pm, list(SLOTS), data, **options), evaluator.score(pm, list(SLOTS), data, **options))


def check_declarations(evaluator: Evaluator, options: Mapping[str, Any]) -> None:
    """A name a study file can use, an options dataclass whose given options load, a direction for every declared
    metric, and well-formed declarations of what it needs and costs (``Evaluator.needs_eval_data``, ``cost``,
    ``curve``)."""
    assert isinstance(evaluator, Evaluator) and evaluator.name and ":" not in evaluator.name, evaluator
    assert dataclasses.is_dataclass(evaluator.options) and evaluator.reports, "options must be a dataclass"
    opts = evaluator.load(options)
    assert isinstance(opts, evaluator.options)
    declared = evaluator.metrics(opts)
    assert set(declared.values()) <= {"minimize", "maximize"}, declared
    for metric, direction in declared.items():
        assert evaluator.direction(metric, opts) == direction, metric
    assert declared or evaluator.families(opts), "it declares no metric an objective could name"
    assert isinstance(evaluator.needs_eval_data, bool)
    cost = evaluator.cost(opts)
    assert cost is None or isinstance(cost, EvalCost), f"cost must give an EvalCost or None, not {cost!r}"
    assert evaluator.curve is None or evaluator.direction(evaluator.curve, opts) is not None, (
        f"its curve metric {evaluator.curve!r} is not one it declares")


def check_option_errors(evaluator: Evaluator, options: Mapping[str, Any], bad_option: tuple[str, Any]) -> None:
    """An unknown option and a value the options reject are one-line ``ConfigError``s naming the key."""
    for given, start in [({**options, "no_such_option": 1}, f"{evaluator.name}.options: unknown option "
                          "'no_such_option'"), ({**options, bad_option[0]: bad_option[1]},
                                                f"{evaluator.name}.options.{bad_option[0]}: ")]:
        try:
            evaluator.load(given)
        except ConfigError as err:
            assert "\n" not in str(err) and str(err).startswith(start), f"{err} (expected: {start}...)"
        else:
            raise AssertionError(f"options {given} loaded; expected a ConfigError starting {start!r}")


def check_scores(evaluator: Evaluator, options: Mapping[str, Any], scored: tuple[EvalResult, EvalResult]) -> None:
    """One finite value per slot and declared metric, every reported metric declared, every slot scored on the
    same items, and the same scores twice."""
    result, again = scored
    opts = evaluator.load(options)
    assert isinstance(result, EvalResult) and not result.errors and set(result.metrics) == set(SLOTS), result.errors
    for slot in SLOTS:
        assert set(evaluator.metrics(opts)) <= set(result.metrics[slot]), "a declared metric is missing"
        for metric, value in result.metrics[slot].items():
            assert isinstance(value, float) and math.isfinite(value), (slot, metric, value)
            assert evaluator.direction(metric, opts) is not None, f"{metric} is reported but not declared"
    for metric, items in result.per_item.get(SLOTS[0], {}).items():
        assert items and all(len(result.per_item[s][metric]) == len(items) for s in SLOTS), metric
        assert all(math.isfinite(v) for s in SLOTS for v in result.per_item[s][metric]), metric
    assert result.metrics == again.metrics and result.per_item == again.per_item, "the same pack scored differently"


def check_evaluator(evaluator: Evaluator, *, data_file: str | Path, bad_option: tuple[str, Any],
                    options: Mapping[str, Any] | None = None, work_dir: str | Path | None = None,
                    model_dir: str | Path | None = None) -> None:
    """Every promise of the contract, in turn; raises ``AssertionError`` naming the first one broken.

    Args:
        evaluator: the evaluator object a study would name as ``file.py:OBJECT``.
        data_file: held-out rows it can score (JSON lines).
        bad_option: ``(option, value)`` its options reject.
        options: valid options that run quickly on the tiny model.
        work_dir: ``EvalData.work_dir`` (a temporary directory when None).
        model_dir: a saved causal LM to pack instead of the tiny Llama.
    """
    options = dict(options or {})
    check_declarations(evaluator, options)
    check_option_errors(evaluator, options, bad_option)
    with tempfile.TemporaryDirectory() as tmp:
        check_scores(evaluator, options, score_twice(evaluator, options, data_file, work_dir or tmp, model_dir))


class EvaluatorContract:
    """The contract as a pytest suite: a subclass provides ``evaluator``, ``data_file``, ``bad_option`` and
    (optionally) ``options``; each promise is one test."""

    @pytest.fixture
    def evaluator(self) -> Evaluator:
        raise NotImplementedError("a subclass provides the evaluator under test")

    @pytest.fixture
    def options(self) -> dict[str, Any]:
        return {}

    @pytest.fixture
    def data_file(self) -> Path:
        raise NotImplementedError("a subclass provides held-out rows its evaluator scores")

    @pytest.fixture
    def bad_option(self) -> tuple[str, Any]:
        raise NotImplementedError("a subclass provides (option, a value its options reject)")

    @pytest.fixture
    def scored(self, evaluator: Evaluator, options: dict[str, Any], data_file: Path,
               tmp_path: Path) -> tuple[EvalResult, EvalResult]:
        return score_twice(evaluator, options, data_file, tmp_path)

    def test_its_declarations(self, evaluator: Evaluator, options: dict[str, Any]) -> None:
        check_declarations(evaluator, options)

    def test_a_bad_option_is_one_line_naming_its_key(self, evaluator: Evaluator, options: dict[str, Any],
                                                     bad_option: tuple[str, Any]) -> None:
        check_option_errors(evaluator, options, bad_option)

    def test_its_scores(self, evaluator: Evaluator, options: dict[str, Any],
                        scored: tuple[EvalResult, EvalResult]) -> None:
        check_scores(evaluator, options, scored)
