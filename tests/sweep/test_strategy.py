"""sweep/config/strategy.py: the study's objectives, constraints, budget, pruning and sampler validate themselves."""

from __future__ import annotations

import math

import pytest

from lora_sweep.errors import ConfigError
from lora_sweep.sweep.config.strategy import Budget, Constraint, Objective, PruningSpec, SamplerSpec


def test_budget_needs_one_positive_limit() -> None:
    with pytest.raises(ConfigError, match="set at least one of trials, wall_time, tokens"):
        Budget()
    with pytest.raises(ConfigError, match="wall_time: must be > 0"):
        Budget(trials=4, wall_time=0)
    assert Budget(tokens=10).tokens == 10


def test_constraint_violation_is_optunas_and_a_missing_metric_is_infeasible() -> None:
    le, ge = Constraint("adapter_params", "<=", 5000), Constraint("exact_match", ">=", 0.5)
    assert le.violation(4000) == -1000 and le.violation(6000) == 1000
    assert ge.violation(0.75) == -0.25 and ge.violation(0.25) == 0.25
    for missing in (None, math.nan, math.inf):
        assert le.violation(missing) == ge.violation(missing) == math.inf
    assert le.as_dict() == {"metric": "adapter_params", "op": "<=", "value": 5000.0}
    with pytest.raises(ConfigError, match="op: must be <= or >="):
        Constraint("x", "<", 1)


def test_objective_and_pruning_rules() -> None:
    with pytest.raises(ConfigError, match="direction: must be minimize or maximize"):
        Objective("eval_loss", "lower")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="rungs: must be increasing"):
        PruningSpec("cohort_sha", rungs=(10, 5))
    with pytest.raises(ConfigError, match="rungs: only used with kind cohort_sha"):
        PruningSpec("none", rungs=(5,))
    assert PruningSpec("cohort_sha", rungs=(5, 10), reduction_factor=2).rungs == (5, 10)


def test_sampler_options_belong_to_their_sampler() -> None:
    with pytest.raises(ConfigError, match="n_startup_trials: only used by tpe and gp"):
        SamplerSpec("random", n_startup_trials=3)
    with pytest.raises(ConfigError, match="population_size: only used by nsga2"):
        SamplerSpec("tpe", population_size=8)
    with pytest.raises(ConfigError, match="name: must be one of"):
        SamplerSpec("cmaes")  # type: ignore[arg-type]
