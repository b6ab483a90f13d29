"""Step lengths chosen from the data: at most MAX_BUCKETS shapes per pack, the least padding such a choice allows,
and a pack over rows spread to 512 tokens training on no more shapes than that."""

from __future__ import annotations

import itertools
import random
from dataclasses import replace

import numpy as np
import pytest

from lora_sweep.packer.data.rows import IGNORE_INDEX, Example, SlotStream
from lora_sweep.packer.model.load import load_base
from lora_sweep.packer.model.packed import PackedModel
from lora_sweep.packer.step.shapes import MAX_BUCKETS, SAMPLES, length_buckets, padded_length
from lora_sweep.packer.step.train import SlotJob, train
from tests.helpers import LLAMA_SPECS, PAD


def _spread(n: int, top: int, seed: int = 0) -> list[int]:
    """Row lengths spread log-uniformly over 4..top, as instruction data with a long tail."""
    rng = random.Random(seed)
    return [min(top, max(4, round(4 * (top / 4) ** rng.random()))) for _ in range(n)]


def test_padded_length_takes_the_smallest_bucket_that_holds_the_row() -> None:
    assert padded_length(40, 16, (48, 128, 512)) == 48
    assert padded_length(48, 16, (48, 128, 512)) == 48
    assert padded_length(49, 16, (48, 128, 512)) == 128
    assert padded_length(600, 16, (48, 128, 512)) == 608  # longer than every bucket: a multiple of 16
    assert padded_length(33, 16) == 48


@pytest.mark.parametrize("top", [512, 2048])
@pytest.mark.parametrize("rows", [1, 4, 32])
def test_buckets_are_few_ascending_multiples_and_hold_the_longest_row(top: int, rows: int) -> None:
    lengths = _spread(3000, top, seed=rows)
    buckets = length_buckets(lengths, rows)
    assert 1 <= len(buckets) <= MAX_BUCKETS
    assert list(buckets) == sorted(set(buckets))
    assert all(b % 16 == 0 for b in buckets)
    assert buckets[-1] == padded_length(max(lengths), 16)
    assert length_buckets(lengths, rows) == buckets  # the same data gives the same lengths


def test_few_distinct_lengths_keep_their_own_buckets() -> None:
    assert length_buckets([10, 20, 20, 40], rows_per_step=1) == (16, 32, 48)


def test_the_buckets_pad_least_of_every_choice_of_that_many() -> None:
    """The dynamic programme's answer against every choice of at most 3 lengths among the candidates, on the same
    simulated steps (the seed fixes them)."""
    lengths = _spread(400, 160, seed=3)
    rows, k = 2, 3
    buckets = length_buckets(lengths, rows, max_buckets=k)
    draws = np.random.default_rng(0).integers(0, len(lengths), size=(SAMPLES, rows))
    longest = -(-np.asarray(lengths)[draws].max(axis=1) // 16) * 16
    top = padded_length(max(lengths), 16)
    candidates = sorted(set(longest.tolist()) | {top})

    def cost(choice: tuple[int, ...]) -> int:
        return sum(padded_length(int(s), 16, choice) for s in longest)

    best = min(cost(c + (top,)) for n in range(k) for c in itertools.combinations(candidates[:-1], n))
    assert cost(buckets) == best


def test_a_pack_over_rows_spread_to_512_tokens_trains_on_at_most_the_bounded_shapes(tiny_dirs) -> None:
    """Unbounded, steps padded to multiples of 16 take a dozen and more lengths on such data; with the lengths
    fitted to it the pack takes at most MAX_BUCKETS, and every step still holds its rows."""
    rng = random.Random(7)
    examples = []
    for n in _spread(300, 512, seed=7):
        ids = tuple(rng.randrange(3, 300) for _ in range(n))
        examples.append(Example(ids, (IGNORE_INDEX,) * (n // 2) + ids[n // 2:]))
    specs = [replace(s, max_steps=10, micro_batch=1) for s in LLAMA_SPECS[:2]]

    def run(lengths: tuple[int, ...] | None):  # noqa: ANN202
        model, _ = load_base(str(tiny_dirs("llama")), attn_implementation="eager")
        jobs = [SlotJob(s, SlotStream(examples, 1, seed=s.seed), key=i) for i, s in enumerate(specs)]
        return train(PackedModel(model, impl="torch"), 2, lambda slot: jobs.pop(0) if jobs else None, pad_id=PAD,
                     lengths=lengths)

    unbounded = run(None)
    buckets = length_buckets([len(e.input_ids) for e in examples], rows_per_step=2)
    bounded = run(buckets)
    assert len(unbounded.shapes) > MAX_BUCKETS  # the data does spread: the bound is what holds it
    assert len(bounded.shapes) <= MAX_BUCKETS
    assert {length for _, length in bounded.shapes} <= set(buckets)
    assert bounded.steps == unbounded.steps == 10
