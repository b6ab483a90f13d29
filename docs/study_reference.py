"""Write the generated reference pages: the study file (docs/reference/study-file.md) from the spec's own
definitions, and the results.db tables (docs/reference/results-db.md) from the store's own docstring.

Every key's type and default come from the dataclasses the loader validates into (``sweep.config.spec``,
``sweep.config.strategy``, ``sweep.config._params``, each evaluator's options class), its meaning and aliases from
its row of the field table (``sweep/config/fields.yaml``, read as ``sweep.config.settings.FIELDS``; an evaluator's
option's meaning from the field's docstring). A field without a meaning stops the generator (``MissingDoc``), so a
key added to the spec without its meaning cannot reach the page; ``tests/docs/test_study_reference.py`` checks the
committed page against this output and against every key the loader accepts.

The results.db page turns ``lora_sweep.store.api``'s table descriptions (one indented ``column  meaning`` line per
column) into Markdown tables, so the schema is written once, beside the code that creates it.

    python3 docs/study_reference.py            # rewrite both pages
    python3 docs/study_reference.py --check    # exit 1 if a committed page differs
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import re
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

from lora_sweep.evaluators import registry
from lora_sweep.evaluators.cost import COST_METRICS
from lora_sweep.store import api as store
from lora_sweep.sweep.config import loader, settings
from lora_sweep.sweep.config import spec as S

PAGE = Path(__file__).resolve().parent / "reference" / "study-file.md"
SCHEMA_PAGE = PAGE.with_name("results-db.md")

SECTIONS: tuple[tuple[str, type, str], ...] = (
    ("model", S.ModelSpec, "The frozen base model. A string is short for `model.path`."),
    ("data", S.DataSpec, "Training and evaluation data, JSON lines. A string is short for `data.train`."),
    ("train", S.TrainSpec, "Fixed settings of every trial; a key that is also under `search` is an error."),
    ("budget", S.Budget, "When the study stops: whichever limit is reached first (at least one)."),
    ("sampler", S.SamplerSpec, "The Optuna sampler. A string is short for `sampler.name`."),
    ("pruning", S.PruningSpec, "Cohort successive halving at rung steps. `pruning: none` (or absent) turns it off."),
    ("pack", S.PackSpec, "How trials share one training run (a pack: the trials as slots of one run over one "
                         "frozen base). A number is short for `pack.max_slots`."),
)
"""Mapping sections: (key, dataclass, what the section is)."""
LISTS: tuple[tuple[str, type, str], ...] = (
    ("objectives", S.Objective, "One or more targets; several make a multi-objective study with a Pareto front. "
                                "An entry may also be a string, `minimize eval_loss`."),
    ("constraints", S.Constraint, "Soft constraints (Optuna's `constraints_func`): a trial that breaks one is "
                                  "infeasible. An entry may also be a string, `peak_memory_mb <= 20000`."),
    ("evaluators", S.EvalSpec, "Run on every finished trial and at rungs. An entry may also be a bare name."),
    ("trackers", S.TrackerSpec, "Experiment trackers every trial is logged to (guides/trackers.md). An entry is a bare "
                                "name, or the name with its options beside it: `{name: wandb, mode: online, "
                                "project: p}`."),
)
"""List sections: (key, dataclass of one entry, what the list is)."""
NESTED = {"model", "data", "search", "train", "budget", "sampler", "pruning", "pack", "objectives", "constraints",
          "evaluators", "trackers"}
"""StudySpec fields that are sections of their own below."""
WANDB_TOP = {"method": "`sampler.name` (`bayes` is `tpe`, `random`, `grid`)", "metric": "one entry of `objectives`",
             "run_cap": "`budget.trials`", "parameters": "`search`"}
"""W&B sweep-config keys the loader reads at the top level, and where they go."""


class MissingDoc(Exception):
    """A study-file key whose field has no docstring: the reference would have no meaning to show."""


def field_docs(cls: type) -> dict[str, str]:
    """Each field's docstring (the string literal right after its annotation), read from the class's source."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for node, after in zip(body, [*body[1:], None], strict=True):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            if isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant) and isinstance(after.value.value,
                                                                                                    str):
                docs[node.target.id] = " ".join(after.value.value.split())
    return docs


def study_fields(cls: type) -> list[dataclasses.Field]:
    """The fields a study file may set (``init`` fields; StudySpec's ``source`` is the loader's, not the file's)."""
    return [f for f in dataclasses.fields(cls) if f.init and not (cls is S.StudySpec and f.name == "source")]


def _type(annotation: Any) -> str:
    t = str(annotation)
    t = re.sub(r"Literal\[([^\]]*)\]", lambda m: " | ".join(v.strip().strip("'\"") for v in m[1].split(",")), t)
    t = re.sub(r"tuple\[(\w+), \.\.\.\]", r"list of \1", t)
    t = re.sub(r"tuple\[([\w, ]+)\]", r"[\1]", t)
    t = t.replace("Path", "path").replace("Mapping[str, object]", "mapping").replace("None", "null")
    return t


def _plain(v: Any) -> Any:
    if dataclasses.is_dataclass(v) and not isinstance(v, type):
        return {f.name: _plain(getattr(v, f.name)) for f in dataclasses.fields(v)}
    if isinstance(v, tuple | list):
        return [_plain(x) for x in v]
    if isinstance(v, Path):
        return str(v)
    return v


def _default(f: dataclasses.Field) -> str:
    if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
        return "required"
    v = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
    if isinstance(v, dict) and not v:
        return "`{}`"
    if dataclasses.is_dataclass(v):
        return "see below"
    text = yaml.safe_dump(_plain(v), default_flow_style=True, width=1000).strip().removesuffix("...").strip()
    return f"`{text}`"


def rows(prefix: str, cls: type, skip: set[str] = frozenset()) -> Iterator[str]:  # type: ignore[assignment]
    """One table row per study-file key of ``cls``: key, type, default, meaning. Raises MissingDoc."""
    table = settings.FIELDS.get(cls.__name__)
    docs = {name: " ".join(row["doc"].split()) for name, row in table.items()} if table else field_docs(cls)
    for f in study_fields(cls):
        if f.name in skip:
            continue
        if not docs.get(f.name):
            raise MissingDoc(f"{cls.__module__}.{cls.__qualname__}.{f.name}: no meaning; the study-file key "
                             f"{prefix}{f.name} needs one (a row of sweep/config/fields.yaml, or an option's "
                             "docstring)")
        default = "the file's stem" if cls is S.StudySpec and f.name == "name" else _default(f)
        yield f"| `{prefix}{f.name}` | {_cell(_type(f.type))} | {_cell(default)} | {_cell(docs[f.name])} |"


def _cell(text: str) -> str:
    """Markdown table cell: a literal bar escaped, reST's double backticks as Markdown code."""
    return text.replace("``", "`").replace("|", "\\|")


def _table(prefix: str, cls: type, skip: set[str] = frozenset()) -> list[str]:  # type: ignore[assignment]
    return ["| key | type | default | meaning |", "|---|---|---|---|", *rows(prefix, cls, skip), ""]


def _aliases(section: str) -> list[str]:
    table = loader._ALIASES.get(section, {})
    names = sorted(a for a, c in loader._ALIASES[""].items() if c == section)
    out = [f"The section under another name: {', '.join(f'`{a}` → `{section}`' for a in names)} (its overrides "
           f"too: `{names[0]}.max_slots=4`).", ""] if names else []
    if section == "train":
        return [*out, *_train_aliases()]
    if not table:
        return out
    pairs = ", ".join(f"`{a}` → `{c}`" for a, c in sorted(table.items()))
    return [*out, f"Aliases (Axolotl, torchtune, PEFT, HF and Optuna names): {pairs}.", ""]


def _train_aliases() -> list[str]:
    """The train settings' other names, by the tool that spells them so (``fields.yaml``'s TrainSpec rows)."""
    by_format = {f: [f"`{a}` → `{s.name}`" for s in settings.SETTINGS for a in getattr(s, f).split()]
                 for f in settings.FORMATS}
    names = {"axolotl": "Axolotl", "torchtune": "torchtune", "peft": "PEFT (`LoraConfig`)", "hf": "HF Trainer / TRL",
             "other": "short spellings"}
    bullets = [f"- {names[f]}: {', '.join(pairs)}." for f, pairs in by_format.items() if pairs]
    return ["Aliases, by the tool that names the setting so:", "", *bullets, ""]


def _top() -> list[str]:
    out = ["## Top level", "",
           "A study file is one YAML mapping. Keys not listed on this page are an error that names the nearest "
           "valid key.", "", *_table("", S.StudySpec, NESTED)]
    out += ["The sections " + ", ".join(f"[`{k}`](#{k})" for k in sorted(NESTED)) + " follow.", ""]
    out += ["W&B sweep-config keys are read at the top level too: "
            + "; ".join(f"`{k}` → {v}" for k, v in WANDB_TOP.items()) + ".", ""]
    moved = sorted(k for k in loader._RELOCATE if k not in [f.name for f in dataclasses.fields(S.TrainSpec)])
    out += ["Axolotl-style flat keys: any `train` key (and its aliases) may sit at the top level, and so may "
            + ", ".join(f"`{k}`" for k in moved) + "; each is moved into its section "
            "(`base_model` → `model.path`, `lora_target_linear: true` → `train.targets: all-linear`, "
            "`sequence_len` → `data.max_length`).", ""]
    return out


def _search() -> list[str]:
    names = ", ".join(f"[`{n}`](#train)" for n in S.SEARCHABLE)
    return ["## search", "",
            "The searched dimensions (alias: a W&B-style `parameters:` block). Each key is a `train` setting; its "
            f"value is a list (a categorical), a range mapping, or a W&B mapping. Searchable: {names}. "
            "`targets` takes a mapping of named module sets (`{attn: [q_proj, v_proj], all: all-linear}`) or a "
            "list of module lists. A plain scalar under `search` is a fixed value, as if it were under `train`.", "",
            *_table("search.<name>.", S.Param, {"name", "kind"}),
            "W&B keys of one dimension: " + ", ".join(f"`{k}`" for k in loader._WANDB)
            + "; `distribution` one of " + ", ".join(f"`{d}`" for d in loader._DISTRIBUTIONS)
            + " (`log_uniform` bounds are exponents; `probabilities` is refused).", "",
            "The aliases of `train` apply here too (`learning_rate: {low: 1e-5, high: 1e-3, log: true}`).", ""]


def _metric_bullets() -> list[str]:
    """One line per evaluator: the metric names it reports (``Evaluator.reports``), then the cost metrics."""
    cost = ", ".join(f"`{m}`" for m in COST_METRICS)
    return [*(_cell(f"- `{e.name}`: {e.reports};") for e in registry.EVALUATORS),
            f"- always (from the trainer's numbers, `evaluators.cost`): {cost}."]


def _user_code() -> list[str]:
    return ["**A study file that names `file.py:OBJECT` (an evaluator, or the `custom` evaluator's `function`) runs "
            "that file's Python code**, with your permissions, as a Python config would: read a study file from "
            "someone else as you would read their script. The file is taken from the study file's folder when its "
            "path is relative, and imported once per process, when `sweep run` (or `lora_sweep.run`) loads the "
            "study; `sweep plan` only checks that the file exists (it prints a note saying it did not import it), "
            "and `sweep status` and `sweep report` read only the study directory. While it runs, the code is "
            "contained: what it raises, a result that is not an `EvalResult` or a metric that is not a finite number "
            "fails the trials it was scoring with a one-line reason, and the run goes on; past `evaluators[].timeout` "
            "or `budget.wall_time` its trials fail and the run stops ([troubleshooting](../troubleshooting.md)).",
            ""]


def _evaluator_options() -> list[str]:
    out = ["### Evaluator options", "",
           "`options` of each evaluator (`evaluators: [{name: generation, options: {max_new_tokens: 8}}]`); "
           "an unknown option is an error.", ""]
    for e in registry.EVALUATORS:
        out += [f"#### {e.name}", "", *_table(f"evaluators[{e.name}].options.", e.options)]
        if e.name == "custom":
            out += _custom_signature()
        aliases = getattr(e.options, "ALIASES", {})
        if aliases:
            out += ["Aliases: " + ", ".join(f"`{a}` → `{k}`" for a, k in aliases.items()) + ".", ""]
    return out


def _custom_signature() -> list[str]:
    """What the ``custom`` evaluator calls, from ``evaluators.custom``'s docstring (its one statement)."""
    from lora_sweep.evaluators import custom

    body = (custom.__doc__ or "").split("\n\n", 1)[1].replace("``", "`").strip()
    return [body, "", "A `path/to/file.py` is read relative to the study file, like every path a study file names. "
            "A worked example: [Extending](../guides/extending.md#a-metric-function-the-built-in-custom-evaluator).",
            ""]


def generate() -> str:
    """The whole page, as Markdown."""
    head = ["# Study-file reference", "",
            "<!-- Generated by docs/study_reference.py from the spec's dataclasses and the loader's key tables; do "
            "not edit by hand. tests/docs/test_study_reference.py fails when this page and the spec differ. -->", "",
            "Every key a study file may set: its type, its default and what it does. A dotted key is a key inside a "
            "section (`train.lr` is `train: {lr: ...}`); `objectives[].metric` is a key of each list entry. "
            "Every key can be overridden on the command line: `sweep run study.yaml train.lr=1e-3`. A wrong key or "
            "value stops the run with one line naming the file, the line and the key "
            "([troubleshooting](../troubleshooting.md)).", "",
            "Whole Axolotl and torchtune configs are accepted as well; see "
            "[Axolotl and torchtune configs](../guides/foreign-configs.md).", ""]
    out = [*head, *_top()]
    for key, cls, what in SECTIONS:
        out += [f"## {key}", "", what, "", *_table(f"{key}.", cls), *_aliases(key)]
        if key == "train":
            out += _search()
    for key, cls, what in LISTS:
        out += [f"## {key}", "", what, "", *_table(f"{key}[].", cls), *_aliases(key)]
    names = ", ".join(f"`{e.name}`" for e in registry.EVALUATORS)
    out += [f"Evaluator names: {names}, or `file.py:OBJECT` naming an evaluator of your own "
            "([Extending](../guides/extending.md)). The metric names objectives, constraints and `pruning.proxy` may "
            "use (from `lora_sweep.evaluators`):", "", *_metric_bullets(), "", *_user_code(), *_evaluator_options()]
    return "\n".join(out).rstrip() + "\n"


def _schema_rows(lines: list[str]) -> list[list[str]]:
    """``[columns, meaning]`` per column of one table: a 4-space ``cols  meaning`` line starts a row, a deeper one
    continues it, and ``  name: meaning`` inside a meaning is a row of its own."""
    rows: list[list[str]] = []
    for line in lines:
        indent = len(line) - len(line.lstrip())
        if indent == 4 and (m := re.match(r"(\S.*?)(?:\s{2,}|\s(?=[A-Z]))(.*)", line.strip())):
            rows.append([m[1], m[2]])
        elif rows:
            rows[-1][1] += " " + line.strip()
    out: list[list[str]] = []
    for cols, meaning in rows:
        parts = re.split(r"\s{2}([\w]+): ", meaning)
        out.append([cols, parts[0]])
        out += [[parts[i], parts[i + 1]] for i in range(1, len(parts) - 1, 2)]
    return out


def generate_schema() -> str:
    """The results.db page, from ``lora_sweep.store.api``'s docstring."""
    doc = store.__doc__ or ""
    body = doc[doc.index("Tables of results.db"):]
    out = ["# results.db tables", "",
           "<!-- Generated by docs/study_reference.py from the docstring of lora_sweep.store.api (store/"
           "api.py); do not edit by hand. tests/docs/test_study_reference.py fails when they differ. -->", ""]
    for block in body.strip().split("\n\n"):
        lines = block.splitlines()
        head = [ln for ln in lines if not ln.startswith(" ")]
        table = [ln for ln in lines if ln.startswith(" ")]
        m = re.match(r"``(\w+)`` (\(PK [^)]*\)): (.*)", " ".join(head), flags=re.S)
        if m:
            meaning = _cell(m[3])
            out += [f"## {m[1]}", "", f"{meaning[:1].upper()}{meaning[1:]} Primary key: {m[2][4:-1]}.", ""]
        else:
            out += [_cell(" ".join(ln.strip() for ln in lines)), ""]
        if table:
            out += ["| column | meaning |", "|---|---|", *(f"| `{c}` | {_cell(d)} |" for c, d in _schema_rows(table)),
                    ""]
    return "\n".join(out).rstrip() + "\n"


def main(argv: list[str]) -> int:
    pages = {PAGE: generate(), SCHEMA_PAGE: generate_schema()}
    if "--check" in argv:
        stale = [p for p, text in pages.items() if not p.is_file() or p.read_text() != text]
        for p in stale:
            print(f"{p}: out of date; run python3 docs/study_reference.py", file=sys.stderr)
        return 1 if stale else 0
    for p, text in pages.items():
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
        print(p)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
