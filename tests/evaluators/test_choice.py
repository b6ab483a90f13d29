"""Multiple choice by log-likelihood keeps the evaluator contract (its agreement with lm-eval: test_lm_eval.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from lora_sweep.evaluators.choice import MULTIPLE_CHOICE
from lora_sweep.evaluators.registry import Evaluator
from lora_sweep.testing.evaluator import EvaluatorContract
from tests.evaluators.conftest import YESNO_MC


class TestMultipleChoiceContract(EvaluatorContract):
    @pytest.fixture
    def evaluator(self) -> Evaluator:
        return MULTIPLE_CHOICE

    @pytest.fixture
    def options(self) -> dict:
        return {"batch_size": 8}

    @pytest.fixture
    def data_file(self) -> Path:
        return YESNO_MC

    @pytest.fixture
    def bad_option(self) -> tuple:
        return ("delimiter", 3)
