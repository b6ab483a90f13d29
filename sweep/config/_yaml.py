"""YAML with the line of every key, dotted overrides, type coercion and located one-line errors.

Helpers for ``sweep/config/loader.py``; of the study schema they know only the field table's units and
spellings (``fields.yaml``, in ``typed``). Keys are tracked
twice: *canonical* paths (``("train", "lr")``) name dataclass fields; *raw* paths
(``("learning_rate",)``) are what the user wrote, so an error points at the user's own key and
line: ``studies/x.yaml:12: search.rank.low: must be 1..256 (got -4)``.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Mapping, Sequence
from dataclasses import MISSING, fields
from pathlib import Path
from typing import Any, NamedTuple

import yaml

from lora_sweep.errors import ConfigError, first_line
from lora_sweep.sweep.config.settings import FIELDS

__all__ = ["Doc", "Item", "Key", "Loader", "add", "amount", "coerce", "dotted", "kind_of", "make", "override", "read",
           "scalar", "section", "typed"]

Key = tuple[str | int, ...]


class Loader(yaml.SafeLoader):
    """SafeLoader that also reads ``1e-4`` and ``5e3`` as floats (YAML 1.1 wants ``1.0e-4``)."""


Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float", re.compile(r"^[-+]?(?:\d[\d_]*)?\.?\d*[eE][-+]?\d+$"), list("-+.0123456789")
)


class Item(NamedTuple):
    """A value and the raw path where the user wrote it."""

    value: Any
    path: Key


def scalar(text: str) -> Any:
    """A value written as YAML, read like the study file (``"1e-4"`` -> 0.0001, ``"[4, 8]"`` -> [4, 8])."""
    return yaml.load(text, Loader=Loader)


def dotted(path: Key) -> str:
    return ".".join(map(str, path))


class Doc:
    """The study file: the line of every raw key, canonical -> raw paths, and keys set by overrides."""

    def __init__(self, file: Path, lines: dict[Key, int], check_paths: bool) -> None:
        self.file, self.lines, self.check_paths = file, lines, check_paths
        self.raw: dict[Key, Key] = {}
        self.overrides: dict[Key, str] = {}

    def note(self, canon: Key, raw: Key) -> None:
        """Record that canonical path ``canon`` was written as ``raw``."""
        self.raw[canon] = raw

    def where(self, raw: Key) -> str:
        """``file:line`` of the nearest written ancestor of ``raw``, or the override that set it."""
        for p, text in self.overrides.items():
            if raw[: len(p)] == p:
                return f"{self.file}: override '{text}'"
        line = next(self.lines[raw[:i]] for i in range(len(raw), -1, -1) if raw[:i] in self.lines)
        return f"{self.file}:{line}"

    def error(self, canon: Key, rule: str) -> ConfigError:
        """``file:line: raw.dotted.key: rule`` for a canonical (or raw) path."""
        raw = canon
        for i in range(len(canon), 0, -1):
            if canon[:i] in self.raw:
                raw = self.raw[canon[:i]] + canon[i:]
                break
        return ConfigError(f"{self.where(raw)}: {dotted(raw)}: {rule}" if raw else f"{self.where(raw)}: {rule}")

    def local(self, text: str, canon: Key) -> Path:
        """``text``, a path the file names, resolved from the file's folder (``~`` expanded), as ``canon``'s value.

        Raises:
            ConfigError: a path the system cannot take (``~user`` of no such user, a NUL byte).
        """
        try:
            return (self.file.parent / Path(text).expanduser()).resolve()
        except (RuntimeError, ValueError, OSError) as e:
            raise self.error(canon, f"is not a usable path ({first_line(e)}; got {text!r})") from None

    def unknown(self, raw: Key, key: object, names: Sequence[str], aliases: Sequence[str]) -> ConfigError:
        near = difflib.get_close_matches(str(key), [*names, *aliases], n=1)
        hint = f"did you mean '{near[0]}'?" if near else f"expected one of: {', '.join(names)}"
        where = f"in {dotted(raw)}" if raw else "at top level"
        return ConfigError(f"{self.where(raw + (str(key),))}: unknown key '{key}' {where} ({hint})")


def kind_of(path: Path) -> str | None:
    """``"file"``, ``"dir"`` or None: nothing there, or a name the system refuses (too long, a NUL byte), which a
    study's error then calls not found rather than a traceback."""
    try:
        return "dir" if path.is_dir() else "file" if path.is_file() else None
    except (OSError, ValueError):
        return None


def read(path: Path, check_paths: bool) -> tuple[Doc, dict[str, Any]]:
    """Parse a YAML mapping and the line of each of its keys (``yaml.compose``)."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such study file") from None
    except OSError as e:
        raise ConfigError(f"{path}: cannot read the study file ({e.strerror})") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        raise ConfigError(f"{path}:{line}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    try:
        root = yaml.compose(text, Loader=Loader)
        lines: dict[Key, int] = {(): 1}
        if root is not None:  # before the aliases are written out
            _walk(root, (), lines, {}, path)
        data = yaml.load(text, Loader=Loader)
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        raise ConfigError(f"{path}:{mark.line + 1 if mark else 1}: invalid YAML: {e.problem or e.context}") from None
    except yaml.YAMLError as e:  # the reader's own errors (a control character) carry no mark
        raise ConfigError(f"{path}: invalid YAML: {first_line(e)}") from None
    except RecursionError:
        raise ConfigError(f"{path}: nested too deep to read") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}:1: a study file is a mapping of keys (got {type(data).__name__})")
    return Doc(path, lines, check_paths), data


MAX_VALUES = 100_000
"""How many values a study file may hold with its aliases written out (a study file holds a few hundred): a file
of nested aliases (the "billion laughs") would otherwise expand without bound in memory and time."""


def _walk(node: yaml.Node, path: Key, lines: dict[Key, int], sizes: dict[int, int | None], file: Path) -> int:
    """Record the line of every key under ``node`` (at ``path``); return how many values ``node`` holds with its
    aliases written out, refusing more than ``MAX_VALUES`` or an alias inside its own anchor.

    An alias is the same node object as its anchor, so each node is walked once (``sizes``: node id -> its count,
    None while it is walked): the walk takes time linear in the file however far the aliases would expand, and a key
    under a repeated alias is located at the alias.
    """
    if id(node) in sizes:
        size = sizes[id(node)]
        if size is None:
            raise ConfigError(f"{file}:{node.start_mark.line + 1}: an alias refers to the value that holds it")
        return size
    sizes[id(node)] = None
    pairs = (node.value if isinstance(node, yaml.MappingNode)
             else list(enumerate(node.value)) if isinstance(node, yaml.SequenceNode) else [])
    total = 1
    for k, v in pairs:
        if isinstance(k, yaml.Node):  # a mapping's key, counted too
            total += _walk(k, path, {}, sizes, file)
            key, line = path + (str(k.value),), k.start_mark.line + 1
            if key in lines:
                raise ConfigError(f"{file}:{line}: {dotted(key)}: duplicate key")
        else:
            key, line = path + (k,), v.start_mark.line + 1
        lines[key] = line
        total += _walk(v, key, lines, sizes, file)
        if total > MAX_VALUES:
            raise ConfigError(f"{file}: its aliases expand to more than {MAX_VALUES:,} values (a study file "
                              f"holds a few hundred); write the values out or use fewer aliases")
    sizes[id(node)] = total
    return total


def override(doc: Doc, data: dict[str, Any], text: str, aliases: Mapping[str, Mapping[str, str]]) -> None:
    """Apply ``dotted.key=value`` (value read as YAML) to ``data``.

    A key that is an alias of a key already in the same mapping (``aliases[parent key]``, ``aliases[""]`` at the
    top level) replaces that key; a section written under its alias reads its keys' aliases under the section's own
    name (``packing.slots`` -> ``pack``'s table).
    """
    key, sep, raw_value = text.partition("=")
    text = text.replace("\r", "\\r").replace("\n", "\\n")  # as errors quote it: one line, however written
    if not sep or not key.strip():
        raise ConfigError(f"{doc.file}: override '{text}': expected dotted.key=value")
    try:
        value = scalar(raw_value)
    except yaml.YAMLError:
        raise ConfigError(f"{doc.file}: override '{text}': the value is not valid YAML") from None
    node: Any = data
    path: list[str | int] = []
    parts = key.strip().split(".")
    for i, part in enumerate(parts):
        k: str | int = part
        if isinstance(node, list) and part.isdigit() and int(part) < len(node):
            k = int(part)
        elif isinstance(node, dict):
            parent = str(path[-1]) if path else ""
            table = aliases.get(aliases.get("", {}).get(parent, parent) if len(path) == 1 else parent, {})
            k = next((x for x in node if table.get(str(x), x) == table.get(part, part)), part)
        else:
            raise ConfigError(f"{doc.file}: override '{text}': {dotted(tuple(path)) or 'the file'} is not a mapping")
        path.append(k)
        if i == len(parts) - 1:
            node[k] = value
        else:
            if isinstance(node, dict) and node.get(k) is None:
                node[k] = {}
            node = node[k]
    doc.overrides[tuple(path)] = text


def section(
    doc: Doc, value: Any, raw: Key, canon: Key, names: Sequence[str], aliases: Mapping[str, str] = {}
) -> dict[str, Item]:
    """The keys of mapping ``value`` as {canonical name: Item}; unknown and repeated keys are errors."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise doc.error(canon, f"must be a mapping (got {value!r})")
    out: dict[str, Item] = {}
    for k, v in value.items():
        name = aliases.get(k, k)
        if name not in names:
            raise doc.unknown(raw, k, names, [a for a, c in aliases.items() if c in names])
        add(doc, out, canon, {name: Item(v, raw + (k,))})
    return out


def add(doc: Doc, items: dict[str, Item], canon: Key, extra: Mapping[str, Item]) -> None:
    """Add ``extra`` to ``items`` (both keyed by field name of section ``canon``); a repeat is an error."""
    for name, it in extra.items():
        if name in items:
            first = dotted(items[name].path)
            raise doc.error(it.path, f"sets {dotted(canon + (name,))} again (already set by '{first}')")
        items[name] = it
        doc.note(canon + (name,), it.path)


def coerce(doc: Doc, value: Any, typ: str, canon: Key) -> Any:
    """Check ``value`` against a field type (annotation text, e.g. ``"float | None"``) and convert it."""
    base = typ.removesuffix(" | None")
    if value is None and base != typ:
        return None
    out, what = value, ""
    if base == "int":
        out = int(value) if isinstance(value, float) and value.is_integer() else value
        what = "" if isinstance(out, int) and not isinstance(out, bool) else "an integer"
    elif base == "float":
        ok = isinstance(value, int | float) and not isinstance(value, bool)
        out, what = (float(value), "") if ok else (value, "a number")
    elif base == "bool":
        what = "" if isinstance(value, bool) else "true or false"
    elif base == "str" or base.startswith("Literal"):
        what = "" if isinstance(value, str) else "a string"
    elif base == "Path":
        out, what = (Path(value), "") if isinstance(value, str) and value else (value, "a path")
    elif base.startswith("tuple["):
        pair = base == "tuple[float, float]"
        item = "float" if pair else base.removeprefix("tuple[").removesuffix(", ...]")
        seq = [value] if item == "str" and isinstance(value, str) else value
        if not isinstance(seq, list | tuple) or (pair and len(seq) != 2):
            raise doc.error(canon, f"must be a list of {'two numbers' if pair else item + ' values'} (got {value!r})")
        out = tuple(coerce(doc, x, item, canon + (i,)) for i, x in enumerate(seq))
    if what:
        raise doc.error(canon, f"must be {what}{' or null' if base != typ else ''} (got {value!r})")
    return out


def typed(doc: Doc, cls: type, items: Mapping[str, Item], canon: Key) -> dict[str, Any]:
    """``items`` read as fields of dataclass ``cls``: a field whose row of ``fields.yaml`` has an ``amount`` rule takes
    a number or number+unit parts (``amount``); another is coerced to its type, then mapped by its row's
    ``spellings``."""
    of, rows = {f.name: f for f in fields(cls)}, FIELDS[cls.__name__]
    out: dict[str, Any] = {}
    for k, it in items.items():
        f, row = of[k], rows[k]
        if "amount" in row:
            out[k] = amount(doc, it.value, row["amount"], canon + (k,), str(f.type).startswith("int"))
            continue
        v = coerce(doc, it.value, str(f.type), canon + (k,))
        out[k] = row.get("spellings", {}).get(v, v) if isinstance(v, str) else v
    return out


_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "k": 10**3, "K": 10**3, "M": 10**6, "G": 10**9, "B": 10**9}


def amount(doc: Doc, v: Any, rule: str, canon: Key, whole: bool) -> Any:
    """A number, or number+unit parts: ``1h30m`` (seconds) or ``50M``, ``1.5B`` (a count, ``whole``)."""
    if v is None or (isinstance(v, int | float) and not isinstance(v, bool)):
        return int(v) if whole and isinstance(v, float) and v.is_integer() else v
    units = "kKMGB" if whole else "smhd"
    parts = re.findall(rf"(\d+(?:\.\d+)?)([{units}])", v) if isinstance(v, str) else []
    if not parts or "".join(a + u for a, u in parts) != v.replace(" ", ""):
        raise doc.error(canon, f"must be {rule} (got {v!r})")
    total = sum(float(a) * _UNITS[u] for a, u in parts)
    return round(total) if whole else total


_KEYED = re.compile(r"([\w.\-]+): (.*)", re.S)


def make(doc: Doc, cls: type, canon: Key, **kwargs: Any) -> Any:
    """``cls(**kwargs)``, its ``key: rule`` error located in the file (``key`` is relative to ``canon``); a field
    with no default that ``kwargs`` lacks is named as required."""
    for f in fields(cls):
        if f.init and f.name not in kwargs and f.default is MISSING and f.default_factory is MISSING:
            raise doc.error(canon + (f.name,), "is required")
    try:
        return cls(**kwargs)
    except ConfigError as e:
        m = _KEYED.fullmatch(str(e))
        if m is None:
            raise doc.error(canon, str(e)) from None
        sub = tuple(int(p) if p.isdigit() else p for p in m[1].split("."))
        raise doc.error(canon + sub, m[2]) from None
