"""``lora_sweep.testing.evaluator``: the evaluator contract as a call (``check_evaluator``) passes a built-in
evaluator and names the promise a broken one breaks (the pytest suite, ``EvaluatorContract``, runs on every built-in
evaluator in tests/evaluators/)."""

from __future__ import annotations

import dataclasses

import pytest

from lora_sweep.evaluators.heldout_loss import HELDOUT_LOSS, heldout_loss
from lora_sweep.evaluators.registry import EvalResult
from lora_sweep.testing.evaluator import check_evaluator
from tests.evaluators.conftest import YESNO


def test_a_built_in_evaluator_keeps_the_contract() -> None:
    check_evaluator(HELDOUT_LOSS, data_file=YESNO, bad_option=("batch_size", 0), options={"batch_size": 4})


def _undeclared(model, slots, data, **options) -> EvalResult:  # noqa: ANN001
    result = heldout_loss(model, slots, data, **options)
    for values in result.metrics.values():
        values["surprise"] = 1.0
    return result


@pytest.mark.parametrize(("broken", "bad_option", "message"), [
    (dataclasses.replace(HELDOUT_LOSS, score=_undeclared), ("batch_size", 0), "surprise is reported but not declared"),
    (HELDOUT_LOSS, ("batch_size", 2), "loaded; expected a ConfigError starting 'heldout_loss.options.batch_size: '"),
    (dataclasses.replace(HELDOUT_LOSS, curve="accuracy"), ("batch_size", 0), "curve metric 'accuracy' is not one"),
])
def test_a_broken_promise_is_named(broken, bad_option: tuple, message: str) -> None:  # noqa: ANN001
    with pytest.raises(AssertionError, match=message):
        check_evaluator(broken, data_file=YESNO, bad_option=bad_option)
