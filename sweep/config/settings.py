"""The train settings, one row each: ``SETTINGS``, from which ``TrainSpec``, the searchable names, the key aliases
and the study-file reference (docs/study_reference.py) are derived.

A row names a setting, says what it means in a study file, whether and how it may be searched, and the names
Axolotl, torchtune, PEFT and HF Trainer give it. A setting that is an ``packer.plan.AdapterSpec`` field takes its
type, default and check from there (the packer owns them); the others (``alpha_ratio``, ``epochs``, ...) are
resolved before an adapter is built and carry their own. Adding an AdapterSpec field means adding its row here
(``tests/sweep/test_settings.py`` fails until it is).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import MISSING, dataclass, field, fields, make_dataclass
from typing import Any, Literal

from lora_sweep.errors import ConfigError
from lora_sweep.packer.api import AdapterSpec, variants

__all__ = ["Setting", "SETTINGS", "SEARCHABLE", "RANGED", "TRAIN_ALIASES", "FORMATS", "TrainSpec", "check_value"]

FORMATS = ("axolotl", "torchtune", "peft", "hf", "other")
"""Where an alias comes from: Axolotl, torchtune, PEFT's ``LoraConfig``, HF Trainer / TRL, or a short spelling."""


def _check(ok: bool, key: str, rule: str, value: object) -> None:
    if not ok:
        raise ConfigError(f"{key}: {rule} (got {value!r})")


def _is_num(x: object) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)


def whole(low: int = 1, null: bool = False) -> Callable[[Any], bool]:
    """A value's test: an int (not a bool) >= ``low``, or null where ``null``."""
    return lambda v: (null and v is None) or (isinstance(v, int) and not isinstance(v, bool) and v >= low)


@dataclass(frozen=True)
class Setting:
    """One train setting: a key of a study file's ``train:`` (and of ``search:`` when searchable)."""

    name: str
    """The key, an AdapterSpec field where there is one (``rank`` is PEFT's ``r``)."""
    doc: str
    """What the setting does, one sentence or a few: the study-file reference's meaning column."""
    search: Literal["range", "choices"] | None = "range"
    """How it may be searched: a range or a list (``range``), a list only (``choices``), or not at all (None)."""
    axolotl: str = ""
    """Axolotl's names of it, space-separated (each also read at a config's top level)."""
    torchtune: str = ""
    """torchtune's names of it."""
    peft: str = ""
    """PEFT's ``LoraConfig`` names of it."""
    hf: str = ""
    """HF Trainer's / TRL's names of it."""
    other: str = ""
    """Short spellings."""
    type: str = ""
    """Annotation text (``"float | None"``); "": the AdapterSpec field's."""
    default: Any = None
    """Default of a setting that is not an AdapterSpec field (an AdapterSpec field's default is AdapterSpec's)."""
    check: tuple[Callable[[Any], bool], str] | None = None
    """(test, rule) of a value of a setting that is not an AdapterSpec field (null, where the type allows it, is not
    tested); an AdapterSpec field is checked by AdapterSpec."""

    @property
    def aliases(self) -> dict[str, str]:
        """Alias -> format, for every name the other tools give this setting."""
        out: dict[str, str] = {}
        for fmt in FORMATS:
            for alias in getattr(self, fmt).split():
                out.setdefault(alias, fmt)
        return out


SETTINGS: tuple[Setting, ...] = (
    Setting("rank", "LoRA rank r, 1..256.", axolotl="lora_r", torchtune="lora_rank", peft="r"),
    Setting("alpha", "LoRA alpha (ignored when ``alpha_ratio`` is set or searched).", axolotl="lora_alpha",
            torchtune="lora_alpha", peft="lora_alpha"),
    Setting("alpha_ratio", "If set: alpha = alpha_ratio * rank for every trial.", other="alpha_rank_ratio",
            type="float | None", check=(lambda v: _is_num(v) and v > 0, "must be > 0")),
    Setting("rslora", "Scale by alpha/sqrt(r) instead of alpha/r.", "choices", axolotl="peft_use_rslora",
            peft="use_rslora"),
    Setting("dropout", "LoRA dropout, in [0, 1).", axolotl="lora_dropout", torchtune="lora_dropout",
            peft="lora_dropout"),
    Setting("targets", "Module names to adapt, or ``all-linear``.", "choices", axolotl="lora_target_modules",
            torchtune="lora_attn_modules", peft="target_modules"),
    Setting("lr", "Peak learning rate of AdamW.", axolotl="learning_rate", hf="learning_rate"),
    Setting("weight_decay", "AdamW decoupled weight decay."),
    Setting("betas", "AdamW betas.", None),
    Setting("eps", "AdamW epsilon.", None, hf="adam_epsilon"),
    Setting("warmup_steps", "Linear warm-up steps.", torchtune="num_warmup_steps", other="warmup"),
    Setting("schedule", "Learning-rate schedule after warm-up (``packer.plan.SCHEDULES``).", "choices",
            axolotl="lr_scheduler", hf="lr_scheduler_type", other="scheduler"),
    Setting("max_steps", "Optimizer steps per trial.", other="steps"),
    Setting("micro_batch", "Sequences per step per trial.", axolotl="micro_batch_size", torchtune="batch_size",
            hf="per_device_train_batch_size"),
    Setting("max_grad_norm", "Per-trial gradient clipping (null: none).", torchtune="clip_grad_norm",
            other="gradient_clipping"),
    Setting("gradient_accumulation_steps", "Micro-batches per optimizer step (the step's loss: the mean over all "
            "their target tokens).", other="grad_accum"),
    Setting("sample_packing", "Pack several examples per row up to ``data.max_length`` tokens "
            "(``packer.data.packing``).", "choices", torchtune="packed"),
    Setting("lr_ratio", "LoRA+: B's learning rate over A's (PEFT's ``loraplus_lr_ratio``; 1: plain LoRA).",
            axolotl="loraplus_lr_ratio"),
    Setting("dora", "DoRA: a trained per-column magnitude over the direction of W + s B A (PEFT's ``use_dora``).",
            "choices", axolotl="peft_use_dora", torchtune="use_dora", peft="use_dora"),
    Setting("init", "A's and B's initialisation (``packer.plan.INITS``; PEFT's ``init_lora_weights``, whose "
            "``true`` is ``kaiming``).", "choices", axolotl="peft_init_lora_weights", peft="init_lora_weights",
            type="str | bool"),
    Setting("lorafa", "LoRA-FA: A frozen at its initialisation, B trained with the projected gradient (PEFT's "
            "``create_lorafa_optimizer``; ``packer.variants.lorafa``).", "choices"),
    Setting("epochs", "Train each trial for this many passes over the training data: its optimizer steps are "
            "``ceil(epochs * ceil(micro-batches per epoch / gradient_accumulation_steps))``; a ``max_steps`` set in "
            "the file (fixed or searched) overrides it, as in HF Trainer.", None, axolotl="num_epochs",
            hf="num_train_epochs", type="float | None", check=(lambda v: _is_num(v) and v > 0, "must be > 0")),
    Setting("max_steps_per_epoch", "With ``epochs``: at most this many optimizer steps per epoch (torchtune's "
            "``max_steps_per_epoch``).", None, type="int | None",
            check=(whole(), "must be an int >= 1")),
    Setting("warmup_ratio", "Warm-up over ``ceil(warmup_ratio * max_steps)`` steps, once a trial's steps are known "
            "(HF Trainer's rule; a non-zero ``warmup_steps`` wins).", None, type="float | None",
            check=(lambda v: _is_num(v) and 0 <= v < 1, "must be in [0, 1)")),
    Setting("eval_every", "Score each trial's held-out loss every this many optimizer steps (a curve in the store, "
            "kind ``curve``; with one objective also Optuna's intermediate values, instead of the training loss).",
            None, hf="eval_steps", type="int | None",
            check=(whole(), "must be an int >= 1")),
    Setting("optimizer_in_backward", "torchtune's ``optimizer_in_bwd``, mapped onto the one training step "
            "(``packer.step.train``): the same AdamW updates, taken after the backward from the step's preallocated "
            "fp32 gradient buffer, so the memory saving (4 B per adapter parameter) is not taken; a warning says so. "
            "Needs ``max_grad_norm: null`` and ``gradient_accumulation_steps: 1``, not searched.", None,
            torchtune="optimizer_in_bwd", type="bool", default=False,
            check=(lambda v: isinstance(v, bool), "must be true or false")),
)
"""Every train setting, in the order of ``TrainSpec``'s fields and of the reference page."""

_ROW = {s.name: s for s in SETTINGS}
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
    own = _ROW[name].check if name in _ROW else None
    if own is not None:
        _check(own[0](value), key, own[1], value)
        return
    try:
        AdapterSpec(**{name: value})  # type: ignore[arg-type]
    except ConfigError as e:
        raise ConfigError(f"{key}: {str(e).partition(': ')[2]}") from None


def check_variant_combinations(values_of: Callable[[str], set[Any]], searched: set[str], base: dict[str, Any]) -> None:
    """Refuse a search that can propose a combination of variant settings the packer refuses (LoRA-FA with DoRA):
    every product of the searched variant settings' values (``values_of``: choices, or a range's ends) over the fixed
    ``base`` (``TrainSpec.adapter_values``) must be an ``AdapterSpec``, so no trial fails on one mid-run."""
    names = [n for n in variants.FIELDS if n in searched]
    for combo in itertools.product(*(sorted(values_of(n), key=repr) for n in names)):
        try:
            AdapterSpec(**{**base, **dict(zip(names, combo, strict=True))})
        except ConfigError as e:
            proposed = ", ".join(f"{n}: {v}" for n, v in zip(names, combo, strict=True))
            raise ConfigError(f"search: can propose {proposed}, which is refused ({e})") from None


_ADAPTER = {f.name: f for f in fields(AdapterSpec)}
_OWN = tuple(s.name for s in SETTINGS if s.name not in _ADAPTER)
"""Settings that are not AdapterSpec fields (resolved into rank/alpha or steps per trial, or options of the packed
training loop)."""


def _post_init(self: Any) -> None:
    for name in _OWN:  # an unset optional one (null) has nothing to check
        if getattr(self, name) is not None or not _ROW[name].type.endswith(" | None"):
            check_value(name, name, getattr(self, name))
    if self.optimizer_in_backward:
        for key, (needed, why) in NOT_IN_BACKWARD.items():
            value = getattr(self, key)
            _check(str(value if value is not None else "null") == needed, "optimizer_in_backward",
                   f"needs train.{key}: {needed} ({why})", value)
    object.__setattr__(self, "init", AdapterSpec(**self.adapter_values()).init)  # PEFT's true: kaiming


def _adapter_values(self: Any) -> dict[str, Any]:
    """These values as AdapterSpec keyword arguments (alpha from ``alpha_ratio`` when set)."""
    values = {name: getattr(self, name) for name in _ROW if name not in _OWN}
    if self.alpha_ratio is not None:
        values["alpha"] = float(self.alpha_ratio * self.rank)
    return values


def _field(s: Setting) -> tuple[str, str, Any]:
    adapter = _ADAPTER.get(s.name)
    default = s.default if adapter is None else adapter.default
    assert default is not MISSING, s.name
    return s.name, s.type or str(adapter.type), field(default=default, metadata={"doc": s.doc, "setting": s})


TrainSpec = make_dataclass(
    "TrainSpec", [_field(s) for s in SETTINGS], frozen=True,
    namespace={"__post_init__": _post_init, "adapter_values": _adapter_values, "__module__": __name__,
               "__doc__": "Fixed values of every train setting that is not searched (defaults: AdapterSpec's); one "
                          "field per row of ``SETTINGS``."})
