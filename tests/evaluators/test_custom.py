"""A user's metric function: scored per slot; one that raises fails that slot only, with the reason."""

from __future__ import annotations

from pathlib import Path

import pytest

from lora_sweep.errors import ConfigError, UserError
from lora_sweep.evaluators.custom import CUSTOM, custom, load_function
from lora_sweep.evaluators.generation import generation
from lora_sweep.evaluators.registry import SlotEvalError, load_eval_data
from lora_sweep.testing.evaluator import EvaluatorContract
from tests.evaluators.conftest import YESNO, load_pack

METRICS_FILE = Path(__file__).parent / "data" / "metrics.py"


def test_custom_metric_per_item_and_whole_set(trained) -> None:
    pm, tok = load_pack(trained("llama"))
    data = load_eval_data(YESNO, tok)
    result = custom(pm, [0, 1, 2], data, function=f"{METRICS_FILE}:says_yes", max_new_tokens=4)
    gen = generation(pm, [0, 1, 2], data, max_new_tokens=4)
    for slot in (0, 1, 2):
        expected = [float(s["generation"].strip() == "yes") for s in gen.samples[slot]]
        assert result.per_item[slot]["says_yes"] == expected
        assert result.metrics[slot]["says_yes"] == pytest.approx(sum(expected) / len(expected))
    assert result.metrics[0]["says_yes"] == 1.0  # the always-yes adapter
    whole = custom(pm, [0, 1], data, function=f"{METRICS_FILE}:share_of_yes", metric="yes_share", per_item=False,
                   max_new_tokens=4)
    assert whole.metrics == {0: {"yes_share": 1.0}, 1: {"yes_share": result.metrics[1]["says_yes"]}}
    assert whole.per_item == {}


def test_raising_metric_fails_only_that_slot(trained) -> None:
    pm, tok = load_pack(trained("llama"))
    result = custom(pm, [0, 1, 2], load_eval_data(YESNO, tok), function=f"{METRICS_FILE}:no_yes_allowed",
                    max_new_tokens=4)
    assert set(result.errors) == {0}
    err = result.errors[0]
    assert isinstance(err, SlotEvalError) and isinstance(err, UserError) and err.slot == 0
    assert "\n" not in str(err)
    assert str(err).startswith("slot 0: custom metric ") and "ValueError: cannot score ' yes'" in str(err)
    assert set(result.metrics) == {1, 2} and result.metrics[1]["no_yes_allowed"] == 1.0


def test_metric_returning_a_non_number_fails_the_slot(trained) -> None:
    pm, tok = load_pack(trained("llama"), slots=(0,))
    result = custom(pm, [0], load_eval_data(YESNO, tok), function=f"{METRICS_FILE}:not_a_number", max_new_tokens=2)
    assert "must be a number, got str" in str(result.errors[0])


def test_function_spec_errors_are_one_line(tmp_path) -> None:
    assert load_function("math:sqrt")(4.0) == 2.0
    cases = {
        "nope_module_xyz:f": r"cannot import 'nope_module_xyz': ModuleNotFoundError",
        "math:nope": r"'math' has no callable 'nope'",
        f"{tmp_path}/missing.py:f": r"file not found: .*missing\.py",
    }
    for spec, pattern in cases.items():
        with pytest.raises(ConfigError, match=pattern) as err:
            load_function(spec)
        assert "\n" not in str(err.value)
    broken = tmp_path / "broken.py"
    broken.write_text("raise RuntimeError('boom')\n")
    with pytest.raises(ConfigError, match=r"cannot import .*broken\.py': RuntimeError: boom"):
        load_function(f"{broken}:f")
    with pytest.raises(ConfigError, match=r"^custom\.options\.function: must read 'module:function'"):
        custom(None, [0], None, function="no_colon")  # type: ignore[arg-type]


class TestCustomContract(EvaluatorContract):
    @pytest.fixture
    def evaluator(self):  # noqa: ANN201
        return CUSTOM

    @pytest.fixture
    def options(self) -> dict:
        return {"function": f"{METRICS_FILE}:says_yes", "max_new_tokens": 2}

    @pytest.fixture
    def data_file(self) -> Path:
        return YESNO

    @pytest.fixture
    def bad_option(self) -> tuple:
        return ("direction", "up")


class TestUserEvaluatorObjectContract(EvaluatorContract):
    """A user's own ``Evaluator`` object (tests/evaluators/data/metrics.py), as a study names it."""

    @pytest.fixture
    def evaluator(self):  # noqa: ANN201
        from lora_sweep.evaluators.registry import find

        return find(f"{METRICS_FILE}:SAYS_YES")

    @pytest.fixture
    def data_file(self) -> Path:
        return YESNO

    @pytest.fixture
    def bad_option(self) -> tuple:
        return ("max_new_tokens", "four")
