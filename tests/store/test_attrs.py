"""store/attrs.py: the one table of Optuna attribute keys, and no module spelling a key itself."""

from __future__ import annotations

import ast
from pathlib import Path

from lora_sweep.store.api import attrs

REPO = Path(__file__).resolve().parents[2]
_SETTERS = {"set_user_attr", "set_system_attr", "set_trial_user_attr", "set_trial_system_attr"}
_READERS = {"user_attrs", "system_attrs"}


def test_every_key_is_in_the_documented_table() -> None:
    keys = [getattr(attrs, name) for name in attrs.__all__ if isinstance(getattr(attrs, name), str)]
    assert len(set(keys)) == len(keys), "two constants share a key"
    assert set(keys) == {*attrs.TRIAL_USER_ATTRS, *attrs.TRIAL_SYSTEM_ATTRS, *attrs.STUDY_USER_ATTRS}
    doc = attrs.__doc__ or ""
    for name in attrs.__all__:
        if isinstance(getattr(attrs, name), str):
            assert f"``{name}``" in doc and f"({getattr(attrs, name)})" in doc, f"{name} missing from the table"


def _literal_keys(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, key) of every attribute key written as a string literal: set_*_attr("k", ...),
    x.user_attrs["k"], x.user_attrs.get("k"), "k" in x.user_attrs, user_attrs={"k": ...}."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            if node.func.attr in _SETTERS:
                found += [(node.lineno, a.value) for a in node.args[:2]
                          if isinstance(a, ast.Constant) and isinstance(a.value, str)]
            if node.func.attr == "get" and _reads_attrs(node.func.value) and node.args:
                found += [(node.lineno, a.value) for a in node.args[:1] if isinstance(a, ast.Constant)]
            for kw in node.keywords:
                if kw.arg == "user_attrs" and isinstance(kw.value, ast.Dict):
                    found += [(node.lineno, k.value) for k in kw.value.keys if isinstance(k, ast.Constant)]
        elif isinstance(node, ast.Subscript) and _reads_attrs(node.value) and isinstance(node.slice, ast.Constant):
            found.append((node.lineno, node.slice.value))
        elif isinstance(node, ast.Compare) and any(_reads_attrs(c) for c in node.comparators):
            if isinstance(node.left, ast.Constant):
                found.append((node.lineno, node.left.value))
    return found


def _reads_attrs(node: ast.AST) -> bool:
    """``x.user_attrs`` / ``x.system_attrs``, also as ``(x.user_attrs or {})``."""
    if isinstance(node, ast.BoolOp):
        return any(_reads_attrs(v) for v in node.values)
    return isinstance(node, ast.Attribute) and node.attr in _READERS


def test_no_module_spells_an_attribute_key() -> None:
    table = REPO / "store" / "attrs.py"
    offenders = []
    folders = [p for folder in ("sweep", "store", "reports") for p in (REPO / folder).rglob("*.py")]
    for path in sorted([*folders, REPO / "cli.py", REPO / "api.py"]):
        if path != table:
            offenders += [f"{path.relative_to(REPO)}:{line}: {key!r}" for line, key in _literal_keys(
                ast.parse(path.read_text()))]
    assert not offenders, "use the constants of store.attrs:\n" + "\n".join(offenders)


def test_the_scan_finds_each_spelling() -> None:
    code = ('t.set_user_attr("reason", r)\nstorage.set_trial_system_attr(i, "sweep:worker", 1)\n'
            'x = t.user_attrs["retry_of"]\ny = (t.user_attrs or {}).get("default")\nz = "tokens" in t.user_attrs\n'
            'study.enqueue_trial(p, user_attrs={"default": True})\n')
    assert sorted(k for _, k in _literal_keys(ast.parse(code))) == sorted(
        ["reason", "sweep:worker", "retry_of", "default", "tokens", "default"])
