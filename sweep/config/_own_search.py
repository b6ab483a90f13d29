"""The search an Axolotl or torchtune config gets when it brings no ``search:``: one around its own values.

Someone who hands a training config to a sweep engine expects it to try the neighbours of their settings: the
config's own rank, alpha / rank, learning rate, dropout and target modules are the centre (docs/guides/
foreign-configs.md has the table of what is searched around each). A value the config leaves out is AdapterSpec's.
A foreign config's budget, unless it gives one, is ``TRIALS_PER_DIMENSION`` trials per searched dimension
(``loader``); the config's own trial is the study's baseline (``translate`` keeps it in ``baseline:``), trained first.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from lora_sweep.packer.api import AdapterSpec, supported

__all__ = ["TRIALS_PER_DIMENSION", "LR_SPAN", "around", "default_budget"]

TRIALS_PER_DIMENSION = 4
"""Trials of the default budget per searched dimension: 20 for all five, so that Optuna's TPE, which draws its
first 10 trials at random (``n_startup_trials``), models as many more from what they scored."""
LR_SPAN = 5.0
"""The learning rate is searched on a log scale from ``lr / LR_SPAN`` to ``lr * LR_SPAN``."""


def default_budget(search: Mapping[str, Any]) -> dict[str, int]:
    """The ``budget:`` of a foreign config that gives none: ``TRIALS_PER_DIMENSION`` trials per searched dimension."""
    return {"trials": TRIALS_PER_DIMENSION * max(1, len(search))}


def around(own: Mapping[str, Any]) -> tuple[dict[str, Any], str]:
    """The ``search:`` mapping centred on ``own`` (a config's hyperparameters by train field), and the one line that
    says what is searched (with ``default_budget``'s trials).

    ``targets`` is searched only when the config adapts a subset of the layers (its own set or all of them);
    a config already on ``all-linear`` keeps it fixed.
    """
    base = AdapterSpec()
    rank = _positive(own.get("rank"), base.rank)
    alpha = _positive(own.get("alpha"), base.alpha)
    lr = _positive(own.get("lr"), base.lr)
    dropout = own.get("dropout") if isinstance(own.get("dropout"), int | float) else base.dropout
    ratio = alpha / rank
    search: dict[str, Any] = {
        "rank": sorted({max(1, int(rank) // 2), int(rank), 2 * int(rank)}),
        "alpha_ratio": [ratio / 2, ratio, ratio * 2],  # exact: the config's own ratio must be a choice
        "lr": {"low": _num(lr / LR_SPAN), "high": _num(lr * LR_SPAN), "log": True},
        "dropout": sorted({0.0, float(dropout), _num(min(2 * dropout, 0.5)) if dropout else 0.05}),
    }
    targets = own.get("targets", base.targets)
    modules = [targets] if isinstance(targets, str) else list(targets or [])
    if modules and modules != [supported.ALL_LINEAR]:
        search["targets"] = {"own": modules, supported.ALL_LINEAR: supported.ALL_LINEAR}
    trials = default_budget(search)["trials"]
    said = "; ".join(f"{k} {_text(v)}" for k, v in search.items())
    line = (f"no search: block: searching around the config's own values ({said}); the config's own trial is the "
            f"baseline; budget {trials} trials unless budget: says otherwise")
    return search, line


def _positive(value: Any, default: float) -> float:
    ok = isinstance(value, int | float) and not isinstance(value, bool) and value > 0
    return float(value) if ok else float(default)


def _num(x: float) -> float:
    """``x`` to 4 significant digits (the file's values stay readable in the report and the one line)."""
    return float(f"{x:.4g}")


def _text(value: Any) -> str:
    if isinstance(value, dict) and "low" in value:
        return f"{value['low']:g}..{value['high']:g} (log)"
    if isinstance(value, dict):
        return "[" + ", ".join(f"{k} ({len(v)} modules)" if isinstance(v, list) else k for k, v in value.items()) + "]"
    return "[" + ", ".join(f"{v:g}" for v in value) + "]"
