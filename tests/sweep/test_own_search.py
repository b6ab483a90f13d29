"""An Axolotl or torchtune config with no ``search:`` runs as a study around its own values (``_own_search``)."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import pytest
import yaml
from optuna.trial import TrialState

from lora_sweep.sweep.config.loader import load_study
from lora_sweep.sweep.config.space import baseline_params
from lora_sweep.sweep.study import run_study
from tests.conftest import optuna_study
from tests.helpers import foreign_config

AXOLOTL_MODULES = ("gate_proj", "down_proj", "up_proj", "q_proj", "v_proj", "k_proj", "o_proj")


def _without_search(path: Path, **changes: object) -> Path:
    """The config at ``path`` as people have it: no search: and no budget: of ours; ``changes`` set (None: gone)."""
    doc = {k: v for k, v in yaml.safe_load(path.read_text()).items() if k not in ("search", "budget")}
    doc = {k: v for k, v in {**doc, **changes}.items() if k not in changes or changes[k] is not None}
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def _space(spec) -> dict[str, object]:  # noqa: ANN001
    return {p.name: (p.low, p.high, p.log) if p.kind == "float" else p.choices for p in spec.search.params}


def test_an_axolotl_config_without_search_runs_around_its_own_values_its_own_trial_first(
        tiny_dirs, tmp_path, caplog) -> None:  # noqa: ANN001
    path = _without_search(foreign_config(tmp_path, tiny_dirs("llama"), "axolotl-lora-1b.yml"))
    with caplog.at_level(logging.WARNING):
        spec = load_study(path)
    said = [r.getMessage() for r in caplog.records if "no search: block" in r.getMessage()]
    assert said == ["axolotl-lora-1b.yml: no search: block: searching around the config's own values (rank [8, 16, "
                    "32]; alpha_ratio [1, 2, 4]; lr 4e-05..0.001 (log); dropout [0, 0.05, 0.1]; targets [own (7 "
                    "modules), all-linear]); the config's own trial is the baseline; budget 20 trials unless budget: "
                    "says otherwise"]
    assert _space(spec) == {"rank": (8, 16, 32), "alpha_ratio": (1.0, 2.0, 4.0), "lr": (4e-5, 1e-3, True),
                            "dropout": (0.0, 0.05, 0.1), "targets": ("own", "all-linear")}
    assert set(spec.search.target_sets["own"]) == set(AXOLOTL_MODULES)
    assert spec.budget.trials == 20 and spec.budget.wall_time is None
    spec = dataclasses.replace(spec, budget=dataclasses.replace(spec.budget, trials=2))
    run_study(spec, log=lambda m: None)
    trials = optuna_study(spec.out_dir, spec.name).get_trials()
    assert [t.state for t in trials] == [TrialState.COMPLETE] * 2
    own, default = trials
    assert own.user_attrs.get("baseline") and not own.user_attrs.get("default")  # the config's own trial, first
    assert own.params == {"rank": 16, "alpha_ratio": 2.0, "lr": 2e-4, "dropout": 0.05, "targets": "own"}
    assert default.user_attrs.get("default") and default.params["targets"] == "all-linear"
    from lora_sweep.reports.html import write_report

    html = write_report(spec.out_dir).read_text()
    assert "<h2>Gain over the config baseline (the config&#x27;s own hyperparameters)</h2>" in html


def test_a_torchtune_config_without_search_searches_around_its_rank_alpha_lr_dropout_and_modules(
        tiny_dirs, tmp_path) -> None:  # noqa: ANN001
    path = _without_search(foreign_config(tmp_path, tiny_dirs("llama"), "torchtune-1B-lora.yaml"))
    spec = load_study(path)
    assert _space(spec) == {"rank": (32, 64, 128), "alpha_ratio": (1.0, 2.0, 4.0), "lr": (6e-5, 1.5e-3, True),
                            "dropout": (0.0, 0.05), "targets": ("own", "all-linear")}
    assert set(spec.search.target_sets["own"]) == {"q_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    assert spec.budget.trials == 20
    # the file's lora_alpha: 128 is the baseline's (alpha_ratio 2 at rank 64), not a fixed alpha beside the draw
    assert baseline_params(spec.search, spec.baseline) == (
        {"rank": 64, "alpha_ratio": 2.0, "lr": 3e-4, "dropout": 0.0, "targets": "own"}, "")


@pytest.mark.parametrize(("overrides", "searched", "trials"), [
    (["search.lora_r=[4,8]"], {"rank"}, 4),  # the override's search alone (4 trials for its one dimension)
    (["budget.trials=3"], {"rank", "alpha_ratio", "lr", "dropout", "targets"}, 3),
])
def test_the_default_search_and_budget_give_way_to_the_users(tiny_dirs, tmp_path, overrides, searched,
                                                              trials) -> None:  # noqa: ANN001
    path = _without_search(foreign_config(tmp_path, tiny_dirs("llama"), "axolotl-lora-1b.yml"))
    spec = load_study(path, overrides)
    assert {p.name for p in spec.search.params} == searched
    assert spec.budget.trials == trials


def test_a_file_budget_is_kept_and_a_config_on_every_linear_layer_keeps_its_targets(tiny_dirs, tmp_path) -> None:  # noqa: ANN001
    path = _without_search(foreign_config(tmp_path, tiny_dirs("llama"), "axolotl-lora-1b.yml"),
                           budget={"trials": 5}, lora_target_linear=True, lora_target_modules=None)
    spec = load_study(path)
    assert spec.budget.trials == 5
    assert "targets" not in {p.name for p in spec.search.params} and spec.train.targets == ("all-linear",)
