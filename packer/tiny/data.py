"""The tiny models' task: generated arithmetic with checkable answers (add, subtract, reverse digits), in the
alpaca, prompt/completion and chat row formats, and the demo data files written from it.

``python -m lora_sweep.packer.tiny.models --write-demo-data studies/data`` regenerates the tiny demo's data with
``write_demo_data``;
``packer.tiny.models`` also trains its tokenizer on this task's text.
"""

from __future__ import annotations

import json
import os
import random
import secrets
from collections.abc import Iterable
from pathlib import Path

from lora_sweep.errors import ConfigError

__all__ = ["arithmetic_rows", "write_demo_data", "write_jsonl", "DEMO_SEED", "DEMO_TRAIN", "DEMO_EVAL"]


def _add(rng: random.Random) -> tuple[str, str, str]:
    a, b = rng.randint(0, 99), rng.randint(0, 99)
    return "Add the numbers.", f"{a}+{b}", str(a + b)


def _subtract(rng: random.Random) -> tuple[str, str, str]:
    b, a = sorted((rng.randint(0, 99), rng.randint(0, 99)))  # non-negative answers
    return "Subtract the second number from the first.", f"{a}-{b}", str(a - b)


def _reverse(rng: random.Random) -> tuple[str, str, str]:
    digits = "".join(rng.choice("0123456789") for _ in range(rng.randint(3, 5)))
    return "Reverse the digits.", digits, digits[::-1]


_TASKS = (_add, _subtract, _reverse)
_MAX_ROWS = len(_TASKS) * 5050  # subtract has the fewest distinct items: 100 * 101 / 2 pairs a >= b
_FORMATS = ("alpaca", "prompt_completion", "chat")


def arithmetic_rows(n: int, seed: int, *, fmt: str = "alpaca") -> list[dict]:
    """Generate ``n`` distinct items of a task with checkable answers: add, subtract, reverse digits.

    Each item is an instruction (``"Add the numbers."``), an input (``"37+48"``) and the exact answer
    (``"85"``). Operands have up to two digits, differences are non-negative, and digit strings to
    reverse have 3-5 digits (leading zeros kept). The three operations take turns. No item repeats within
    one call, so slices of one call are disjoint, and a shorter call is a prefix of a longer one.

    Args:
        n: Number of rows.
        seed: Generator seed; the same ``(n, seed)`` gives the same rows in every format.
        fmt: ``"alpaca"`` (``instruction``/``input``/``output``), ``"prompt_completion"`` (``prompt`` is
            instruction and input on their own lines plus a newline, ``completion`` the answer) or ``"chat"``
            (``messages``: user turn instruction and input, assistant turn the answer).

    Returns:
        ``n`` JSON-ready dicts.

    Raises:
        ConfigError: Unknown ``fmt``, or ``n`` above 15150 (the items run out).
    """
    if fmt not in _FORMATS:
        raise ConfigError(f"unknown data format {fmt!r}; expected one of {', '.join(_FORMATS)}")
    if n > _MAX_ROWS:
        raise ConfigError(f"n must be <= {_MAX_ROWS} (distinct items available), got {n}")
    rng = random.Random(seed)
    seen: set[tuple[str, str]] = set()
    rows: list[dict] = []
    while len(rows) < n:
        instruction, inp, output = _TASKS[len(rows) % len(_TASKS)](rng)  # equal shares; a repeat redraws
        if (instruction, inp) in seen:
            continue
        seen.add((instruction, inp))
        rows.append(_format(instruction, inp, output, fmt))
    return rows


def _format(instruction: str, inp: str, output: str, fmt: str) -> dict:
    if fmt == "alpaca":
        return {"instruction": instruction, "input": inp, "output": output}
    if fmt == "prompt_completion":
        return {"prompt": f"{instruction}\n{inp}\n", "completion": output}
    messages = [{"role": "user", "content": f"{instruction}\n{inp}"}, {"role": "assistant", "content": output}]
    return {"messages": messages}


def write_jsonl(path: str | Path, rows: Iterable[dict]) -> None:
    """Write one JSON object per line, atomically (a temp file in the same directory, then ``os.replace``)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")  # mkstemp would make it 0600
    try:
        with open(tmp, "x", encoding="utf-8", newline="\n") as f:
            for row in rows:
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


DEMO_SEED = 0
DEMO_TRAIN, DEMO_EVAL = 2000, 200


def write_demo_data(out_dir: str | Path) -> tuple[Path, Path]:
    """(Re)write ``arith-train.jsonl`` (2000 rows) and ``arith-eval.jsonl`` (200 rows), disjoint.

    Prompt/completion format: the shortest rows (~15 tokens), so the CPU demo trains many trials fast.

    Returns:
        The train and eval paths.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    train, held_out = out_dir / "arith-train.jsonl", out_dir / "arith-eval.jsonl"
    pc = arithmetic_rows(DEMO_TRAIN + DEMO_EVAL, seed=DEMO_SEED, fmt="prompt_completion")
    write_jsonl(train, pc[:DEMO_TRAIN])
    write_jsonl(held_out, pc[DEMO_TRAIN:])
    return train, held_out
