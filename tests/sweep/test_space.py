"""SearchSpace -> trials: suggestions as AdapterSpecs, the default trial.

Run: python -m pytest tests/sweep/test_space.py -q
"""

from __future__ import annotations

import subprocess
import sys

import optuna
import pytest

from lora_sweep.errors import ConfigError
from lora_sweep.packer.plan import AdapterSpec
from lora_sweep.sweep.config.space import adapter_spec, default_params
from lora_sweep.sweep.config.spec import Param, SamplerSpec, SearchSpace, TrainSpec
from lora_sweep.sweep.sampling import make_sampler, suggest
from tests.helpers import SETS, SPACE

optuna.logging.set_verbosity(optuna.logging.WARNING)

TRAIN = TrainSpec(max_steps=30, micro_batch=2, schedule="cosine")


def inside(space: SearchSpace, params: dict[str, object]) -> bool:
    for p in space.params:
        v = params[p.name]
        if p.kind == "categorical":
            ok = v in p.choices
        else:
            assert p.low is not None and p.high is not None
            ok = p.low <= v <= p.high and (p.step is None or (v - p.low) % p.step == 0)  # type: ignore[operator]
        if not ok:
            return False
    return set(params) == {p.name for p in space.params}


def test_suggest_and_adapter_spec_round_trip() -> None:
    study = optuna.create_study(sampler=make_sampler(SamplerSpec(), seed=0, space=SPACE))
    specs = {}
    for i in range(12):
        trial = study.ask()
        params = suggest(trial, SPACE)
        assert params == trial.params and inside(SPACE, params)
        spec = adapter_spec(params, TRAIN, seed=i, space=SPACE)
        assert spec.alpha == params["alpha_ratio"] * params["rank"]  # type: ignore[operator]
        assert spec.targets == SETS[params["targets"]]  # type: ignore[index]
        assert (spec.max_steps, spec.micro_batch, spec.schedule, spec.seed) == (30, 2, "cosine", i)
        specs[trial.number] = spec
        study.tell(trial, spec.lr * spec.rank)
    for frozen in study.trials:  # a stored trial rebuilds the same adapter
        assert adapter_spec(frozen.params, TRAIN, seed=frozen.number, space=SPACE) == specs[frozen.number]


def test_adapter_spec_fixed_alpha_ratio_and_errors() -> None:
    train = TrainSpec(alpha_ratio=2.0, targets=("c_attn",))
    spec = adapter_spec({"rank": 8}, train, seed=3, space=SPACE)
    assert (spec.rank, spec.alpha, spec.targets) == (8, 16.0, ("c_attn",))
    assert adapter_spec({}, TrainSpec(), seed=0, space=SPACE) == AdapterSpec()
    with pytest.raises(ConfigError, match="^betas2: not an adapter hyperparameter"):
        adapter_spec({"betas2": 1}, TRAIN, seed=0, space=SPACE)
    with pytest.raises(ConfigError, match="unknown target set"):
        adapter_spec({"targets": "mlp"}, TRAIN, seed=0, space=SPACE)


def test_default_trial_lands_inside_the_space() -> None:
    params = default_params(SPACE)
    assert params == {"rank": 16, "alpha_ratio": 2.0, "lr": 2e-4, "dropout": 0.0, "warmup_steps": 0, "targets": "all"}
    assert inside(SPACE, params)
    study = optuna.create_study(sampler=make_sampler(SamplerSpec(), seed=0, space=SPACE))
    study.enqueue_trial(params)
    trial = study.ask()
    assert suggest(trial, SPACE) == params
    spec = adapter_spec(params, TRAIN, seed=0, space=SPACE)
    assert (spec.rank, spec.alpha, spec.lr, spec.targets) == (16, 32.0, 2e-4, ("all-linear",))


def test_default_trial_snaps_or_gives_up() -> None:
    snapped = SearchSpace(
        (
            Param("rank", "categorical", choices=(4, 12, 64)),
            Param("lr", "float", low=1e-4, high=1e-3, step=3e-4),
            Param("targets", "categorical", choices=("attn",)),
            Param("micro_batch", "int", low=1, high=16, log=True),
            Param("max_steps", "int", low=20, high=60, step=20),
            Param("max_grad_norm", "categorical", choices=(None, 0.3, 0.5)),
        ),
        target_sets=SETS,
    )
    params = default_params(snapped)
    assert params is not None and inside(snapped, params)
    assert params["rank"] == 12 and params["lr"] == pytest.approx(1e-4) and params["targets"] == "attn"
    assert (params["micro_batch"], params["max_steps"], params["max_grad_norm"]) == (4, 60, 0.5)  # clamped
    assert default_params(SearchSpace((Param("lr", "float", low=1e-3, high=1e-2, log=True),))) is None
    assert default_params(SearchSpace((Param("rank", "categorical", choices=(32, 64)),))) is None


def test_the_config_layer_imports_no_optuna() -> None:
    """A study file's layer, the trials its space defines included, is read without Optuna: the sampler and the
    suggestions are the study's (``sweep.sampling``)."""
    code = ("import sys, lora_sweep.sweep.config.loader, lora_sweep.sweep.config.space; "
            "print(sorted(n for n in sys.modules if n.split('.')[0] == 'optuna'))")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and run.stdout.strip() == "[]", run.stdout + run.stderr
