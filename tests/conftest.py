"""Shared fixtures: tiny models built in code, saved and loaded back like a user's checkpoint."""

from __future__ import annotations

import random
from collections import defaultdict
from pathlib import Path

import pytest
import torch

from packer.batch import IGNORE_INDEX
from packer.data import Example
from packer.tiny import build_tiny_model

torch.set_num_threads(1)  # tiny models gain nothing from threads; one keeps timings stable


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory: pytest.TempPathFactory):
    """family -> directory of a saved tiny model (built once per test session)."""
    cache: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in cache:
            cache[family] = build_tiny_model(family, tmp_path_factory.mktemp(f"tiny-{family}"), seed=0)
        return cache[family]

    return get


def random_examples(n: int, seed: int, vocab: int = 300, min_len: int = 6, max_len: int = 24) -> list[Example]:
    """Synthetic rows of random lengths with a masked prompt, for engine tests that need no text."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        length = rng.randint(min_len, max_len)
        ids = tuple(rng.randrange(3, vocab) for _ in range(length))
        prompt = rng.randint(1, length - 2)
        rows.append(Example(ids, (IGNORE_INDEX,) * prompt + ids[prompt:]))
    return rows


class Recorder:
    """``train()`` callbacks that keep each job's per-step losses and its final weights."""

    def __init__(self, pm, snapshot=None) -> None:  # noqa: ANN001
        self.losses: dict = defaultdict(list)
        self.final: dict = {}
        self.global_step = 0
        self.snapshot = snapshot or (lambda slot: {p: (a.detach().clone(), b.detach().clone())
                                                   for p, (a, b) in pm.slot_weights(slot).items()})

    def on_step(self, reports) -> None:  # noqa: ANN001
        self.global_step = reports[0].step + 1
        for r in reports:
            self.losses[r.key].append(r.loss)

    def on_end(self, ends) -> None:  # noqa: ANN001
        for e in ends:
            self.final[e.job.key] = self.snapshot(e.slot)
