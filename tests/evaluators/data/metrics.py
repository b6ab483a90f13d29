"""Custom metrics used by the tests, loaded as ``tests/evaluators/data/metrics.py:<function>``."""


def says_yes(generation: str, row: dict) -> float:
    """1.0 when the answer is yes, whatever the question."""
    return float(generation.strip() == "yes")


def no_yes_allowed(generation: str, row: dict) -> float:
    """Raises on a yes answer: the adapter that always says yes fails, the others are scored."""
    if "yes" in generation:
        raise ValueError(f"cannot score {generation!r}\nfor {row['prompt']!r}")
    return 1.0


def share_of_yes(generations: list[str], rows: list[dict]) -> float:
    """Whole-set metric: the share of yes answers."""
    return sum(g.strip() == "yes" for g in generations) / len(generations)


def not_a_number(generation: str, row: dict) -> str:
    return "high"
