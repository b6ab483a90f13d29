"""Per-item scorers of a generated answer against the reference: 1.0 right, 0.0 wrong.

The numeric extractor follows the GSM8K convention (the answer follows ``####``, as in lm-eval's
``gsm8k`` "strict-match" filter ``#### (\\-?[0-9\\.\\,]+)``) and falls back to the last number in the
text (lm-eval's "flexible-extract" takes the last match too). Thousands separators and a leading ``$``
are dropped before comparing as numbers, so ``1,000`` matches ``1000`` and ``42.0`` matches ``42``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable

__all__ = ["SCORERS", "exact_match", "contains", "numeric_match", "extract_number"]

_HASH_ANSWER = re.compile(r"####\s*(-?\$?[0-9][0-9.,]*)")
_NUMBER = re.compile(r"-?\$?[0-9][0-9,]*(?:\.[0-9]+)?")


def exact_match(prediction: str, reference: str) -> float:
    """1.0 when the prediction equals the reference, surrounding whitespace ignored."""
    return float(prediction.strip() == reference.strip())


def contains(prediction: str, reference: str) -> float:
    """1.0 when the (stripped, non-empty) reference occurs in the prediction."""
    ref = reference.strip()
    return float(bool(ref) and ref in prediction)


def extract_number(text: str) -> float | None:
    """The answer number of ``text``: after ``####`` if present, else the last number; None if there is none."""
    match = _HASH_ANSWER.search(text)
    candidates = [match.group(1)] if match else _NUMBER.findall(text)
    for raw in reversed(candidates):
        cleaned = raw.replace(",", "").replace("$", "").rstrip(".")
        try:
            return float(cleaned)
        except ValueError:
            continue
    return None


def numeric_match(prediction: str, reference: str) -> float:
    """1.0 when both texts hold an answer number and the numbers are equal (relative tolerance 1e-9)."""
    pred, ref = extract_number(prediction), extract_number(reference)
    return float(pred is not None and ref is not None and math.isclose(pred, ref, rel_tol=1e-9, abs_tol=1e-12))


SCORERS: dict[str, Callable[[str, str], float]] = {
    "exact_match": exact_match,
    "contains": contains,
    "numeric_match": numeric_match,
}
"""Scorer name (also its metric name) -> ``(prediction, reference) -> 0.0 | 1.0``."""
