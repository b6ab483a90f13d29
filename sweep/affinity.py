"""CPU shares of the workers of one host: ``sweep run --workers N`` gives each worker its own cores.

A packed step of a small model is host-bound (Python between kernel launches), so a worker runs at the
pace of the cores it gets. Each worker is pinned to a disjoint, contiguous share of the cores the
launcher may use, and sizes torch's CPU thread pool to that share, instead of N workers each spreading
a pool of every core's size over all of them.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from lora_sweep.errors import UserError

__all__ = ["allowed_cpus", "cpu_shares", "cpu_list", "parse_cpu_list", "pin"]


def allowed_cpus() -> list[int]:
    """The CPU ids this process may run on (a cluster scheduler's cpuset included); empty off Linux."""
    return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []


def cpu_shares(cpus: Sequence[int], n: int) -> list[list[int]]:
    """``cpus`` split into ``n`` contiguous, disjoint shares, the first ones a CPU larger when ``n`` does not
    divide them; ``n`` empty shares (nobody pinned) when there are fewer CPUs than workers."""
    if len(cpus) < n:
        return [[] for _ in range(n)]
    size, extra = divmod(len(cpus), n)
    shares, start = [], 0
    for i in range(n):
        end = start + size + (i < extra)
        shares.append(list(cpus[start:end]))
        start = end
    return shares


def cpu_list(cpus: Sequence[int]) -> str:
    """Linux's CPU list notation (``0-3,8,10-11``) of sorted ``cpus``."""
    runs: list[list[int]] = []
    for c in cpus:
        if runs and c == runs[-1][1] + 1:
            runs[-1][1] = c
        else:
            runs.append([c, c])
    return ",".join(f"{a}" if a == b else f"{a}-{b}" for a, b in runs)


def parse_cpu_list(text: str) -> set[int]:
    """The CPU ids of a CPU list (``0-3,8``).

    Raises:
        UserError: not a CPU list.
    """
    cpus: set[int] = set()
    try:
        for part in text.split(","):
            lo, dash, hi = part.strip().partition("-")
            first, last = int(lo), int(hi if dash else lo)
            if first < 0 or last < first:
                raise ValueError(part)
            cpus.update(range(first, last + 1))
    except ValueError:
        raise UserError(f"worker: --cpus {text!r} is not a CPU list such as 0-15 or 0,2,4-7") from None
    return cpus


def pin(text: str) -> None:
    """Run this process (and the threads it starts from now on) on the CPUs of the list ``text``.

    Raises:
        UserError: not a CPU list, no such CPUs allowed here, or not Linux.
    """
    cpus = parse_cpu_list(text)
    if not hasattr(os, "sched_setaffinity"):
        raise UserError("worker: --cpus needs Linux (os.sched_setaffinity)")
    try:
        os.sched_setaffinity(0, cpus)
    except OSError as err:
        raise UserError(f"worker: --cpus {text}: {err.strerror} (this process may use {cpu_list(allowed_cpus())})") \
            from None
