"""``sweep export``: one trial's adapter as a PEFT directory (vLLM-ready where the adapter allows), or merged into
the base.

The trial's saved adapter (``adapters/trial-<n>``, written by ``packer.model.checkpoint``) is rewritten into a new
directory with a model card (``README.md``: params, metrics, data, study provenance). vLLM's rules are met
without changing the adapter's function (``Packer.vllm_adapter``: ranks zero-padded to vLLM's choices, patterns
folded into B, adapter names dropped from keys). An adapter vLLM cannot serve as it is
(DoRA's magnitudes, a bias, ``modules_to_save``) is written as trained, which is what PEFT loads, with a one-line
note. ``merge=True`` writes the base model with W + s·B·A folded in, plus its tokenizer.
"""

from __future__ import annotations

import datetime as dt
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lora_sweep.errors import UserError
from lora_sweep.packer.api import Packer
from lora_sweep.packer.api import data as packer_data
from lora_sweep.store.api import ResultsStore, StudyDir, TrialRecord, constraint_text, is_feasible, pareto_front
from lora_sweep.sweep._scratch import plain_modes, scratch_dir, unwritable

__all__ = ["Export", "select_trial", "export_trial"]


@dataclass(frozen=True)
class Export:
    """What ``export_trial`` wrote."""

    trial: int
    out: Path
    rank: int
    """Rank the trial trained with."""
    exported_rank: int
    merged: bool
    changes: list[str] = field(default_factory=list)
    """Conversions made for vLLM (empty when the adapter already met its rules)."""
    note: str | None = None
    """One line about the merge the user should know (a QLoRA base dequantized from NF4 first); None otherwise."""


# ---------------------------------------------------------------- choosing the trial


def _values(t: TrialRecord, n: int) -> list[float] | None:
    vals = t.objective_values or []
    ok = len(vals) == n and all(v is not None and math.isfinite(v) for v in vals)
    return [float(v) for v in vals] if ok else None  # type: ignore[arg-type]


_Done = list[tuple[TrialRecord, list[float]]]


def _pareto(done: _Done, directions: list[str]) -> _Done:
    keep = set(pareto_front([(t.number, vals) for t, vals in done], directions))
    return [(t, vals) for t, vals in done if t.number in keep]


_OPTIONS = {"trial": ("--trial N", "trial=N"), "best": ("--best", "best=True"),
            "objective": ("--objective {!r}", "objective={!r}"),
            "allow_infeasible": ("--allow-infeasible", "allow_infeasible=True"), "vllm": ("--no-vllm", "vllm=False"),
            "out": ("a new --out", "a new out")}


def _opt(option: str, cli: bool, value: object = None) -> str:
    """How a message names an export option: the ``sweep export`` flag (``cli``) or the Python API's argument."""
    return _OPTIONS[option][0 if cli else 1].format(value)


def select_trial(store: ResultsStore, *, trial: int | None = None, best: bool = False,
                 objective: str | None = None, allow_infeasible: bool = False, cli: bool = False) -> TrialRecord:
    """The complete trial to export: ``trial`` by number, or the best one. ``cli``: messages name the
    ``sweep export`` flags (``--trial N``), not the Python API's arguments (``trial=N``).

    Raises:
        UserError: neither or both of ``trial`` / ``best``; an unknown or unfinished trial; an objective the
            study does not have; ``best`` without ``objective`` in a multi-objective study whose Pareto front
            has several trials (the message lists them, on one line); ``best`` in a study with constraints
            that no complete trial meets, unless ``allow_infeasible`` (then the best of all is taken).
    """
    if (trial is None) == (not best):
        raise UserError(f"export: give exactly one of {_opt('trial', cli)} and {_opt('best', cli)}")
    if objective is not None and not best:
        raise UserError(f"export: {_opt('objective', cli, objective)} goes with {_opt('best', cli)}")
    if trial is not None:
        rec = store.trial(trial)
        if rec is None:
            numbers = [t.number for t in store.trials()]
            known = f"trials {min(numbers)}..{max(numbers)}" if numbers else "no trials yet"
            raise UserError(f"export: trial {trial} does not exist in this study ({known})")
        if rec.state != "COMPLETE":
            why = f" ({rec.reason.strip().splitlines()[0]})" if rec.reason and rec.reason.strip() else ""
            state = {"FAIL": "failed"}.get(rec.state or "", (rec.state or "unknown").lower())
            raise UserError(f"export: trial {trial} is {state}{why}; "
                            "only complete trials have an adapter")
        return rec
    meta = store.meta()
    objectives, directions = list(meta.get("objectives") or []), list(meta.get("directions") or [])
    if objective is not None and objective not in objectives:
        raise UserError(f"export: {_opt('objective', cli, objective)} is not an objective of this study "
                        f"(objectives: {', '.join(objectives) or 'none'})")
    done = [(t, vals) for t in store.trials("COMPLETE") if (vals := _values(t, len(objectives))) is not None]
    if not done:
        raise UserError("export: no complete trial with finite objective values yet")
    constraints = list(meta.get("constraints") or [])
    feasible = [(t, vals) for t, vals in done if is_feasible(t.metrics, constraints)]
    if not feasible and not allow_infeasible:
        bounds = "; ".join(map(constraint_text, constraints))
        raise UserError(f"export: no complete trial meets the constraints ({bounds}); pass "
                        f"{_opt('allow_infeasible', cli)} to export the best of the {len(done)} that do not")
    done = feasible or done
    if objective is None and len(objectives) > 1:
        front = sorted(_pareto(done, directions), key=lambda x: x[0].number)
        if len(front) > 1:
            listing = "; ".join(f"#{t.number} (" + ", ".join(f"{o}={v:.4g}" for o, v in zip(objectives, vals,
                                                                                           strict=True)) + ")"
                                for t, vals in front)
            raise UserError(f"export: {_opt('best', cli)} is ambiguous in a multi-objective study; Pareto trials: "
                            f"{listing}; choose one with {_opt('trial', cli)}, or pass "
                            f"{' or '.join(_opt('objective', cli, o) for o in objectives)}")
        return front[0][0]
    i = objectives.index(objective) if objective is not None else 0
    sign = 1.0 if directions[i] == "minimize" else -1.0
    return min(done, key=lambda x: (sign * x[1][i], x[0].number))[0]


# ---------------------------------------------------------------- model card and the export itself


def _fmt(v: Any) -> str:
    return f"{v:.6g}" if isinstance(v, float) else str(v)


def model_card(meta: dict[str, Any], rec: TrialRecord, config: dict[str, Any], out: Path, *, source: Path,
               changes: list[str], merged: bool) -> str:
    """README.md of an export: what the trial is, how it scored, where it came from, how to load it."""
    model, name = str(meta.get("model", "")), str(meta.get("name", ""))
    objectives = dict(zip(meta.get("objectives") or [], meta.get("directions") or [], strict=False))
    default = " (the community-default trial)" if rec.is_default else ""
    lines = ["---", f"library_name: {'transformers' if merged else 'peft'}", f"base_model: {json.dumps(model)}",
             "tags: [lora, lora-sweep]", "---", "",
             f"# {name} · trial {rec.number}{' (merged into the base model)' if merged else ''}", "",
             f"LoRA adapter trained by a lora-sweep study{default}.", "",
             "## Hyperparameters", "", "| name | value |", "|---|---|"]
    lines += [f"| {k} | {_fmt(v)} |" for k, v in (rec.params or {}).items()]
    lines += [f"| exported r / lora_alpha / use_rslora | {config['r']} / {_fmt(config['lora_alpha'])} / "
              f"{config.get('use_rslora', False)} |",
              f"| target_modules | {', '.join(config.get('target_modules') or [])} |", "",
              "## Metrics (final evaluation)", "", "| metric | value | objective |", "|---|---|---|"]
    lines += [f"| {k} | {_fmt(v)} | {objectives.get(k, '')} |" for k, v in (rec.metrics or {}).items()]
    lines += ["", "## Training", "", f"- data: `{meta.get('data', '')}`",
              f"- optimizer steps: {rec.steps_done}, training tokens: {rec.tokens}, "
              f"device seconds: {_fmt(rec.device_seconds)}", f"- pack {rec.pack_id}, slot {rec.slot}", "",
              "## Provenance", "", f"- study: `{name}` (lora-sweep {meta.get('lora_sweep_version', '?')})",
              *([f"- base model: dequantized from the GGUF file `{meta['model_source']}`"]
                if meta.get("model_source") else []),
              *([f"- trained over the base quantised to {q.upper()} (QLoRA, `model.quantize: {q}`)"
                 + ("; merged into its dequantized weights" if merged else "; the adapter applies to the plain base")]
                if (q := ((meta.get("spec") or {}).get("model") or {}).get("quantize")) else []),
              f"- study directory: `{source.parent.parent}`", f"- Optuna storage: `{meta.get('storage', '')}`",
              f"- trial number: {rec.number}", f"- source adapter: `{source}`",
              f"- exported: {dt.datetime.now(dt.UTC).strftime('%Y-%m-%d %H:%M:%S UTC')}"]
    lines += [f"- conversion for vLLM: {c}" for c in changes]
    lines += ["", "## Prompt format", "", *_prompt_format(meta), "", "## Use", ""]
    if merged:
        lines += ["```python", "from transformers import AutoModelForCausalLM, AutoTokenizer",
                  f"model = AutoModelForCausalLM.from_pretrained({str(out)!r})",
                  f"tokenizer = AutoTokenizer.from_pretrained({str(out)!r})", "```"]
    else:
        lines += ["With PEFT (`pip install peft`: lora-sweep trains without it, so its install does not bring it):",
                  "", "```python", "from peft import PeftModel", "from transformers import AutoModelForCausalLM",
                  f"model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained({model!r}), {str(out)!r})",
                  "```", "", "vLLM (pass absolute paths; a relative one is taken for a hub id):", "", "```bash",
                  f"vllm serve {model} --enable-lora --max-lora-rank {max(16, int(config['r']))} "
                  f"--lora-modules trial-{rec.number}={out}", "```"]
    return "\n".join(lines) + "\n"


def _prompt_format(meta: dict[str, Any]) -> list[str]:
    """How the training rows became text (``packer.data.rows``): prompt the adapter the same way. The study's
    ``data.format``, or with ``auto`` the format its training file's rows are detected as."""
    data = (meta.get("spec") or {}).get("data") or {}
    fmt = data.get("format") or "auto"
    if fmt == "auto":
        try:
            fmt = packer_data.read_jsonl(str(data.get("train") or meta.get("data")), "auto")[0]
        except (UserError, OSError):
            return ["The study detected its data format from the rows (`data.format: auto`); its training file is "
                    "gone, so this card cannot say which."]
    bos = "the tokenizer's special tokens (its BOS, if it has one) are added when the prompt is encoded"
    if fmt == "alpaca":
        return ["Alpaca rows (`instruction`, `input`, `output`): the prompt is this template, with the empty "
                f"`input` section left out when a row has none; {bos}; the answer follows the prompt and ends with "
                "EOS.", "", "```text", packer_data.ALPACA_PROMPT.rstrip("\n"), "```", "", "Without an input:", "",
                "```text", packer_data.ALPACA_PROMPT_NO_INPUT.rstrip("\n"), "```"]
    if fmt == "chat":
        return ["Chat rows (`messages`): the tokenizer's own chat template. Prompt with "
                "`tokenizer.apply_chat_template(messages, add_generation_prompt=True)`; the answer is the "
                "assistant turn the template closes."]
    if fmt == "text":
        return [f"Plain text rows (`text`): no prompt template; {bos}. Give the adapter text to continue."]
    return [f"Prompt / completion rows: the prompt is the row's `prompt` text exactly as written, no template "
            f"and no chat template; {bos}; the model continues it with the `completion`, then EOS. Prompt the "
            "adapter with the same raw text."]


def _base_source(meta: dict[str, Any], config: dict[str, Any]) -> str:
    """What ``--merge`` loads: the study's base (a GGUF source's cached checkpoint directory, or its GGUF file
    again where that cache has been deleted since: converting it again gives the same weights)."""
    base = str(meta.get("model") or config["base_model_name_or_path"])
    if meta.get("model_source") and not Path(base).is_dir():
        return str(meta["model_source"])
    return base


def _check_out(out: Path, cli: bool) -> None:
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UserError(f"export: {out} exists and is not empty; choose {_opt('out', cli)}")


def export_trial(study_dir: str | Path, out: str | Path, *, trial: int | None = None, best: bool = False,
                 objective: str | None = None, vllm: bool = True, merge: bool = False,
                 allow_infeasible: bool = False, cli: bool = False) -> Export:
    """Export one complete trial of the study in ``study_dir`` to ``out`` (see the module docstring). ``cli``:
    messages name the ``sweep export`` flags, not the Python API's arguments.

    The export is written to a scratch directory beside ``out`` and renamed onto it once complete: an export stopped
    (Ctrl-C, SIGTERM, an error) leaves no ``out`` and nothing beside it, and the same call succeeds again. With
    ``vllm`` an adapter vLLM can serve is converted to its rules; one it cannot (DoRA, a bias, ``modules_to_save``,
    a rank above 512) is written as trained, which PEFT loads, and ``Export.note`` says so.

    Raises:
        UserError: not a study directory, a bad trial choice (``select_trial``), a missing adapter, an
            ``out`` that exists and is not empty, or one the system refuses to write (named, not the scratch
            directory: a read-only or full disk, a file in the way).
    """
    sdir, out = StudyDir(study_dir), Path(out).absolute()
    if not sdir.is_study():
        raise UserError(f"export: {study_dir}: not a study directory (no results.db and study.yaml)")
    with ResultsStore(sdir.results_db, create=False) as store:
        rec = select_trial(store, trial=trial, best=best, objective=objective, allow_infeasible=allow_infeasible,
                           cli=cli)
        meta = store.meta()
    _check_out(out, cli)
    source = (sdir.root / rec.adapter_path if rec.adapter_path else sdir.adapter_dir(rec.number)).absolute()
    if not source.is_dir():
        raise UserError(f"export: trial {rec.number}'s adapter {source} is missing")
    config, tensors = Packer.read_adapter(source)
    rank = int(config["r"])
    changes: list[str] = []
    note = None
    if vllm and not merge:
        why = Packer.vllm_refusal(config, tensors)
        if why is None:
            config, tensors, changes = Packer.vllm_adapter(config, tensors, f"use {_opt('vllm', cli)}")
        else:  # the export is still what PEFT loads: the trial as trained
            note = f"export: not padded for vLLM: the adapter uses {why} (it loads in PEFT as trained)"
    _check_out(out, cli)
    with scratch_dir(out) as tmp:  # removed however the block ends (a Ctrl-C or SIGTERM too): nothing beside --out
        try:
            if merge:
                quantize = ((meta.get("spec") or {}).get("model") or {}).get("quantize")
                model, tokenizer = Packer.merge_base(_base_source(meta, config), quantize)
                note = _dequantized_note(quantize)
                Packer.merge_adapter(model, config, tensors)
                model.save_pretrained(tmp)  # type: ignore[operator]
                tokenizer.save_pretrained(tmp)  # type: ignore[attr-defined]
            else:
                marks = {"study": str(meta.get("name", "")), "trial": str(rec.number)}
                Packer.write_adapter(tmp, config, tensors, marks)
            (tmp / "README.md").write_text(model_card(meta, rec, config, out, source=source, changes=changes,
                                                      merged=merge))
            plain_modes(tmp)
            if out.exists():
                out.rmdir()
            os.replace(tmp, out)
        except Exception as err:
            refused = unwritable(out, err)
            if refused is None:
                raise
            raise refused from err
    return Export(rec.number, out, rank, int(config["r"]), merge, changes, note)


def _dequantized_note(kind: str | None) -> str | None:
    """For a QLoRA study (``model.quantize: nf4``), the line saying the base was merged into as the adapter trained
    over it (``Packer.merge_base``: quantised to NF4 and dequantized again); else None."""
    if not kind:
        return None
    return (f"merge: the study trained over a {kind.upper()} base (model.quantize: {kind}): the base weights were "
            f"dequantized from {kind.upper()} before merging, the weights the adapter was trained over")
