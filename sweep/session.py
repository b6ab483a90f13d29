"""A session: one ``sweep run`` owning its study directory.

It holds the directory's exclusive lock (``own_directory``: a second run on a directory in use stops
with the pid and host of its owner), writes the resolved spec (overrides and aliases applied) into the
store (meta ``spec``) and the directory (``study.yaml``), and compares it with the one the study
started with: a changed fixed setting is an error naming the key unless ``--allow-changes``
(``record_spec``). ``Session`` is everything the run then works with.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import optuna
import yaml
from optuna.trial import TrialState

from lora_sweep.errors import UserError
from lora_sweep.packer.api import Packer
from lora_sweep.store.api import (
    DirectoryInUse,
    DirectoryLock,
    ResultsStore,
    StudyDir,
    pareto_front,
    redact_record,
    strip_password,
)
from lora_sweep.store.storage import Sharing
from lora_sweep.sweep.config.spec import StudySpec
from lora_sweep.sweep.ledger import Ledger

__all__ = ["Session", "own_directory", "record_spec", "spec_record", "spec_changes", "RESUMABLE",
           "trial_adapter_dir", "Note"]


class Note(str):
    """A run's log line that tells its progress (the start's phases, a trial started or ended), as opposed to a
    warning or how the run ended: ``sweep run --quiet`` leaves notes out; every other ``log`` takes them as lines."""

    __slots__ = ()


@dataclass
class Session:
    """Everything one ``sweep run`` works with."""

    spec: StudySpec
    sdir: StudyDir
    store: ResultsStore
    ledger: Ledger
    packer: Packer
    """The base, opened once (``packer.api.open_base``): what trains, saves and is scored."""
    capacity: int
    finished: int = 0
    """Trials that count against the budget (finished, orphans excluded)."""
    tokens: int = 0
    """Tokens trained by the trials told so far (earlier runs' and this run's)."""
    elapsed: float = 0.0
    """Wall seconds of earlier runs."""
    completed: list[tuple[int, list[float]]] = field(default_factory=list)
    sharing: Sharing | None = None
    """Set when other workers share the study: the budget is then counted in the storage."""
    lock: DirectoryLock | None = None
    """The study directory's lock, held until ``close`` (None for a worker of a shared study)."""

    @property
    def study(self) -> optuna.Study:
        return self.ledger.study

    def adapter_dir(self, number: int) -> Path:
        """``trial_adapter_dir`` of this session's study."""
        return trial_adapter_dir(self.spec, self.sdir, number)

    def rung_history(self, metric: str) -> dict[int, dict[int, float]]:
        """{rung: {trial: value}} of ``metric`` from earlier runs, so pruning continues where it was."""
        out: dict[int, dict[int, float]] = {}
        for row in self.store.evals(kind="rung"):
            if row.metric == metric:
                out.setdefault(row.step, {})[row.trial] = math.nan if row.value is None else row.value
        return out

    def finished_count(self) -> int:
        return self.finished

    def best_text(self) -> str:
        if not self.completed:
            return "-"
        objectives = self.spec.objectives
        if len(objectives) == 1:
            sign = 1 if objectives[0].direction == "minimize" else -1
            number, values = min(self.completed, key=lambda c: sign * c[1][0])
            return f"#{number} {objectives[0].metric}={values[0]:.4g}"
        return f"{len(pareto_front(self.completed, [o.direction for o in objectives]))} on the Pareto front"

    def record(self, number: int, state: TrialState, values: list[float] | None, tokens: int = 0) -> None:
        """Count a trial this run told: against the trial budget, and its trained tokens against the token budget."""
        self.finished += 1
        self.tokens += tokens
        if state == TrialState.COMPLETE and values is not None:
            self.completed.append((number, values))

    def add_elapsed(self, seconds: float) -> None:
        self.store.set_meta(elapsed=self.elapsed + seconds)

    def close(self) -> None:
        self.packer.close()  # an adapter still being written lands before the directory is given back
        self.store.close()
        if self.lock is not None:
            self.lock.release()


def trial_adapter_dir(spec: StudySpec, sdir: StudyDir, number: int) -> Path:
    """Where trial ``number``'s adapter goes: ``artifacts/trial-<n>``, or the study directory's."""
    if spec.artifacts is not None:
        return (spec.artifacts / f"trial-{number}").absolute()
    return sdir.adapter_dir(number)


def own_directory(sdir: StudyDir, log: Callable[[str], None], storage: str | None = None) -> DirectoryLock:
    """Take the study directory's lock for this run (workers of a shared study take none: their
    launcher holds it, and the storage's own lock orders them). ``storage``: the shared storage of a
    ``sweep run --workers``, recorded (without its password) so ``sweep run --join`` can join it.

    Raises:
        UserError: another live process holds it.
    """
    try:
        lock = sdir.acquire(**({"storage": strip_password(storage)} if storage else {}))
    except DirectoryInUse as err:
        join = " or join it with --join" if err.holder.get("storage") else ""
        raise UserError(f"run: {err}; wait for it to end{join} (a second run would fail its running trials)") from None
    except OSError as err:  # a read-only mount, a folder without write permission, a path below a file
        if err.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
            raise UserError(f"run: {sdir.root}: {err.strerror}: a run writes its results there; a read-only study "
                            f"is read with sweep status, report --out and export, or copied to a writable place to "
                            f"continue it") from None
        raise UserError(f"run: {sdir.root}: cannot be a study directory ({err.strerror}: {err.filename})") from None
    if (line := lock.took_over()) is not None:
        log(line)
    return lock


RESUMABLE = ("budget", "output", "description", "pack", "packing", "model.device", "artifacts", "storage", "evaluators",
             "trackers")
"""Spec keys a resumed study may change: how long, where, and how it runs, not what a trial is.
(Evaluators only add metrics to later trials; the objectives themselves are fixed.) ``packing`` is the ``pack``
section in a spec recorded under the section's other name."""


def spec_record(spec: StudySpec) -> dict[str, Any]:
    """The resolved spec as plain data (JSON and YAML): paths absolute, search dimensions by name,
    the storage URL without its password (``strip_password``), every other URI's shown as ``***``
    (``redact_record``: a tracker's ``tracking_uri``)."""
    d = dataclasses.asdict(spec)
    d.pop("source", None)
    search = d.pop("search")
    d["search"] = {p.pop("name"): p for p in search["params"]} | {"target_sets": search["target_sets"]}
    if d.get("storage"):
        d["storage"] = strip_password(d["storage"])
    return redact_record(json.loads(json.dumps(d, default=str)))


def _flat(d: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(d, dict):
        return {prefix: d}
    out: dict[str, Any] = {}
    for k, v in d.items():
        out |= _flat(v, f"{prefix}.{k}" if prefix else str(k))
    return out


def _section_defaults() -> dict[str, Any]:
    """The flattened defaults of the spec's sections that have them (``train.lr_ratio``: 1.0, ...), as recorded."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(StudySpec):
        if callable(f.default_factory) and dataclasses.is_dataclass(value := f.default_factory()):
            out |= _flat(json.loads(json.dumps(dataclasses.asdict(value), default=str)), f.name)  # type: ignore[arg-type]
    return out


def spec_changes(earlier: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """'key changed (old -> new)' for each fixed setting (not under ``RESUMABLE``) that differs. A setting the
    earlier record lacks (a key this version reads that the recording one did not) and that is at its default now is
    no change: the earlier run trained as that default does."""
    a, b = _flat(earlier), _flat(now)
    defaults = _section_defaults()
    keys = [k for k in dict.fromkeys([*a, *b]) if a.get(k) != b.get(k)
            and not (k not in a and k in defaults and b.get(k) == defaults[k])
            and not any(k == r or k.startswith(r + ".") for r in RESUMABLE)]
    return [f"{k} changed ({json.dumps(a.get(k))} -> {json.dumps(b.get(k))})" for k in keys]


def record_spec(spec: StudySpec, sdir: StudyDir, store: ResultsStore, log: Callable[[str], None],
                allow_changes: bool = False, started: bool = True) -> None:
    """Compare the resolved spec with the one the study started with, then record it in the store (meta
    ``spec``, what the report reads) and the directory (``study.yaml``). ``started``: a trial finished; until
    then the spec an earlier (failed) run recorded pins nothing, and what changed is only logged.

    Raises:
        UserError: a fixed setting changed (the first one named, and how many more) and not ``allow_changes``.
    """
    record = spec_record(spec)
    earlier = store.meta().get("spec")
    changed = [] if earlier is None else spec_changes(earlier, record)
    if not started:
        for change in changed:
            log(f"starting afresh with {change}: the earlier run finished no trial")
        changed = []
    if changed and not allow_changes:
        raise UserError(f"run: {changed[0]} since the study started"
                        f"{f' (and {len(changed) - 1} more)' if len(changed) > 1 else ''}; a resumed study keeps its "
                        f"fixed settings: give the same overrides again, or pass --allow-changes (allow_changes=True "
                        f"in the API)")
    for change in changed:
        log(f"resuming with {change} (--allow-changes)")
    store.set_meta(spec=record)
    sdir.write_study_yaml("# The resolved study this directory's last run used (overrides and aliases applied).\n"
                          + yaml.safe_dump(record, sort_keys=False))
