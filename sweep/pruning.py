"""Synchronous cohort successive halving for lock-step packs.

Optuna's pruners do not fit packs: Median/Percentile compare only with COMPLETE trials, so a whole
first pack is immune; SuccessiveHalving's answer depends on the order in which peers ask; none works
in multi-objective studies. Here every trial
that reaches a rung is ranked against every trial that has ever reached that rung (pack peers
arriving at the same step, earlier trials, finished ones), and kept only if it ranks in the best
``ceil(n / reduction_factor)`` of those ``n``. Ties go to the lower trial number; NaN ranks last. The
decision depends only on the values, never on call order, so a rerun decides the same.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["CohortSHA", "Decision"]


@dataclass(frozen=True)
class Decision:
    """One trial's fate at one rung."""

    trial: int
    rung: int
    keep: bool
    value: float
    rank: int
    """0-based rank in the cohort (0 = best)."""
    cohort_size: int
    kept: int
    """How many of the cohort ``ceil(n / reduction_factor)`` keeps."""

    @property
    def reason(self) -> str:
        verdict = "kept" if self.keep else "pruned"
        return (f"{verdict} at step {self.rung}: rank {self.rank + 1} of {self.cohort_size} "
                f"(best {self.kept} kept), value {self.value:.6g}")


class CohortSHA:
    """Rank trials at rung steps against everything seen at that rung.

    Args:
        rungs: optimizer steps at which trials are compared.
        reduction_factor: keep the best 1/reduction_factor of each cohort.
        direction: ``minimize`` or ``maximize`` the ranked value.
        history: values already seen, ``{rung: {trial: value}}`` (e.g. reloaded on resume).
    """

    def __init__(self, rungs: tuple[int, ...], reduction_factor: int, direction: str,
                 history: Mapping[int, Mapping[int, float]] | None = None) -> None:
        self.rungs = tuple(rungs)
        self.eta = reduction_factor
        self.sign = 1.0 if direction == "minimize" else -1.0
        self.seen: dict[int, dict[int, float]] = {r: dict((history or {}).get(r, {})) for r in self.rungs}

    def _key(self, item: tuple[int, float]) -> tuple[float, int]:
        trial, value = item
        return (math.inf if math.isnan(value) else self.sign * value, trial)

    def decide(self, rung: int, arrivals: Mapping[int, float]) -> list[Decision]:
        """Record the trials that reached ``rung`` together and decide each one.

        Args:
            rung: the rung step.
            arrivals: trial number -> its value at the rung.

        Returns:
            One decision per arriving trial, in trial order.
        """
        cohort = self.seen[rung]
        cohort.update(arrivals)
        order = [t for t, _ in sorted(cohort.items(), key=self._key)]
        kept = math.ceil(len(order) / self.eta)
        rank = {t: i for i, t in enumerate(order)}
        return [Decision(t, rung, rank[t] < kept, arrivals[t], rank[t], len(order), kept) for t in sorted(arrivals)]
