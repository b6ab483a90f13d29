"""What Optuna (and optuna-dashboard) sees as a trial's intermediate values is the pruner's metric."""

from __future__ import annotations

import pytest

from lora_sweep.store.api import ResultsStore
from lora_sweep.sweep.config.loader import load_study
from lora_sweep.sweep.study import run_study
from tests.conftest import optuna_study, write_study


def test_intermediate_values_are_the_rung_metric_not_the_training_loss(tiny_dirs, tmp_path) -> None:
    spec = load_study(write_study(tmp_path, tiny_dirs("llama"), name="rungs", budget={"trials": 3},
                                  objectives=[{"metric": "eval_loss", "direction": "minimize"}],
                                  evaluators=["heldout_loss"]))
    run_study(spec, log=lambda m: None)
    trials = optuna_study(spec.out_dir, "rungs").get_trials()
    with ResultsStore(spec.out_dir / "results.db", create=False) as store:
        curves = store.curves()
        for t in trials:
            rung = {e.step: e.value for e in store.evals(trial=t.number, kind="rung")}
            assert sorted(rung) == [6], rung  # every trial met the one rung
            assert t.intermediate_values == pytest.approx(rung)  # held-out loss at the rung, nothing else
            losses = [row.loss for row in curves[t.number]]
            assert len(losses) >= 6  # the training loss is kept in results.db, step by step
            assert all(v != pytest.approx(loss) for v in t.intermediate_values.values() for loss in losses)
