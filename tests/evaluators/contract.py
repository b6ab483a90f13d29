"""What every evaluator promises, as a suite an implementation's tests subclass (Optuna's ``StorageTestCase`` style).

A subclass provides four fixtures and inherits every test::

    class TestMyEvaluatorContract(EvaluatorContract):
        @pytest.fixture
        def evaluator(self) -> Evaluator: return MY_EVALUATOR
        @pytest.fixture
        def options(self) -> dict: return {"max_new_tokens": 2}      # valid, and quick on the tiny model
        @pytest.fixture
        def data_file(self) -> Path: return YESNO                    # held-out rows it can score
        @pytest.fixture
        def bad_option(self) -> tuple[str, object]: return ("max_new_tokens", 0)   # a value the options reject

The pack is the llama-family tiny model of ``packer.tiny`` (built in code, random init) with two adapters whose B
is drawn at random, so the slots score differently from the base and from each other.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import pytest

from lora_sweep.errors import ConfigError
from lora_sweep.evaluators.registry import EvalResult, Evaluator, load_eval_data
from lora_sweep.packer.model.load import load_base
from lora_sweep.packer.model.packed import PackedModel
from lora_sweep.packer.plan import AdapterSpec
from tests.conftest import add_slots_random_b

SLOTS = (0, 1)


class EvaluatorContract:
    """The contract: options checked at load with one-line errors naming the key, directions declared, one finite
    value per slot and declared metric, the same items for every slot, and the same scores twice."""

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
    def scored(self, evaluator: Evaluator, options: dict[str, Any], data_file: Path, tiny_dirs,
               tmp_path: Path) -> tuple[EvalResult, EvalResult]:
        """The evaluator run twice on the same two-adapter pack of the tiny model."""
        model, tok = load_base(str(tiny_dirs("llama")))
        specs = {slot: AdapterSpec(rank=4, alpha=8, targets=("all-linear",), seed=slot) for slot in SLOTS}
        pm = add_slots_random_b(PackedModel(model), specs)
        data = load_eval_data(data_file, tok, max_length=48, work_dir=tmp_path)
        return (evaluator.score(pm, list(SLOTS), data, **options),
                evaluator.score(pm, list(SLOTS), data, **options))

    def test_it_has_a_name_and_an_options_dataclass_whose_defaults_load(self, evaluator: Evaluator,
                                                                        options: dict[str, Any]) -> None:
        assert isinstance(evaluator, Evaluator) and evaluator.name and ":" not in evaluator.name
        assert dataclasses.is_dataclass(evaluator.options) and evaluator.reports
        assert isinstance(evaluator.load(options), evaluator.options)

    def test_every_declared_metric_has_a_direction(self, evaluator: Evaluator, options: dict[str, Any]) -> None:
        opts = evaluator.load(options)
        assert set(evaluator.metrics(opts).values()) <= {"minimize", "maximize"}
        for metric, direction in evaluator.metrics(opts).items():
            assert evaluator.direction(metric, opts) == direction
        assert evaluator.metrics(opts) or evaluator.families(opts), "it declares no metric an objective could name"

    def test_an_unknown_option_is_one_line_naming_it(self, evaluator: Evaluator, options: dict[str, Any]) -> None:
        with pytest.raises(ConfigError) as err:
            evaluator.load({**options, "no_such_option": 1})
        assert "\n" not in str(err.value)
        assert str(err.value).startswith(f"{evaluator.name}.options: unknown option 'no_such_option'")

    def test_a_bad_value_is_one_line_naming_its_key(self, evaluator: Evaluator, options: dict[str, Any],
                                                     bad_option: tuple[str, Any]) -> None:
        key, value = bad_option
        with pytest.raises(ConfigError) as err:
            evaluator.load({**options, key: value})
        assert "\n" not in str(err.value)
        assert str(err.value).startswith(f"{evaluator.name}.options.{key}: ")

    def test_one_finite_value_per_slot_and_declared_metric(self, evaluator: Evaluator, options: dict[str, Any],
                                                           scored: tuple[EvalResult, EvalResult]) -> None:
        result, _ = scored
        opts = evaluator.load(options)
        assert not result.errors and set(result.metrics) == set(SLOTS)
        for slot in SLOTS:
            assert set(evaluator.metrics(opts)) <= set(result.metrics[slot])
            for metric, value in result.metrics[slot].items():
                assert isinstance(value, float) and math.isfinite(value), (slot, metric, value)
                assert evaluator.direction(metric, opts) is not None, f"{metric} is reported but not declared"

    def test_every_slot_is_scored_on_the_same_items(self, scored: tuple[EvalResult, EvalResult]) -> None:
        result, _ = scored
        for metric, items in result.per_item.get(SLOTS[0], {}).items():
            assert items and all(len(result.per_item[s][metric]) == len(items) for s in SLOTS)
            assert all(math.isfinite(v) for s in SLOTS for v in result.per_item[s][metric])

    def test_the_same_pack_scores_the_same_twice(self, scored: tuple[EvalResult, EvalResult]) -> None:
        first, second = scored
        assert first.metrics == second.metrics and first.per_item == second.per_item
