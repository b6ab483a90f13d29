"""Study file -> ``StudySpec`` (``load_study``, the one way in): sections, key aliases, the W&B
``parameters:`` block, relocated flat keys.

The aliases (``fields.yaml``) are the names Axolotl, torchtune, PEFT and HF/TRL give the same settings.
Axolotl-style flat keys at the top level (``base_model``, ``lora_r``, ``learning_rate``,
``sequence_len``, ...) are moved into their section; W&B's ``method``, ``metric``, ``run_cap`` and
``parameters`` map onto ``sampler``, ``objectives``, ``budget.trials`` and ``search``. A whole Axolotl
or torchtune config is first rewritten into this shape by ``sweep/config/_foreign.py``.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import fields
from pathlib import Path
from typing import Any

from lora_sweep.evaluators.custom import is_file_target
from lora_sweep.sweep.config import _foreign
from lora_sweep.sweep.config._own_search import default_budget
from lora_sweep.sweep.config._yaml import (
    Doc,
    Item,
    Key,
    add,
    coerce,
    kind_of,
    make,
    override,
    read,
    scalar,
    section,
    typed,
)
from lora_sweep.sweep.config.settings import FIELDS, NOT_IN_BACKWARD, TRAIN_ALIASES
from lora_sweep.sweep.config.spec import (
    SEARCHABLE,
    Budget,
    Constraint,
    DataSpec,
    EvalSpec,
    ModelSpec,
    Objective,
    PackSpec,
    Param,
    PruningSpec,
    SamplerSpec,
    SearchSpace,
    StudySpec,
    TrackerSpec,
    TrainSpec,
)

__all__ = ["load_study"]

logger = logging.getLogger(__name__)

_TRAIN = TRAIN_ALIASES
"""Train alias -> setting (``fields.yaml``'s TrainSpec rows: Axolotl, torchtune, PEFT and HF names)."""
_SECTIONS = {"budget": Budget, "sampler": SamplerSpec, "pruning": PruningSpec, "pack": PackSpec}
"""Sections read field by field alone (the others have rules of their own below) -> their dataclass."""
_LISTS = {"objectives": Objective, "constraints": Constraint, "evaluators": EvalSpec, "trackers": TrackerSpec}
"""List sections -> the dataclass of one entry."""
_CLASSES = {"": StudySpec, "model": ModelSpec, "data": DataSpec, **_SECTIONS, **_LISTS}
_SHORT = {c: next((n for n, row in FIELDS[c.__name__].items() if row.get("short")), "") for c in _CLASSES.values()}
"""Dataclass -> the field a scalar written for its whole section stands for (``fields.yaml``'s ``short``), or ""."""
_ALIASES: dict[str, dict[str, str]] = {"train": _TRAIN, "search": _TRAIN, "parameters": _TRAIN} | {
    key: {a: name for name, row in FIELDS[cls.__name__].items() for a in row.get("aliases", ())}
    for key, cls in _CLASSES.items()}
"""Section -> {alias: field} (``fields.yaml``'s ``aliases``); ``""``, the top level: {alias: section}."""
_TRAIN_FIELDS = [f.name for f in fields(TrainSpec)]
_RELOCATE: dict[str, tuple[str, str]] = {
    **{k: ("train", _TRAIN.get(k, k)) for k in [*_TRAIN_FIELDS, *_TRAIN]},
    **{k: ("data", c) for k, c in _ALIASES["data"].items() if FIELDS["DataSpec"][c].get("flat")},
    "base_model": ("model", "path"),
    "lora_target_linear": ("train", "targets"),
}
"""Top-level Axolotl-style key -> (section, field)."""
_TOP = [*(f.name for f in fields(StudySpec) if f.init and f.name != "source"), "parameters", "method", "metric",
        "run_cap"]
"""The top-level keys read: StudySpec's fields (``source`` is where the file was read from) and W&B's
(``parameters`` -> ``search``, ``method`` -> ``sampler.name``, ``metric`` -> an objective, ``run_cap`` ->
``budget.trials``)."""
_WANDB = ["values", "value", "min", "max", "distribution", "q", "probabilities"]
_DISTRIBUTIONS = ("constant", "categorical", "uniform", "int_uniform", "q_uniform", "log_uniform_values", "log_uniform")


def load_study(path: str | Path, overrides: Sequence[str] = (), *, check_paths: bool = True) -> StudySpec:
    """Read, override and validate a study file.

    Args:
        path: The study YAML file.
        overrides: ``dotted.key=value`` strings applied on top of the file; values are YAML.
        check_paths: Require a local model directory to exist (False: for files whose model is built later).
            Data files are always checked.

    Returns:
        The validated study.

    Raises:
        ConfigError: One line, ``file:line: dotted.key: rule (got value)``.
    """
    path = Path(path)
    doc, data = read(path, check_paths)
    ours = [*_TOP, *_ALIASES[""]]
    own, overrides = _foreign.split_overrides(data, overrides, ours)  # an Axolotl/torchtune config's own keys
    for text in own:
        override(doc, data, text, {})
    searches = any(o.partition("=")[0].strip().startswith(("search", "parameters")) for o in overrides)
    foreign = _foreign.is_foreign(data)
    data = _foreign.translate(doc, data, _TRAIN, ours, [*ours, *_RELOCATE], _TRAIN_FIELDS,  # Axolotl/torchtune
                              default_search=not searches)
    for text in overrides:
        _drop_spellings(data, text)
        override(doc, data, text, _ALIASES)
    if foreign and not {"budget", "run_cap"} & set(data) and isinstance(data.get("search"), dict):
        data["budget"] = default_budget(data["search"])  # a training config has none: trials per searched dimension
    return _study(doc, data)


def _drop_spellings(data: dict[str, Any], text: str) -> None:
    """Remove from ``data`` every other spelling of the setting the override ``text`` sets, so the override
    replaces it: a top-level flat key (Axolotl's ``sequence_len``, torchtune's ``max_steps_per_epoch``) and its
    section's key (``data.max_length``), under any alias, either way round. A fixed ``train`` value and a
    searched one are one setting too: overriding either replaces the other. The mapping the override writes
    into is left to ``override``, which replaces an alias there itself."""
    key = text.partition("=")[0].strip()
    parts = key.split(".")
    if len(parts) == 1 and parts[0] in _RELOCATE:
        target: tuple[str, str] | None = _RELOCATE[parts[0]]
    elif len(parts) == 2 and parts[0] in ("train", "data", "model", "search", "parameters"):
        target = (parts[0], _ALIASES[parts[0]].get(parts[1], parts[1]))
    else:
        target = None
    if target is None:
        return
    section, name = target
    same = {section} | ({"train", "search", "parameters"} if section in ("train", "search", "parameters") else set())
    parent = tuple(parts[:-1])
    for k in [k for k in data if k != key and _RELOCATE.get(str(k), ("", ""))[1] == name
              and _RELOCATE[str(k)][0] in same]:
        del data[k]
    for sec in same:
        node = data.get(sec)
        if not isinstance(node, dict) or parent == (sec,):
            continue
        for k in [k for k in node if _ALIASES[sec].get(str(k), str(k)) == name]:
            del node[k]


def _items(doc: Doc, it: Item, canon: Key, cls: type, extra: Mapping[str, Item] = {}) -> dict:
    """The values of mapping ``it`` (a scalar: short for its ``_SHORT`` field) plus ``extra``, read as fields of
    ``cls`` (``_yaml.typed``), under their aliases of ``_ALIASES``."""
    short = _SHORT[cls]
    if short and it.value is not None and not isinstance(it.value, dict):
        items = {short: it}
        doc.note(canon + (short,), it.path)
    else:
        names = [f.name for f in fields(cls)]
        items = section(doc, it.value, it.path, canon, names, _ALIASES.get(str(canon[0]), {}))
    add(doc, items, canon, extra)
    return typed(doc, cls, items, canon)


def _study(doc: Doc, data: dict[str, Any]) -> StudySpec:
    top = section(doc, data, (), (), [*_TOP, *_RELOCATE], _ALIASES[""])
    moved: dict[str, dict[str, Item]] = {"train": {}, "data": {}, "model": {}}
    for k in [k for k in top if k in _RELOCATE]:
        it = top.pop(k)
        part, name = _RELOCATE[k]
        if k == "lora_target_linear":  # Axolotl: true means every linear layer
            if not it.value:
                continue
            it = Item("all-linear", it.path)
        add(doc, moved[part], (part,), {name: it})
    search, fixed = _search(doc, top)
    add(doc, moved["train"], ("train",), fixed)
    if top.get("pruning", Item(None, ())).value in (False, "none"):
        del top["pruning"]
    extra: dict[str, dict[str, Item]] = {"budget": {"trials": top["run_cap"]} if "run_cap" in top else {}}
    if "method" in top:  # W&B: method: bayes | random | grid
        m = top["method"]
        extra["sampler"] = {"name": Item({"bayes": "tpe"}.get(m.value, m.value) if isinstance(m.value, str)
                                         else m.value, m.path)}
    kw: dict[str, Any] = {
        "name": coerce(doc, top.pop("name", Item(doc.file.stem, ())).value, "str", ("name",)),
        "model": _model(doc, top, moved["model"]),
        "data": _data(doc, top, moved["data"]),
        "search": search,
        "train": _train(doc, top, moved["train"], search),
    }
    for key, cls in _SECTIONS.items():
        items = _items(doc, top.get(key, Item(None, (key,))), (key,), cls, extra.get(key, {}))
        kw[key] = make(doc, cls, (key,), **items)
    for key, cls in _LISTS.items():
        entries = _entries(doc, top, key)
        if entries is not None:
            kw[key] = tuple(_entry(doc, it, (key, i), cls) for i, it in enumerate(entries))
    kw |= typed(doc, StudySpec, {k: top[k] for k in ("description", "seed", "output", "storage", "artifacts")
                                 if k in top}, ())
    if "baseline" in top:
        kw["baseline"] = _baseline(doc, top["baseline"])
    return make(doc, StudySpec, (), source=doc.file, **kw)


def _baseline(doc: Doc, it: Item) -> dict[str, Any]:
    """``baseline:``: a mapping of train keys (any alias) to the values of the baseline trial."""
    if it.value is None:
        return {}
    items = section(doc, it.value, it.path, ("baseline",), _TRAIN_FIELDS, _TRAIN)
    return {k: i.value for k, i in items.items()}


def _required(doc: Doc, top: dict[str, Item], extra: dict[str, Item], key: str) -> dict:
    """The fields of section ``key``, whose ``short`` field is required (``fields.yaml``'s ``required`` says what)."""
    cls = _CLASSES[key]
    kw = _items(doc, top.get(key, Item(None, (key,))), (key,), cls, extra)
    if _SHORT[cls] not in kw:
        raise doc.error((key, _SHORT[cls]), f"is required ({FIELDS[cls.__name__][_SHORT[cls]]['required']})")
    return kw


def _model(doc: Doc, top: dict[str, Item], extra: dict[str, Item]) -> ModelSpec:
    canon = ("model",)
    kw = _required(doc, top, extra, "model")
    make(doc, ModelSpec, canon, **kw)  # the values first, then the files they name
    p, gguf_file = kw["path"], kw.get("gguf_file")
    is_gguf = Path(p).suffix.lower() == ".gguf"
    if is_gguf or gguf_file is not None:  # a GGUF checkpoint is always a local file
        full = doc.local(p, canon + ("path",))
        if is_gguf and gguf_file is not None:
            raise doc.error(canon + ("gguf_file",), f"is for a directory model.path; {p!r} is a .gguf file already")
        file = full / gguf_file if gguf_file is not None else full
        hub_like = gguf_file is not None and not p.startswith((".", "/", "~")) and re.fullmatch(r"[\w.-]+/[\w.-]+", p)
        if doc.check_paths and hub_like and kind_of(full) is None:
            raise doc.error(canon + ("path",), f"a GGUF checkpoint is read from a local file, not a hub repo; "
                                               f"download it first (not found: {file})")
        if doc.check_paths and kind_of(file) != "file":
            key, got = ("gguf_file", gguf_file) if gguf_file is not None and kind_of(full) == "dir" else ("path", p)
            raise doc.error(canon + (key,), f"GGUF file not found: {file} (got {got!r})")
        kw["path"] = str(full)
    elif p.startswith((".", "/", "~")) or kind_of(doc.file.parent / p) == "dir":  # a local path; else a hub id
        full = doc.local(p, canon + ("path",))
        if doc.check_paths and kind_of(full) != "dir":
            raise doc.error(canon + ("path",), f"local model directory not found: {full} (got {p!r})")
        kw["path"] = str(full)
    elif not re.fullmatch(r"[\w.-]+(/[\w.-]+)?", p):
        raise doc.error(canon + ("path",), f"is neither a hub id (org/name) nor a path starting with . / ~ (got {p!r})")
    return make(doc, ModelSpec, canon, **kw)


def _data(doc: Doc, top: dict[str, Item], extra: dict[str, Item]) -> DataSpec:
    canon = ("data",)
    kw = _required(doc, top, extra, "data")
    for key in ("train", "eval"):
        if kw.get(key) is not None:
            full = doc.local(str(kw[key]), canon + (key,))
            if kind_of(full) != "file":
                raise doc.error(canon + (key,), f"file not found: {full} (got '{kw[key]}')")
            kw[key] = full
    return make(doc, DataSpec, canon, **kw)


def _train(doc: Doc, top: dict[str, Item], extra: dict[str, Item], search: SearchSpace) -> TrainSpec:
    it = top.get("train", Item(None, ("train",)))
    items = section(doc, it.value, it.path, ("train",), _TRAIN_FIELDS, _TRAIN)
    add(doc, items, ("train",), extra)
    searched = {p.name for p in search.params}
    for name, it in items.items():
        if name in searched:
            raise doc.error(it.path, f"is fixed here but also searched (search.{name}); keep one")
    in_backward = items.get("optimizer_in_backward")
    clash = sorted(searched & set(NOT_IN_BACKWARD))
    if in_backward is not None and in_backward.value is True and clash:  # before TrainSpec's own check of them
        raise doc.error(in_backward.path, f"cannot be used with a searched {clash[0]} (it needs train.{clash[0]}: "
                                          f"{NOT_IN_BACKWARD[clash[0]][0]}, fixed)")
    for name in ("alpha", "alpha_ratio"):
        if name in items and {"alpha", "alpha_ratio"} <= set(items) | searched:
            raise doc.error(items[name].path, "set either alpha or alpha_ratio (alpha = alpha_ratio * rank)")
    if "epochs" in items and "max_steps" in set(items) | searched:  # HF Trainer: max_steps overrides epochs
        logger.warning("%s: train.max_steps is set, so train.epochs is ignored (max_steps overrides epochs)",
                       doc.file)
        del items["epochs"]
    return make(doc, TrainSpec, ("train",), **typed(doc, TrainSpec, items, ("train",)))


def _search(doc: Doc, top: dict[str, Item]) -> tuple[SearchSpace, dict[str, Item]]:
    """The search space, and the fixed values written in it (W&B ``value:``, plain scalars)."""
    items: dict[str, Item] = {}
    for name in ("parameters", "search"):
        if name in top:
            doc.note(("search",), top[name].path)
            add(doc, items, ("search",), section(doc, top[name].value, top[name].path, ("search",), SEARCHABLE, _TRAIN))
    params: list[Param] = []
    fixed: dict[str, Item] = {}
    sets: dict[str, tuple[str, ...]] = {}
    types = {f.name: str(f.type) for f in fields(TrainSpec)}
    for name, it in items.items():
        canon = ("search", name)
        kw = _targets(doc, it, sets) if name == "targets" else _dimension(doc, it, canon)
        if isinstance(kw, Item):
            fixed[name] = kw
            continue
        if "choices" in kw and name != "targets":  # null among them where the setting takes it
            kw["choices"] = coerce(doc, kw["choices"], f"tuple[{types[name]}, ...]", canon + ("choices",))
        base = types[name].removesuffix(" | None")
        numeric = base in ("int", "float")
        kind = kw.pop("kind", base if numeric else "float")
        for key in ("low", "high", "step"):
            if key in kw and numeric and kind != "categorical":
                kw[key] = coerce(doc, kw[key], kind, canon + (key,))
        params.append(make(doc, Param, canon, name=name, kind=kind, **kw))
    return make(doc, SearchSpace, ("search",), params=tuple(params), target_sets=sets), fixed


def _dimension(doc: Doc, it: Item, canon: Key) -> dict[str, Any] | Item:
    """Param arguments from a list, a ``{low, high, log, step}`` range or a W&B mapping; else a fixed Item."""
    v = it.value
    if isinstance(v, list):
        doc.note(canon + ("choices",), it.path)
        return {"kind": "categorical", "choices": v}
    if not isinstance(v, dict):
        return it
    return _wandb(doc, it, canon) if set(v) & set(_WANDB) else _range(doc, it, canon)


def _range(doc: Doc, it: Item, canon: Key) -> dict[str, Any]:
    s = section(doc, it.value, it.path, canon, ["low", "high", "log", "step", "choices"])
    if "choices" in s and len(s) > 1:
        raise doc.error(canon, "set either choices or a range (low, high, log, step)")
    if "choices" in s:
        doc.note(canon + ("choices",), s["choices"].path)
        return {"kind": "categorical", "choices": s["choices"].value}
    kw = {k: i.value for k, i in s.items()}
    if "log" in kw:
        kw["log"] = coerce(doc, kw["log"], "bool", canon + ("log",))
    return kw


def _wandb(doc: Doc, it: Item, canon: Key) -> dict[str, Any] | Item:
    """A W&B parameter: ``values``, ``value``, or ``min``/``max`` with a ``distribution``."""
    s = section(doc, it.value, it.path, canon, _WANDB)
    dist = coerce(doc, s["distribution"].value, "str", canon + ("distribution",)) if "distribution" in s else None
    if dist is not None and dist not in _DISTRIBUTIONS:
        raise doc.error(
            canon + ("distribution",), f"'{dist}' is not supported (use one of {', '.join(_DISTRIBUTIONS)})"
        )
    if "probabilities" in s:
        raise doc.error(canon + ("probabilities",), "is not supported (the sampler weighs the choices itself)")
    if "value" in s:
        return s["value"]
    if "values" in s:
        doc.note(canon + ("choices",), s["values"].path)
        if not isinstance(s["values"].value, list):
            raise doc.error(canon + ("choices",), f"must be a list (got {s['values'].value!r})")
        return {"kind": "categorical", "choices": s["values"].value}
    if dist in ("constant", "categorical"):
        raise doc.error(canon + ("distribution",), f"{dist} needs {'value' if dist == 'constant' else 'values'}")
    if "min" not in s or "max" not in s:
        raise doc.error(canon, "needs values, value, or min and max")
    doc.note(canon + ("low",), s["min"].path)
    doc.note(canon + ("high",), s["max"].path)
    kw: dict[str, Any] = {"low": s["min"].value, "high": s["max"].value}
    if dist is None:  # W&B infers int_uniform from integer bounds
        ints = all(isinstance(x, int) and not isinstance(x, bool) for x in kw.values())
        dist = "int_uniform" if ints else "uniform"
    if dist == "int_uniform":
        kw["kind"] = "int"
    if "q" in s and dist != "q_uniform":
        raise doc.error(canon + ("q",), "only used with distribution q_uniform (Optuna cannot combine log and step)")
    if dist == "q_uniform":
        doc.note(canon + ("step",), s["q"].path if "q" in s else it.path)
        kw["step"] = s["q"].value if "q" in s else 1.0
    if dist == "log_uniform":  # W&B: the bounds are exponents, samples are e^x
        kw = {k: math.exp(coerce(doc, x, "float", canon + (k,))) for k, x in kw.items()}
    kw["log"] = dist in ("log_uniform", "log_uniform_values")
    return kw


def _targets(doc: Doc, it: Item, sets: dict[str, tuple[str, ...]]) -> dict[str, Any] | Item:
    """Target-module sets: ``{name: modules}``, or a list of module lists (each named by its modules)."""
    canon: Key = ("search", "targets")
    v = it.value
    if isinstance(v, dict) and not set(v) & set(_WANDB):
        for name, modules in v.items():
            sets[str(name)] = coerce(doc, modules, "tuple[str, ...]", canon + (str(name),))
        return {"kind": "categorical", "choices": tuple(sets)}
    if isinstance(v, dict):
        d = _dimension(doc, it, canon)
        if isinstance(d, Item) or "choices" not in d:
            return d
        v = d["choices"]
    if not isinstance(v, list):
        return it
    for i, modules in enumerate(v):
        t = coerce(doc, modules, "tuple[str, ...]", canon + ("choices", i))
        sets["+".join(t)] = t
    return {"kind": "categorical", "choices": tuple(sets)}


def _entries(doc: Doc, top: dict[str, Item], key: str) -> list[Item] | None:
    """The items of a top-level list (or of a single value); W&B ``metric:`` is one objective."""
    if key == "objectives" and "metric" in top:
        m = top["metric"]
        if key in top:
            raise doc.error(m.path, "set either objectives or metric (W&B), not both")
        doc.note(("objectives", 0), m.path)
        return [m]
    if key not in top:
        return None
    it = top[key]
    if not isinstance(it.value, list):
        return [] if it.value is None else [it]
    return [Item(v, it.path + (i,)) for i, v in enumerate(it.value)]


def _entry(doc: Doc, it: Item, canon: Key, cls: type) -> Any:
    """One entry of a list section: a mapping of ``cls``'s fields, or its string form (``_string_entry``)."""
    if isinstance(it.value, str) or (cls is TrackerSpec and not isinstance(it.value, dict)):
        doc.note(canon, it.path)
        kw = _string_entry(doc, it, canon, cls)
    elif cls is TrackerSpec:  # its options beside its name
        if "name" not in it.value:
            raise doc.error(canon + ("name",), "is required (mlflow, wandb or tensorboard)")
        for k in it.value:
            doc.note(canon + (k,), it.path + (k,))
        kw = {"name": it.value["name"], "options": {k: v for k, v in it.value.items() if k != "name"}}
    else:
        kw = _items(doc, it, canon, cls)
    if cls is Objective:
        kw.setdefault("direction", None)
    if cls is EvalSpec:
        if kw.get("options", {}) is None:
            del kw["options"]
        elif not isinstance(kw.get("options", {}), dict):
            raise doc.error(canon + ("options",), f"must be a mapping (got {kw['options']!r})")
        if isinstance(kw.get("name"), str):
            kw["name"] = _code_path(doc, kw["name"])
        if isinstance(kw.get("options"), dict) and isinstance(kw["options"].get("function"), str):
            kw["options"] = {**kw["options"], "function": _code_path(doc, kw["options"]["function"])}
    return make(doc, cls, canon, **kw)


def _string_entry(doc: Doc, it: Item, canon: Key, cls: type) -> dict[str, Any]:
    """A list entry written as one string: ``maximize exact_match``, ``peak_mem_gb <= 20``, a bare evaluator or
    tracker name."""
    if cls is Objective:
        words = it.value.split()
        return typed(doc, Objective, {"direction": Item(words[0], it.path), "metric": Item(words[1], it.path)}
                     if len(words) == 2 else {"metric": it}, canon)
    if cls is Constraint:
        m = re.fullmatch(r"\s*([\w.-]+)\s*(<=|>=)\s*(\S+)\s*", it.value)
        if m is None:
            raise doc.error(it.path, f"must read 'metric <= value' or 'metric >= value' (got {it.value!r})")
        return {"metric": m[1], "op": m[2], "value": coerce(doc, scalar(m[3]), "float", canon)}
    if cls is TrackerSpec:
        doc.note(canon + ("name",), it.path)
    return {"name": it.value}


def _code_path(doc: Doc, spec: str) -> str:
    """``file.py:OBJECT`` with a relative file taken from the study file's folder, as every path the file names."""
    target, sep, name = spec.rpartition(":")
    if not sep or not is_file_target(target) or target.startswith(("/", "~")):
        return spec
    return f"{doc.local(target, ('evaluators',))}:{name}"
