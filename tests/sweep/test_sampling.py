"""The study's Optuna sampler (``sweep.sampling.make_sampler``) and the grid sampler of an ask-and-tell study.

Run: python -m pytest tests/sweep/test_sampling.py -q
"""

from __future__ import annotations

import itertools

import optuna
import pytest

from lora_sweep.errors import ConfigError
from lora_sweep.sweep.config.spec import Param, SamplerSpec, SearchSpace
from lora_sweep.sweep.sampling import make_sampler, suggest
from tests.helpers import SETS, SPACE


def test_tpe_is_explicitly_constant_liar_and_multivariate() -> None:
    sampler = make_sampler(SamplerSpec(n_startup_trials=3), seed=0, space=SPACE)
    assert isinstance(sampler, optuna.samplers.TPESampler)
    assert sampler._constant_liar and sampler._multivariate and sampler._n_startup_trials == 3


@pytest.mark.parametrize(
    ("name", "cls"),
    [
        ("random", optuna.samplers.RandomSampler),
        ("gp", optuna.samplers.GPSampler),
        ("nsga2", optuna.samplers.NSGAIISampler),
    ],
)
def test_other_samplers(name: str, cls: type) -> None:
    assert isinstance(make_sampler(SamplerSpec(name=name), seed=0, space=SPACE), cls)  # type: ignore[arg-type]


def test_grid_sampler_covers_the_grid() -> None:
    space = SearchSpace(
        (
            Param("rank", "categorical", choices=(4, 8)),
            Param("micro_batch", "int", low=1, high=3),
            Param("dropout", "float", low=0.0, high=0.1, step=0.05),
            Param("targets", "categorical", choices=("attn", "all")),
        ),
        target_sets=SETS,
    )
    sampler = make_sampler(SamplerSpec(name="grid"), seed=0, space=space)
    study = optuna.create_study(sampler=sampler)
    study.enqueue_trial({"rank": 8, "micro_batch": 2, "dropout": 0.05, "targets": "all"})  # the default, say
    while sampler.left(study):  # ask and tell, as a sweep runs: Optuna's GridSampler raised in tell
        trial = study.ask()
        study.tell(trial, float(len(str(suggest(trial, space)))))
    seen = {tuple(t.params[p.name] for p in space.params) for t in study.trials}
    assert len(study.trials) == 2 * 3 * 3 * 2, "each point once, the enqueued one included"
    assert seen == set(itertools.product((4, 8), (1, 2, 3), (0.0, 0.05, 0.1), ("attn", "all")))
    with pytest.raises(ConfigError, match="^lr: grid sampler needs"):
        make_sampler(SamplerSpec(name="grid"), seed=0, space=SPACE)
