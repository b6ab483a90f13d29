"""The train settings: ``TrainSpec``, the searchable names and the key aliases, all from the ``TrainSpec`` rows of
``fields.yaml`` (``SETTINGS``; the file also holds every other study-file key's meaning and aliases, ``FIELDS``).

A setting that is a ``packer.plan.AdapterSpec`` field takes its type, default and check from there (the packer owns
them); the others (``alpha_ratio``, ``epochs``, ...) are resolved before an adapter is built and are declared in
``_OWN``. Adding an AdapterSpec field means adding its row (``tests/sweep/test_settings.py`` fails until it is).
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Callable
from dataclasses import MISSING, dataclass, field, fields, make_dataclass
from pathlib import Path
from typing import Any, Literal

import yaml

from lora_sweep.errors import ConfigError
from lora_sweep.packer.api import AdapterSpec, variants

__all__ = ["Setting", "SETTINGS", "SEARCHABLE", "RANGED", "TRAIN_ALIASES", "FORMATS", "FIELDS", "TrainSpec",
           "check_value", "rule", "table"]


@functools.cache
def table(name: str) -> Any:
    """A data file of this folder (``fields.yaml``, ``foreign.yaml``), read as YAML once (not to be changed)."""
    return yaml.load(Path(__file__).with_name(name).read_text(encoding="utf-8"),
                     Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))


FIELDS: dict[str, dict[str, dict[str, Any]]] = table("fields.yaml")
"""Dataclass name -> field name -> its row of ``fields.yaml`` (``doc``, ``aliases``, ``amount``, ...)."""
FORMATS = ("axolotl", "torchtune", "peft", "hf", "other")
"""Where a train alias comes from: Axolotl, torchtune, PEFT's ``LoraConfig``, HF Trainer / TRL, a short spelling."""


def _check(ok: bool, key: str, rule: str, value: object) -> None:
    if not ok:
        raise ConfigError(f"{key}: {rule} (got {value!r})")


def _is_num(x: object) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)


def whole(low: int = 1, null: bool = False) -> Callable[[Any], bool]:
    """A value's test: an int (not a bool) >= ``low``, or null where ``null``."""
    return lambda v: (null and v is None) or (isinstance(v, int) and not isinstance(v, bool) and v >= low)


def rule(test: Callable[[Any], bool], text: str, default: Any = MISSING, **metadata: Any) -> Any:
    """A dataclass field that ``_params.check_fields`` checks with ``test``; ``text`` is the rule its error states."""
    return field(default=default, metadata={"rule": (test, text), **metadata})


@dataclass(frozen=True)
class Setting:
    """One train setting: a ``TrainSpec`` row of ``fields.yaml`` (its columns are described there)."""

    name: str
    doc: str
    search: Literal["range", "choices"] | None = "range"
    axolotl: str = ""
    torchtune: str = ""
    peft: str = ""
    hf: str = ""
    other: str = ""

    @property
    def aliases(self) -> dict[str, str]:
        """Alias -> format, for every name the other tools give this setting."""
        out: dict[str, str] = {}
        for fmt in FORMATS:
            for alias in getattr(self, fmt).split():
                out.setdefault(alias, fmt)
        return out


SETTINGS = tuple(Setting(name, **row) for name, row in FIELDS["TrainSpec"].items())
"""Every train setting, in the order of ``TrainSpec``'s fields and of the reference page."""
_POSITIVE = (lambda v: _is_num(v) and v > 0, "must be > 0")
_OWN: dict[str, tuple[str, Any]] = {
    "alpha_ratio": ("float | None", rule(*_POSITIVE, None)),
    "epochs": ("float | None", rule(*_POSITIVE, None)),
    "max_steps_per_epoch": ("int | None", rule(whole(), "must be an int >= 1", None)),
    "warmup_ratio": ("float | None", rule(lambda v: _is_num(v) and 0 <= v < 1, "must be in [0, 1)", None)),
    "eval_every": ("int | None", rule(whole(), "must be an int >= 1", None)),
    "optimizer_in_backward": ("bool", rule(lambda v: isinstance(v, bool), "must be true or false", False)),
}
"""The settings that are not AdapterSpec fields: (type, field with its rule; null, where the type allows it, is not
tested)."""
SEARCHABLE = tuple(s.name for s in SETTINGS if s.search)
"""Names a study may search."""
RANGED = tuple(s.name for s in SETTINGS if s.search == "range")
"""Searchable names that take a range as well as a list of values."""
TRAIN_ALIASES = {alias: s.name for s in SETTINGS for alias in s.aliases}
"""Alias -> setting name, the other tools' spellings (``lora_r`` -> ``rank``)."""
NOT_IN_BACKWARD = {"max_grad_norm": ("null", "clipping needs the whole gradient before the step"),
                   "gradient_accumulation_steps": ("1", "the step needs every micro-batch's gradient first")}
"""What ``optimizer_in_backward`` needs, and why: no clipping and one micro-batch per step."""


def check_value(name: str, key: str, value: object) -> None:
    """Validate one value of setting ``name`` (its own check, or AdapterSpec's rules), reported at ``key``."""
    if name in _OWN:
        test, text = _OWN[name][1].metadata["rule"]
        _check(test(value), key, text, value)
        return
    try:
        AdapterSpec(**{name: value})  # type: ignore[arg-type]
    except ConfigError as e:
        raise ConfigError(f"{key}: {str(e).partition(': ')[2]}") from None


_COMBINED = (*variants.FIELDS, "dropout")
"""The settings the variants' rules weigh together: their own, and dropout (PiSSA / OLoRA need dropout 0)."""


def variant_specs(values_of: Callable[[str], set[Any]], searched: set[str], base: dict[str, Any]) -> list[AdapterSpec]:
    """Every adapter a study can propose, as far as the variants tell them apart: each product of the searched
    ``_COMBINED`` settings' values (``values_of``: choices, or a range's ends) over the fixed ``base``
    (``TrainSpec.adapter_values``).

    Raises:
        ConfigError: a product the packer refuses (LoRA-FA with DoRA, PiSSA with dropout), so that no trial fails on
            one mid-run.
    """
    names = [n for n in _COMBINED if n in searched]
    specs = []
    for combo in itertools.product(*(sorted(values_of(n), key=repr) for n in names)):
        try:
            specs.append(AdapterSpec(**{**base, **dict(zip(names, combo, strict=True))}))
        except ConfigError as e:
            proposed = ", ".join(f"{n}: {v}" for n, v in zip(names, combo, strict=True))
            raise ConfigError(f"search: can propose {proposed}, which is refused ({e})") from None
    return specs


_ADAPTER = {f.name: f for f in fields(AdapterSpec)}


def _post_init(self: Any) -> None:
    for name in _OWN:  # an unset optional one (null) has nothing to check
        if getattr(self, name) is not None or not _OWN[name][0].endswith(" | None"):
            check_value(name, name, getattr(self, name))
    if self.optimizer_in_backward:
        for key, (needed, why) in NOT_IN_BACKWARD.items():
            value = getattr(self, key)
            _check(str(value if value is not None else "null") == needed, "optimizer_in_backward",
                   f"needs train.{key}: {needed} ({why})", value)
    object.__setattr__(self, "init", AdapterSpec(**self.adapter_values()).init)  # PEFT's true: kaiming


def _adapter_values(self: Any) -> dict[str, Any]:
    """These values as AdapterSpec keyword arguments (alpha from ``alpha_ratio`` when set)."""
    values = {s.name: getattr(self, s.name) for s in SETTINGS if s.name not in _OWN}
    if self.alpha_ratio is not None:
        values["alpha"] = float(self.alpha_ratio * self.rank)
    return values


def _field(name: str) -> tuple[str, str, Any]:
    if name in _OWN:
        return name, *_OWN[name]
    assert _ADAPTER[name].default is not MISSING, name
    return name, "str | bool" if name == "init" else str(_ADAPTER[name].type), field(default=_ADAPTER[name].default)


TrainSpec = make_dataclass(
    "TrainSpec", [_field(s.name) for s in SETTINGS], frozen=True,
    namespace={"__post_init__": _post_init, "adapter_values": _adapter_values, "__module__": __name__,
               "__doc__": "Fixed values of every train setting that is not searched (defaults: AdapterSpec's); one "
                          "field per row of ``SETTINGS`` (``init`` also reads PEFT's ``true``: kaiming)."})
