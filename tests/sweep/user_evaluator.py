"""A user's evaluator for tests/sweep/test_user_code.py, copied beside each test's study file as ``ev.py``.

Each execution of the file appends a line to ``imports.log`` beside it (how often a study imports it); its ``mode``
option picks how it misbehaves. ``RELEASE`` lets a hung evaluator's thread end once the test is done with it.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lora_sweep.evaluators.registry import EvalData, EvalResult, Evaluator

with open(Path(__file__).with_name("imports.log"), "a") as log:
    log.write("imported\n")

RELEASE = threading.Event()


@dataclass(frozen=True)
class Options:
    mode: str = "ok"
    """ok, raise, dict, string, nan or hang."""


def score(model: Any, slots: Sequence[int], data: EvalData, **options: Any) -> Any:
    mode = Options(**options).mode
    if mode == "raise":
        raise RuntimeError("the judge is down\n(second line)")
    if mode == "dict":
        return {slot: {"ev_score": 1.0} for slot in slots}
    if mode == "hang":
        RELEASE.wait(3600)
    value = {"string": "0.5", "nan": float("nan")}.get(mode, 0.5)
    return EvalResult(metrics={slot: {"ev_score": value} for slot in slots})


EV = Evaluator("ev", Options, score, metrics=lambda opts: {"ev_score": "maximize"}, reports="`ev_score`")
