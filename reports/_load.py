"""Everything the report shows, read once from a study directory's results store.

Reports read only ``store``: the results tables, and in its ``study`` table the resolved spec
the last run used (its budget included: overrides and aliases applied) and the Optuna storage URL.
The directory's ``study.yaml`` is a copy for people; nothing here reads it.
"""

from __future__ import annotations

import math
import warnings
from pathlib import Path
from typing import Any, NamedTuple

from lora_sweep.store.api import (
    EvalRow,
    ItemRow,
    PackRecord,
    PruneDecision,
    ResultsStore,
    SlotSpan,
    StepRow,
    StudyDir,
    TrialRecord,
    is_feasible,
    pareto_front,
    reference_trial,
)

__all__ = ["StudyData", "load_study_data", "load_optuna_study", "objective_values", "pareto_numbers", "best_trial"]


SAMPLE_ITEMS = 5
"""Generated answers the report shows per trial and evaluator metric."""


class StudyData(NamedTuple):
    """One snapshot of a study directory."""

    root: Path
    meta: dict[str, Any]
    objectives: list[str]
    directions: list[str]
    trials: list[TrialRecord]
    curves: dict[int, list[StepRow]]
    rung_evals: list[EvalRow]
    items: dict[str, dict[int, dict[int, float | None]]]
    """evaluator metric -> trial -> item index -> score; only the default and the best trials."""
    packs: list[PackRecord]
    spans: list[SlotSpan]
    prunes: list[PruneDecision]
    budget: dict[str, Any]
    """The resolved spec's ``budget`` ({} when the store records no spec)."""
    samples: dict[int, dict[str, list[ItemRow]]] = {}  # noqa: RUF012 (load_study_data passes its own)
    """trial -> evaluator metric -> the first items that kept generated text; the default and the best trials."""
    eval_curves: list[EvalRow] = []  # noqa: RUF012 (load_study_data passes its own)
    """Held-out evaluations during training (``train.eval_every``; kind 'curve'), in trial and step order."""

    @property
    def complete(self) -> list[TrialRecord]:
        return [t for t in self.trials if t.state == "COMPLETE"]

    @property
    def default(self) -> TrialRecord | None:
        """The trial the gain is measured against: the config's own hyperparameters when the study has that trial,
        else the community default (``reference_trial``, which also names it: ``default_name``)."""
        found = reference_trial(self.trials)
        return found[0] if found else None

    @property
    def default_name(self) -> str:
        """``config baseline`` or ``default``: how the report names the ``default`` trial."""
        found = reference_trial(self.trials)
        return found[1] if found else "default"

    @property
    def constraints(self) -> list[dict[str, Any]]:
        """The study's constraints ({metric, op, value}), as the store keeps them."""
        return list(self.meta.get("constraints") or [])

    def feasible(self, t: TrialRecord) -> bool:
        """Whether the trial's metrics meet every constraint (always, in a study without any)."""
        return is_feasible(t.metrics, self.constraints)

    @property
    def candidates(self) -> list[TrialRecord]:
        """The complete trials the best are chosen from: the feasible ones, or all when none is feasible
        (Optuna's rule: a feasible trial beats any infeasible one)."""
        return [t for t in self.complete if self.feasible(t)] or self.complete

    @property
    def running(self) -> bool:
        """True while a run trains (or after a run was killed): RUNNING trials or a 'running' pack."""
        return any(t.state == "RUNNING" for t in self.trials) or any(p.status == "running" for p in self.packs)


def objective_values(t: TrialRecord, n: int) -> list[float] | None:
    """The trial's ``n`` objective values if all are finite, else None."""
    vals = t.objective_values or []
    if len(vals) != n or any(v is None or not math.isfinite(v) for v in vals):
        return None
    return [float(v) for v in vals]  # type: ignore[arg-type]


def pareto_numbers(trials: list[TrialRecord], directions: list[str]) -> list[int]:
    """Numbers of the complete trials with finite values that no other such trial dominates."""
    return pareto_front([(t.number, vals) for t in trials
                         if t.state == "COMPLETE" and (vals := objective_values(t, len(directions))) is not None],
                        directions)


def best_trial(trials: list[TrialRecord], index: int, directions: list[str]) -> TrialRecord | None:
    """The complete trial with the best finite value of objective ``index`` (lowest number on ties)."""
    sign = 1.0 if directions[index] == "minimize" else -1.0
    done = [(sign * vals[index], t.number, t) for t in trials if t.state == "COMPLETE"
            and (vals := objective_values(t, len(directions))) is not None]
    return min(done, key=lambda x: (x[0], x[1]))[2] if done else None


def load_study_data(root: str | Path) -> StudyData:
    """Read a study directory.

    Raises:
        FileNotFoundError: ``root`` holds no study (no results.db).
    """
    sdir = StudyDir(root)
    if not sdir.results_db.is_file():
        raise FileNotFoundError(f"{root}: not a study directory (no results.db)")
    with ResultsStore(sdir.results_db, create=False) as store:
        meta = store.meta()
        objectives, directions = list(meta.get("objectives") or []), list(meta.get("directions") or [])
        trials = store.trials()
        data = StudyData(sdir.root, meta, objectives, directions, trials, store.curves(), store.evals(kind="rung"),
                         {}, store.packs(), store.spans(), store.prune_decisions(), _budget(meta),
                         eval_curves=sorted(store.evals(kind="curve"), key=lambda e: (e.trial, e.step)))
        wanted = {t.number for i in range(len(directions)) if (t := best_trial(data.candidates, i, directions))}
        if data.default is not None:
            wanted.add(data.default.number)
        data = data._replace(samples={})
        for number in sorted(wanted):
            for row in store.items(trial=number):
                data.items.setdefault(row.evaluator, {}).setdefault(number, {})[row.item] = row.score
                shown = data.samples.setdefault(number, {}).setdefault(row.evaluator, [])
                if isinstance(row.detail, dict) and "output" in row.detail and len(shown) < SAMPLE_ITEMS:
                    shown.append(row)
    return data


def _budget(meta: dict[str, Any]) -> dict[str, Any]:
    """The budget the last run used, from the resolved spec in the store (meta ``spec``)."""
    spec = meta.get("spec")
    budget = spec.get("budget") if isinstance(spec, dict) else None
    return dict(budget) if isinstance(budget, dict) else {}


def _storage(url: str) -> Any:
    """An RDB URL as is; ``journal:///path`` (a study directory's default, or workers' on one host) as a
    JournalStorage."""
    if not url.startswith("journal:///"):
        return url
    import optuna
    from optuna.storages.journal import JournalFileBackend

    path = Path(url.removeprefix("journal://"))
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist")
    return optuna.storages.JournalStorage(JournalFileBackend(str(path)))


def load_optuna_study(data: StudyData) -> Any:
    """The Optuna study behind the report (for ``optuna.visualization``), or an error text when unreachable."""
    import optuna

    name, storage = data.meta.get("name"), data.meta.get("storage")
    if not name or not storage:
        return "the store records no Optuna storage"
    if storage.startswith("sqlite:///") and not Path(storage.removeprefix("sqlite:///")).is_file():
        return f"the Optuna storage {storage} does not exist"  # opening it would create an empty database
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return optuna.load_study(study_name=name, storage=_storage(storage))
    except Exception as err:  # SQLAlchemy and Optuna raise many types for a missing or unreachable storage
        return f"cannot open the Optuna storage {storage}: {str(err).strip().splitlines()[0] if str(err) else err!r}"
