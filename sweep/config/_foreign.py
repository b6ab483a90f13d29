"""Axolotl and torchtune training configs as study files: their keys -> our sections, before ``loader``.

An Axolotl LoRA config (``base_model``, ``datasets``, ``adapter``, ...) or a torchtune LoRA recipe config (``model:
{_component_: ...lora_...}``, ``dataset``, ``optimizer``, ...) plus our own ``search:``, ``budget:`` and
``objectives:`` is rewritten into a study file's mapping; the keys they share with ours (``lora_r``,
``learning_rate``, ``sequence_len``, ...) are left to ``loader``'s aliases. Every other key is a row of
``foreign.yaml`` (docs/guides/foreign-configs.md has the table): translated, refused in one error naming it, or
dropped and named in one warning; the functions here are the rules its rows name (``RULES``).
"""

from __future__ import annotations

import hashlib
import logging
import random
import re
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lora_sweep.errors import ConfigError, first_line
from lora_sweep.store.directory import atomic_write_text
from lora_sweep.sweep.config._own_search import around
from lora_sweep.sweep.config._yaml import Doc, Key, kind_of
from lora_sweep.sweep.config.settings import SETTINGS, TRAIN_ALIASES, table
from lora_sweep.sweep.config.strategy import _NAME
from lora_sweep.sweep.config.tracking import axolotl_trackers, torchtune_trackers

__all__ = ["translate", "split_overrides", "is_foreign"]

logger = logging.getLogger(__name__)

_T = table("foreign.yaml")
_AXOLOTL_ONLY, _DEFAULT_ONLY, _FORMATS = _T["axolotl_only"], _T["default_only"], _T["formats"]
_INFRA, _IDENTITY = set(_T["infra"]), set(_T["identity"])
_INFRA_PREFIXES, _OPTIMIZERS, _8BIT = (tuple(_T[k]) for k in ("infra_prefixes", "optimizers", "optimizers_8bit"))
_TT_TARGETS, _TT_HELD_OUT = _T["torchtune_targets"], _T["torchtune_held_out"]
_TT_BUILDERS: dict[str, dict[str, dict[Key, Any]]] = {
    part: {name: {tuple(k.split(".")): v for k, v in sets.items()} for name, sets in builders.items()}
    for part, builders in _T["torchtune_builders"].items()}
_MISSING = object()
_SKIP = object()


def _moves(fmt: str) -> dict[Key, dict[str, Any]]:
    """``foreign.yaml``'s moves of ``fmt`` by source key path."""
    return {tuple(k.split(".")): row for k, row in _T[f"{fmt}_moves"].items()}


AXOLOTL = _moves("axolotl")
TORCHTUNE = _moves("torchtune") | {  # a component's option that names a train setting: the settings' torchtune column
    (part, name): {"to": f"train.{s.name}"} for part in ("model", "optimizer", "lr_scheduler", "dataset")
    for s in SETTINGS for name in (s.name, *s.torchtune.split())}


def _move(out: _Out, table: Mapping[Key, Mapping[str, Any]], src: Key, value: Any) -> bool:
    """Move ``src`` by its row of ``table`` (``foreign.yaml``'s moves); False when it has none."""
    if src not in table:
        return False
    row = table[src]
    if "values" in row:
        if not isinstance(value, Hashable) or value not in row["values"]:
            raise out.error(src, f"must be one of {', '.join(row['values'])} (got {value!r})")
        value = _SKIP if row["values"][value] is None else row["values"][value]  # null: nothing is written
    elif "rule" in row:
        value = RULES[row["rule"]](value)
    if row["to"] is None:
        out.dropped.append(".".join(map(str, src)))
    elif value is not _SKIP:
        out.put(tuple(row["to"].split(".")), value, src)
    return True


@dataclass
class _Out:
    """The translated mapping, with the line of every moved key, and the dropped keys."""

    doc: Doc
    data: dict[str, Any]
    dropped: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    """Every refusal of the file, so one run names them all (``translate`` raises them together)."""
    warnings: list[str] = field(default_factory=list)
    """What runs otherwise than written (an 8-bit optimizer as fp32 AdamW, ...): said once the file is accepted (a
    refused file gets its refusals only)."""

    def warn(self, message: str) -> None:
        self.warnings.append(message)

    def attempt(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)``, or True when it refused the key: its ``ConfigError`` is kept in ``errors`` instead of
        raised (and the key counts as handled: nothing else reads it)."""
        try:
            return fn(*args)
        except ConfigError as err:
            self.errors.append(str(err))
            return True

    def put(self, dest: Key, value: Any, src: Key) -> None:
        """Write ``value`` at ``dest`` (a section left null becomes a mapping), located at ``src``'s line."""
        node = self.data
        for i, part in enumerate(dest[:-1]):
            if node.get(part) is None:
                node[part] = {}
            elif not isinstance(node[part], dict):  # the file's own ``train: 5`` where a translated key goes
                raise self.error(dest[:i + 1], f"must be a mapping (got {node[part]!r})")
            node = node[part]
        node[dest[-1]] = value
        line = self.doc.lines.get(src)
        for i in range(1, len(dest) + 1):
            if line is not None:
                self.doc.lines.setdefault(dest[:i], line)

    def error(self, src: Key, rule: str) -> ConfigError:
        return ConfigError(f"{self.doc.where(src)}: {'.'.join(map(str, src))}: {rule}")


def is_foreign(data: dict[str, Any]) -> bool:
    """Whether ``data`` is an Axolotl or torchtune config (not a study file)."""
    return _kind(data) is not None


def _kind(data: dict[str, Any]) -> str | None:
    """``torchtune``, ``axolotl`` or None (a study file)."""
    model = data.get("model")
    if isinstance(model, dict) and "_component_" in model:
        return "torchtune"
    return "axolotl" if any(k in data for k in _AXOLOTL_ONLY) else None


def split_overrides(data: dict[str, Any], overrides: Sequence[str], top: Sequence[str]) -> tuple[list[str], list[str]]:
    """(the config's own, the study file's) ``dotted.key=value`` overrides of an Axolotl or torchtune config.

    An override naming a key the config holds (``model.lora_rank``, ``device``, ``sequence_len``) or one its format
    reads that is none of our sections (``dtype``, ``batch_size``) is the config's own: applied before the
    translation, as the format's own command line would (``tune run ... device=cpu``). The others are applied
    to the study mapping after it. A study file's overrides are all its own (the second list).
    """
    kind = _kind(data)
    if kind is None:
        return [], list(overrides)
    reads = ({*_T["torchtune_rules"], *(k[0] for k in TORCHTUNE), *TRAIN_ALIASES} if kind == "torchtune"
             else {*_AXOLOTL_ONLY, "optimizer", "output_dir", "warmup_ratio"})
    own, ours = [], []
    for text in overrides:
        parts = text.partition("=")[0].strip().split(".")
        node: Any = data
        for part in parts:
            node = node.get(part, _MISSING) if isinstance(node, dict) else _MISSING
        held = node is not _MISSING
        first = parts[0]
        named = first not in top and (first in reads or first in _DEFAULT_ONLY or _infra(first))
        (own if held or named else ours).append(text)
    return own, ours


def translate(doc: Doc, data: dict[str, Any], aliases: Mapping[str, str], top: Sequence[str],
              known: Sequence[str] = (), train: Sequence[str] = (), default_search: bool = True) -> dict[str, Any]:
    """``data`` itself when it is a study file; else the study mapping of an Axolotl or torchtune config.

    A config with no ``search:`` (nor W&B ``parameters:``) searches around its own values
    (``sweep.config._own_search``), and one line says what is searched; ``default_search`` False (an override
    sets ``search.*``): the overrides' search alone.

    The config's own value of a searched setting is dropped from the fixed ones (the search decides it) and
    kept in ``baseline:``, the trial of the config's own hyperparameters (``aliases`` maps the train aliases,
    ``lora_r`` -> ``rank``; ``top`` names our top-level keys, which are never dropped; ``known`` every
    top-level key the loader reads, so an unknown one is named with the other refusals; ``train`` the train
    fields, the baseline's keys).

    Raises:
        ConfigError: keys ask for something not supported: every such key of the file, one line each
            (file:line: key: rule), under a first line that counts them.
    """
    kind = _kind(data)
    if kind is None:
        return data
    out = _torchtune(doc, data) if kind == "torchtune" else _axolotl(doc, data)
    for key in [k for k in out.data if known and k not in known]:
        out.errors.append(str(doc.unknown((), key, list(top), [*known, *sorted(_INFRA | _IDENTITY)])))
    if out.errors:
        many = len(out.errors) > 1
        head = f"{doc.file}: {len(out.errors)} settings of this config cannot run here:\n" if many else ""
        raise ConfigError(head + "\n".join(out.errors))
    for message in out.warnings:
        logger.warning("%s: %s", doc.file, message)
    _trackers(out, data, kind)
    if "baseline" not in out.data:
        out.data["baseline"] = _own_values(out.data, aliases, top, train)
    if default_search and "search" not in out.data and "parameters" not in out.data:
        _search_around(out, _own_values(out.data, aliases, top, train))
    search = out.data.get("search")
    searched = {aliases.get(str(k), str(k)) for k in search} if isinstance(search, dict) else set()
    if "alpha_ratio" in searched:  # alpha = alpha_ratio * rank: the config's fixed alpha would contradict the draw
        searched.add("alpha")
    for k in [k for k in out.data if k not in top and aliases.get(k, k) in searched]:
        del out.data[k]
    if isinstance(out.data.get("train"), dict):
        out.data["train"] = {k: v for k, v in out.data["train"].items() if aliases.get(k, k) not in searched}
    if out.dropped:
        logger.warning("%s: ignored (identity, logging, hardware or infrastructure keys; the math is unchanged): %s",
                       doc.file, ", ".join(out.dropped))
    return out.data


def _trackers(out: _Out, data: dict[str, Any], kind: str) -> None:
    """The config's W&B / MLflow keys (Axolotl) or ``metric_logger`` (torchtune) as ``trackers:`` (unless the
    file gives ``trackers:`` itself); the tracker keys that map are no longer named as ignored."""
    if kind == "torchtune":
        entries, ignored = torchtune_trackers(data.get("metric_logger")) if "metric_logger" in data else ([], [])
        used = ["metric_logger"] if entries else []
        out.dropped += ignored if entries else []
    else:
        entries, used = axolotl_trackers(data)
    out.dropped = [k for k in out.dropped if k not in used]
    if entries and "trackers" not in out.data:
        out.put(("trackers",), entries, (used[0],))


def _search_around(out: _Out, own: dict[str, Any]) -> None:
    """The default search around the config's ``own`` values, said in one line (``loader`` gives the budget)."""
    out.data["search"], line = around(own)
    logger.warning("%s: %s", out.doc.file.name, line)


def _own_values(data: dict[str, Any], aliases: Mapping[str, str], top: Sequence[str],
                train: Sequence[str]) -> dict[str, Any]:
    """The config's own hyperparameters by train field (``lr``, ``rank``, ``targets``, ...): the values its author
    trained with, before the search replaces the searched ones."""
    own = {aliases.get(k, k): v for k, v in data.items() if k not in top and v is not None}
    if data.get("lora_target_linear"):  # Axolotl: every linear layer
        own["targets"] = "all-linear"
    section = data.get("train")
    if isinstance(section, dict):  # a train: that is no mapping is refused by the loader, naming its line
        own |= {aliases.get(k, k): v for k, v in section.items() if v is not None}
    return {k: v for k, v in own.items() if k in train}


def _infra(key: str) -> bool:
    return key in _INFRA or key in _IDENTITY or key.startswith(_INFRA_PREFIXES)


def _common(out: _Out, key: str, value: Any) -> bool:
    """Keys both formats treat alike; True when handled."""
    if key == "seed" and value is None:  # both formats: null is "pick one"; the study's default seed is 0
        out.dropped.append("seed")
        return True
    if key in _DEFAULT_ONLY:
        if value not in (None, False, "", [], {}):
            raise out.error((key,), f"{_DEFAULT_ONLY[key]} (got {value!r})")
        return True
    if key == "special_tokens" and isinstance(value, dict) and set(value) - {"pad_token"}:
        other = sorted(set(value) - {"pad_token"})[0]
        raise out.error((key, other), "only pad_token is supported (a new bos/eos token changes the targets)")
    if _infra(key):
        out.dropped.append(key)
        return True
    if key == "load_in_8bit":
        if value not in (None, False):
            # LLM.int8 quantizes the frozen base to save memory; the base then runs at its own dtype, the weights
            # int8 approximates (as an 8-bit optimizer runs as the fp32 AdamW it approximates).
            out.warn("load_in_8bit: the base runs unquantized at its dtype (the weights LLM.int8 approximates; "
                     "an 8-bit base is not built)")
        return True
    return False


def _keep(out: _Out, key: str, value: Any) -> None:
    """A key of ours or a shared alias, for ``loader`` to read (it refuses unknown keys); a section of ours
    (``data:``, ``train:``) is merged with what the translation put there."""
    if isinstance(value, dict) and isinstance(out.data.get(key), dict):
        out.data[key] = {**value, **out.data[key]}
    else:
        out.data[key] = value


def _keys(out: _Out, data: dict[str, Any], fmt: str, skip: Sequence[str] = ()) -> _Out:
    """Each top-level key of ``data`` (but ``skip``, read by the caller) by the rules both formats share
    (``_common``), its own rule (``foreign.yaml``'s ``<fmt>_rules``) or its move; any other is kept for ``loader``."""
    rules, moves = _T[f"{fmt}_rules"], AXOLOTL if fmt == "axolotl" else TORCHTUNE
    for key, value in data.items():
        if key in skip or out.attempt(_common, out, key, value):
            continue
        if key in rules:
            out.attempt(RULES[rules[key]], out, key, value)
        elif not out.attempt(_move, out, moves, (key,), value):
            _keep(out, key, value)
    return out


def _axolotl(doc: Doc, data: dict[str, Any]) -> _Out:
    out = _keys(_Out(doc, {}), data, "axolotl")
    if data.get("lora_target_linear") and data.get("lora_target_modules"):
        # Axolotl adapts the listed modules and every linear layer: all of them, as lora_target_linear alone
        del out.data["lora_target_modules"]
    if "adam_beta1" in data or "adam_beta2" in data:
        betas = [data.get("adam_beta1", 0.9), data.get("adam_beta2", 0.999)]
        out.put(("train", "betas"), betas, ("adam_beta1",) if "adam_beta1" in data else ("adam_beta2",))
    if "warmup_ratio" in data and data.get("warmup_steps"):
        del out.data["warmup_ratio"]
        out.warn(f"warmup_ratio is ignored: warmup_steps {data['warmup_steps']} wins (HF Trainer's rule)")
    if not out.errors:  # a refused dataset has nothing to split
        out.attempt(_val_split, out, data)
    return out


def _datasets(out: _Out, key: str, value: Any) -> None:
    if not isinstance(value, list) or not value:
        raise out.error(("datasets",), f"must be a list of {{path, type}} (got {value!r})")
    if len(value) > 1:
        raise out.error(("datasets", 1), "only one dataset is supported; concatenate the files")
    entry = value[0] if isinstance(value[0], dict) else {"path": value[0]}
    for k in entry:
        if k not in ("path", "type", "ds_type", "split", "data_files"):
            raise out.error(("datasets", 0, k), "is not supported (a dataset is a local JSON-lines file and a type)")
    if entry.get("split", "train") != "train":
        raise out.error(("datasets", 0, "split"), f"only the train split of a local file (got {entry['split']!r})")
    out.dropped += [f"datasets.0.{k}" for k in ("ds_type", "split") if k in entry]  # a local file, its one split
    path = entry.get("data_files") or entry.get("path")
    out.put(("data", "train"), _local_file(out, path, ("datasets", 0, "path")), ("datasets", 0, "path"))
    fmt = entry.get("type", "auto")
    if not isinstance(fmt, str) or fmt not in (*_FORMATS, "auto"):
        raise out.error(("datasets", 0, "type"), f"must be one of {', '.join(_FORMATS)} (got {fmt!r})")
    out.put(("data", "format"), _FORMATS.get(fmt, fmt), ("datasets", 0, "type"))


def _local_file(out: _Out, path: Any, src: Key) -> str:
    """The absolute path of a local data file; a hub dataset name is refused."""
    if isinstance(path, list) and len(path) == 1:
        path = path[0]
    if not isinstance(path, str) or not path:
        raise out.error(src, f"must be the path of a local JSON-lines file (got {path!r})")
    full = out.doc.local(path, src)
    if kind_of(full) == "file":
        return str(full)
    if re.fullmatch(r"[\w.-]+/[\w.-]+", path) and not path.endswith((".json", ".jsonl")):
        raise out.error(src, f"only local files work; {path!r} looks like a hub dataset: download it to a "
                             "JSON-lines file and give its path")
    raise out.error(src, f"file not found: {full} (only local JSON-lines files work)")


def _optimizer(out: _Out, key: str, value: Any) -> None:
    if value in _8BIT:
        # 8-bit AdamW approximates AdamW with quantised moments to save optimizer memory; for LoRA-sized
        # adapters that memory is small, so the exact fp32 AdamW it approximates runs instead.
        out.warn(f"optimizer {value} runs as fp32 AdamW (the update 8-bit AdamW approximates)")
    elif value not in _OPTIMIZERS and value is not None:
        raise out.error((key,), f"only AdamW is supported ({', '.join(_OPTIMIZERS + _8BIT)}; got {value!r})")


def _val_split(out: _Out, data: dict[str, Any], size: Any = None) -> None:
    """``val_set_size`` (or ``size``): a seeded split of the training file into train and eval files (written
    once)."""
    size = data.get("val_set_size") if size is None else size
    if not size:
        return
    ok = isinstance(size, int | float) and not isinstance(size, bool) and size > 0
    if not ok or (isinstance(size, float) and size >= 1 and not size.is_integer()):
        raise out.error(("val_set_size",), f"must be a fraction in (0, 1) or a number of rows (got {size!r})")
    section = out.data.get("data")
    if not isinstance(section, dict) or "train" not in section:
        raise out.error(("val_set_size",), "needs datasets (a local file) to split")
    src = Path(_local_file(out, section["train"], ("data", "train")))
    try:
        raw = src.read_bytes()  # once: its lines are split, and its bytes name the split
        lines = [line for line in raw.decode("utf-8-sig").splitlines() if line.strip()]
    except (OSError, UnicodeDecodeError) as e:
        raise out.error(("data", "train"), f"cannot be read to split it ({first_line(e)})") from None
    n_val = round(size * len(lines)) if size < 1 else int(size)
    if not 1 <= n_val < len(lines):
        raise out.error(("val_set_size",), f"leaves no train or no eval row of {len(lines)} (got {size!r})")
    seed = data.get("seed", 0) or 0
    order = list(range(len(lines)))
    random.Random(f"{seed}:val_set_size").shuffle(order)
    val = set(order[:n_val])
    digest = hashlib.sha256(f"{seed}:{n_val}:".encode() + raw).hexdigest()[:12]
    name, output = data.get("name"), out.data.get("output")
    name = name if isinstance(name, str) and _NAME.fullmatch(name) else out.doc.file.stem  # a bad one: refused later
    folder = Path(output if isinstance(output, str) and output else Path("runs") / name) / "val-split"
    for part, keep in (("train", lambda i: i not in val), ("eval", lambda i: i in val)):
        path = (folder / f"{part}-{digest}.jsonl").resolve()
        try:
            if kind_of(path) != "file":
                folder.mkdir(parents=True, exist_ok=True)
                atomic_write_text(path, "".join(line + "\n" for i, line in enumerate(lines) if keep(i)))
        except OSError as e:
            raise out.error(("val_set_size",), f"cannot write the split into {folder} ({e.strerror})") from None
        out.put(("data", part), str(path), ("val_set_size",))


def _torchtune(doc: Doc, data: dict[str, Any]) -> _Out:
    out = _keys(_Out(doc, {}), data, "torchtune", skip=("checkpointer", "tokenizer"))
    ckpt = data.get("checkpointer") if isinstance(data.get("checkpointer"), dict) else {}
    if "checkpointer" not in data:
        out.errors.append(str(out.error(("model",), "a torchtune config needs checkpointer.checkpoint_dir (the HF "
                                                    "checkpoint)")))
    elif "HFCheckpointer" not in str(ckpt.get("_component_", "")):
        out.errors.append(str(out.error(("checkpointer", "_component_"),
                                        "only Hugging Face checkpoints (FullModelHFCheckpointer)")))
    else:
        out.put(("model", "path"), ckpt.get("checkpoint_dir"), ("checkpointer", "checkpoint_dir"))
    if data.get("optimizer_in_bwd") and data.get("clip_grad_norm") is not None:  # torchtune refuses it too
        out.errors.append(str(out.error(("clip_grad_norm",), f"must be null with optimizer_in_bwd: true (clipping "
                                        f"needs the whole gradient before the step; got {data['clip_grad_norm']!r})")))
    if "clip_grad_norm" not in data:  # torchtune's recipes clip only when clip_grad_norm is set; our default is 1.0
        out.put(("train", "max_grad_norm"), None, ("optimizer_in_bwd",) if data.get("optimizer_in_bwd") else ())
    held = out.data.get("data")
    if not out.errors and isinstance(held, dict) and "train" in held and "eval" not in held:
        # torchtune's LoRA recipes evaluate nothing; a study ranks its trials on held-out data
        out.warn(f"no held-out data in the config: a seeded {round(100 * _TT_HELD_OUT)}% of dataset.data_files is "
                 "held out as data.eval (give data.eval to choose it)")
        out.attempt(_val_split, out, data, _TT_HELD_OUT)
    tok = data.get("tokenizer") or {}
    if not isinstance(tok, dict):
        out.errors.append(str(out.error(("tokenizer",), f"must be a mapping with a _component_ (got {tok!r})")))
        tok = {}
    if tok.get("max_seq_len") is not None:
        out.put(("data", "max_length"), tok["max_seq_len"], ("tokenizer", "max_seq_len"))
    # the checkpoint's own tokenizer is used; max_seq_len null: data.max_length's default applies
    out.dropped += [f"tokenizer.{k}" for k in tok if k != "max_seq_len" or tok[k] is None]
    out.dropped += [f"checkpointer.{k}" for k in ckpt if k not in ("_component_", "checkpoint_dir")]
    return out


def _component(out: _Out, value: Any, key: str) -> tuple[dict[str, Any], str]:
    if not isinstance(value, dict) or not isinstance(value.get("_component_"), str):
        raise out.error((key,), "must be a mapping with a _component_")
    return value, value["_component_"].rsplit(".", 1)[-1]


def _tt_model(out: _Out, key: str, value: Any) -> None:
    cfg, name = _component(out, value, "model")
    if name.startswith("qlora_") or cfg.get("quantize_base"):  # torchtune's QLoRA: torchao's NF4, as here
        out.put(("model", "quantize"), "nf4", ("model", "_component_"))
    if not name.startswith(("lora_", "qlora_")):
        raise out.error(("model", "_component_"),
                        f"only LoRA model builders (lora_*, qlora_*) are supported (got {name})")
    for k, v in cfg.items():
        src = ("model", k)
        if k in ("_component_",):
            continue
        if k == "lora_attn_modules":
            if not isinstance(v, list):
                raise out.error(src, f"must be a list of attention modules ({', '.join(_TT_TARGETS)}; got {v!r})")
            bad = [m for m in v if not isinstance(m, str) or m not in _TT_TARGETS]
            if bad:
                raise out.error(src, f"unknown attention module {bad[0]!r} (expected {', '.join(_TT_TARGETS)})")
        elif _move(out, TORCHTUNE, src, v):
            continue
        elif k == "apply_lora_to_output" and v:
            raise out.error(src, "is not supported yet")
        elif k not in _T["torchtune_builder_options"]:
            raise out.error(src, "is not a LoRA builder option this engine knows")
    targets = [_TT_TARGETS[m] for m in cfg.get("lora_attn_modules", [])]
    if cfg.get("apply_lora_to_mlp"):
        targets += _T["torchtune_mlp_targets"]
    if not targets:
        raise out.error(("model", "lora_attn_modules"), "no module to adapt")
    out.put(("train", "targets"), targets, ("model", "lora_attn_modules"))


def _tt_dataset(out: _Out, key: str, value: Any) -> None:
    cfg = _tt_component(out, key, value, handled=("data_files",))
    if cfg.get("source") not in ("json", None) or "data_files" not in cfg:
        raise out.error(("dataset",), "only local files work: give source: json and data_files (the builder would "
                                      "download a hub dataset)")
    src = ("dataset", "data_files")
    out.put(("data", "train"), _local_file(out, cfg["data_files"], src), src)


def _tt_component(out: _Out, key: str, value: Any, handled: Sequence[str] = ()) -> dict[str, Any]:
    """A component of ``_TT_BUILDERS`` (its builder sets what its row says) whose options each move by a row of
    ``TORCHTUNE``, but those ``handled`` by the caller; returns the component's mapping."""
    cfg, name = _component(out, value, key)
    builders = _TT_BUILDERS[key]
    if name not in builders:
        raise out.error((key, "_component_"), f"{name} is not supported (expected {', '.join(builders)})")
    for dest, v in builders[name].items():
        out.put(dest, v, (key, "_component_"))
    for k, v in cfg.items():
        if k not in ("_component_", *handled) and not _move(out, TORCHTUNE, (key, k), v):
            raise out.error((key, k), "is not supported")
    return cfg


def _tt_shuffle(out: _Out, key: str, value: Any) -> None:
    if value is False:
        raise out.error(("shuffle",), "false is not supported (each slot draws a seeded shuffle)")
    out.dropped.append("shuffle")  # true: what every slot does


RULES: dict[str, Callable[..., Any]] = {
    # conversions of a move's value
    "bool": bool, "when_set": lambda v: _SKIP if v is None else v, "nf4_when_true": lambda v: "nf4" if v else _SKIP,
    # a key's own rule: (out, key, value)
    "datasets": _datasets, "optimizer": _optimizer, "later": lambda out, key, value: None,
    "model_builder": _tt_model, "dataset_builder": _tt_dataset, "shuffle": _tt_shuffle, "component": _tt_component,
}
"""The functions ``foreign.yaml``'s rows name (``rule``)."""
_unknown = ({r["rule"] for r in [*AXOLOTL.values(), *TORCHTUNE.values()] if "rule" in r}
            | {*_T["axolotl_rules"].values(), *_T["torchtune_rules"].values()}) - set(RULES)
if _unknown:
    raise ImportError(f"sweep/config/foreign.yaml names rules _foreign.RULES lacks: {', '.join(sorted(_unknown))}")
