"""Study-file checks owned by the evaluators: names, options, metric names, task files; one-line errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from lora_sweep.errors import ConfigError
from lora_sweep.evaluators.generation import GenerationOptions
from lora_sweep.evaluators.registry import EVALUATORS, find, metric_direction, metrics_of, validate

METRICS_FILE = Path(__file__).parent / "data" / "metrics.py"


def _one_line(exc: pytest.ExceptionInfo) -> str:
    msg = str(exc.value)
    assert "\n" not in msg
    return msg


def test_every_evaluator_has_options_and_defaults_validate() -> None:
    assert [e.name for e in EVALUATORS] == ["heldout_loss", "generation", "multiple_choice", "lm_eval", "custom"]
    for name in ("heldout_loss", "generation", "multiple_choice"):
        assert validate(name) == find(name).options()
        assert set(metrics_of(name).values()) <= {"minimize", "maximize"} and metrics_of(name)
    assert validate("generation", {"max_new_tokens": 8, "stop": "\n"}) == GenerationOptions(8, stop=("\n",))


def test_a_user_evaluator_object_is_named_by_file_and_attribute(tmp_path) -> None:
    assert find(f"{METRICS_FILE}:SAYS_YES").name == "says_yes_eval"
    assert metrics_of(f"{METRICS_FILE}:SAYS_YES") == {"yes_rate": "maximize"}
    assert metric_direction("yes_rate", [(f"{METRICS_FILE}:SAYS_YES", None)]) == "maximize"
    for name, pattern in [(f"{METRICS_FILE}:says_yes", r"is a function, not an lora_sweep"),
                          (f"{METRICS_FILE}:NOPE", r"has no 'NOPE'"),
                          (f"{tmp_path}/missing.py:X", r"file not found")]:
        with pytest.raises(ConfigError, match=rf"^evaluators: name: .*{pattern}") as err:
            find(name)
        assert _one_line(err)


@pytest.mark.parametrize(("name", "options", "pattern"), [
    ("bleu_score", {}, r"^evaluators: unknown evaluator 'bleu_score' \(expected one of: heldout_loss, "),
    ("heldout_loss", {"batchsize": 4},
     r"^heldout_loss\.options: unknown option 'batchsize' \(expected: batch_size, batched\)"),
    ("generation", {"scorers": ["exact_match", "rouge"]}, r"^generation\.options\.scorers: unknown metric 'rouge'"),
    ("generation", {"max_new_tokens": 0}, r"^generation\.options\.max_new_tokens: must be an integer >= 1"),
    ("lm_eval", {}, r"^lm_eval\.options\.tasks: is required$"),
    ("lm_eval", {"tasks": ["/no/such/task.yaml"]}, r"^lm_eval\.options\.tasks: task file not found: /no/such/task"),
    ("lm_eval", {"tasks": ["t"], "include_path": "/no/such/dir"}, r"include_path: folder not found: /no/such/dir"),
    ("custom", {"function": "nope_module_xyz:f"}, r"^custom\.options\.function: cannot import 'nope_module_xyz'"),
    ("custom", {"function": f"{METRICS_FILE}:says_yes", "direction": "up"}, r"^custom\.options\.direction: must be"),
])
def test_bad_entries(name: str, options: dict, pattern: str) -> None:
    with pytest.raises(ConfigError) as err:
        validate(name, options)
    assert _one_line(err)
    assert err.match(pattern)


def test_metric_names_of_objectives(tmp_path) -> None:
    task = tmp_path / "t.yaml"
    task.write_text("task: tiny_gen\noutput_type: generate_until\ndoc_to_text: !function utils.f\n")
    entries = [("heldout_loss", None), ("generation", {"scorers": ["numeric_match"]}),
               ("custom", {"function": f"{METRICS_FILE}:says_yes", "metric": "yes_rate", "direction": "maximize"}),
               ("lm_eval", {"tasks": [str(task)]})]
    assert metrics_of("generation", {"scorers": ["numeric_match"]}) == {"numeric_match": "maximize"}
    assert metric_direction("eval_loss", entries) == "minimize"
    assert metric_direction("numeric_match", entries) == "maximize"
    assert metric_direction("yes_rate", entries) == "maximize"
    assert metric_direction("adapter_params", entries) == "minimize"  # cost metrics are always there
    assert metric_direction("tiny_gen.exact_match", entries) == "maximize"
    assert metric_direction("tiny_gen.perplexity", entries) == "minimize"
    for unknown in ("exact_match", "accuracy", "other_task.acc"):
        with pytest.raises(ConfigError, match=rf"^metric: unknown metric '{unknown}' \(reported: ") as err:
            metric_direction(unknown, entries)
        assert "tiny_gen.<metric>" in _one_line(err)
