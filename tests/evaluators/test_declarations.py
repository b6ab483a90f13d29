"""What an evaluator declares (``Evaluator.needs_eval_data``, ``cost``, ``curve``) is what the sweep asks: a user's
evaluator that declares a need is honoured without sweep/ knowing its name."""

from __future__ import annotations

import math
import textwrap
from pathlib import Path

import pytest

from lora_sweep.errors import ConfigError
from lora_sweep.evaluators.registry import EVALUATORS, EvalCost, curve_entry, find, plan_cost, user_code
from lora_sweep.packer.plan import MemoryModel
from lora_sweep.sweep.config.loader import load_study
from lora_sweep.sweep.schedule import Schedule, eval_seconds

USER_EVALUATORS = '''
from dataclasses import dataclass

from lora_sweep.evaluators.registry import EvalCost, EvalResult, Evaluator


@dataclass(frozen=True)
class Opts:
    batch_size: int = 4


def score(model, slots, data, **options):
    return EvalResult()


ROWS = Evaluator("rows", Opts, score, metrics=lambda opts: {"rows_score": "maximize"}, reports="`rows_score`")
OWN_DATA = Evaluator("own_data", Opts, score, metrics=lambda opts: {"own_score": "maximize"}, reports="`own_score`",
                     needs_eval_data=False)
LOSSY = Evaluator("lossy", Opts, score, metrics=lambda opts: {"my_loss": "minimize"}, reports="`my_loss`",
                  cost=lambda opts: EvalCost(opts.batch_size, forwards=2, new_tokens=3, what="lossy on {rows} rows"),
                  curve="my_loss")
'''

STUDY = """\
name: t
model: org/tiny-model
data:
  train: train.jsonl
search:
  rank: [4, 8]
train:
  max_steps: 40
budget:
  trials: 4
objectives: [{{metric: adapter_params, direction: minimize}}]
evaluators: [{evaluators}]
"""


@pytest.fixture
def user_file(tmp_path: Path) -> Path:
    (tmp_path / "train.jsonl").write_text('{"instruction": "a", "output": "b"}\n')
    path = tmp_path / "user_evals.py"
    path.write_text(textwrap.dedent(USER_EVALUATORS))
    return path


def _study(folder: Path, *names: str, eval_file: bool = False) -> Path:
    text = STUDY.format(evaluators=", ".join(f"{{name: {n}}}" for n in names))
    if eval_file:
        (folder / "eval.jsonl").write_text('{"instruction": "a", "output": "b"}\n' * 10)
        text = text.replace("  train: train.jsonl\n", "  train: train.jsonl\n  eval: eval.jsonl\n")
    path = folder / "study.yaml"
    path.write_text(text)
    return path


def test_a_user_evaluator_declaring_it_needs_eval_data_is_refused_without_it(user_file: Path) -> None:
    """Scoring the held-out rows is the default declaration; the refusal names the key in one line."""
    with pytest.raises(ConfigError) as err:
        load_study(_study(user_file.parent, f"{user_file}:ROWS"))
    assert str(err.value) == f"{user_file.parent / 'study.yaml'}:3: data.eval: is needed by {user_file}:ROWS"
    spec = load_study(_study(user_file.parent, f"{user_file}:OWN_DATA"))  # declares it brings its own data
    assert spec.data.eval is None and [e.name for e in spec.evaluators] == [f"{user_file}:OWN_DATA"]


def test_the_built_in_declarations() -> None:
    needs = {e.name: e.needs_eval_data for e in EVALUATORS}
    assert needs == {"heldout_loss": True, "generation": True, "multiple_choice": True, "lm_eval": False,
                     "custom": True}
    assert plan_cost("heldout_loss") == EvalCost(8, what="heldout_loss over {rows} rows")
    assert plan_cost("generation", {"max_new_tokens": 5, "batch_size": 2}) == EvalCost(
        2, forwards=6, new_tokens=5, what="generation of 5 tokens for {rows} prompts")
    assert plan_cost("custom", {"function": "no_such_module_xyz:f"}).forwards == 33  # its function is not imported
    assert plan_cost("multiple_choice") is None and find("lm_eval").cost(None) is None  # declare no cost
    assert [e.name for e in EVALUATORS if e.curve] == ["heldout_loss"]


def test_the_curve_is_scored_by_the_first_entry_that_declares_one(user_file: Path) -> None:
    lossy = f"{user_file}:LOSSY"
    assert curve_entry([("generation", {}), (lossy, {"batch_size": 2}), ("heldout_loss", {})]) == (
        (lossy, {"batch_size": 2}), "my_loss")
    assert curve_entry([("generation", {"max_new_tokens": 4})]) == (("heldout_loss", {}), "eval_loss")


def test_the_plan_times_a_user_evaluator_by_its_declaration_once_imported(user_file: Path) -> None:
    """``sweep plan`` imports no user code, so a user's evaluator is timed only where the study was loaded for a run
    (``find`` imported it); its declared cost then times its final evaluations, and, as it serves the curve, the
    rungs and ``eval_every`` evaluations too."""
    lossy = f"{user_file}:LOSSY"
    assert plan_cost(lossy) is None  # not imported yet: not timed, and not imported by asking
    spec = load_study(_study(user_file.parent, "generation", lossy, eval_file=True))
    assert plan_cost(lossy, {"batch_size": 2}) == EvalCost(2, forwards=2, new_tokens=3, what="lossy on {rows} rows")
    mm = MemoryModel(base_bytes=0, bytes_per_token=0, bytes_per_token_rank=0, bytes_per_param=0,
                     seconds_per_token=3e-4, seconds_per_step=0.5)
    schedule = Schedule(pack_steps=24, reached=(6,), finished=3, rung_events=2, final_events=2, curve_events=4,
                        curve_evals=9)
    rows, row_len, fixed, per_token = 10, 20.0, 0.01, 1e-4
    generation = math.ceil(rows / 8) * (2 * 33 * fixed + 3 * 8 * (row_len + 32) * per_token)
    final = math.ceil(rows / 4) * (2 * 2 * fixed + 3 * 4 * (row_len + 3) * per_token)
    rungs_and_curve = math.ceil(rows / 4) * ((2 + 4) * 2 * fixed + (6 + 9) * 4 * (row_len + 3) * per_token)
    seconds, line = eval_seconds(spec, mm, fixed, schedule, rows, row_len)
    assert seconds == pytest.approx(generation + final + rungs_and_curve)
    assert "generation of 32 tokens for 10 prompts, lossy on 10 rows for each of 3 finished trials" in line
    assert find(lossy).curve == "my_loss"


def test_the_user_code_an_entry_runs_is_named_by_the_registry_not_by_the_sweep() -> None:
    """``custom`` names its ``function``; a ``file.py:OBJECT`` entry names itself; a built-in runs no user code."""
    assert user_code("custom", {"function": "metrics.py:score"}) == "metrics.py:score"
    assert user_code("ev.py:EV", {}) == "ev.py:EV"
    assert user_code("my_pkg.evals:JUDGE") == "my_pkg.evals:JUDGE"
    assert all(user_code(e.name, {}) is None for e in EVALUATORS if e.name != "custom")
