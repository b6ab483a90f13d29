"""A trial's data stream and step count from the study: accumulation, sample packing and epochs, in one place.

``sweep.study`` asks these when it starts a trial, so the stream it trains on, the optimizer steps it
runs for (from ``train.epochs`` when no ``max_steps`` is given) and the tokens the budget plans for it
(``sweep.budget.TokenPlan`` for plain streams) are computed from the same numbers: the packer's
(``packer.data.stream``), given the study's seed and row length.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import replace

from lora_sweep.evaluators.registry import load_eval_data
from lora_sweep.packer.api import AdapterSpec, Packer, data
from lora_sweep.sweep.config.spec import StudySpec
from lora_sweep.sweep.pack_step import bucket_lengths

__all__ = ["trial_adapter", "trial_stream", "planned_tokens", "check_packing", "check_data",
           "step_lengths"]


def trial_adapter(spec: StudySpec, adapter: AdapterSpec, searched: Sequence[str], examples: Sequence[data.Example]
                  ) -> AdapterSpec:
    """The adapter with ``max_steps`` from ``train.epochs`` when it is set and ``max_steps`` is not searched,
    then ``warmup_steps`` from ``train.warmup_ratio`` when no warm-up is given in steps."""
    train = spec.train
    if train.epochs is not None and "max_steps" not in searched:
        steps = data.epoch_steps(examples, adapter, train.epochs, spec.data.max_length, spec.seed,
                            train.max_steps_per_epoch)
        adapter = replace(adapter, max_steps=steps)
    if train.warmup_ratio is not None and "warmup_steps" not in searched and not train.warmup_steps:
        adapter = replace(adapter, warmup_steps=math.ceil(train.warmup_ratio * adapter.max_steps))
    return adapter


def trial_stream(spec: StudySpec, adapter: AdapterSpec,
                 examples: Sequence[data.Example]) -> data.SlotStream | data.SamplePackedStream:
    """The trial's stream: every trial the same seeded order (pack peers are paired samples)."""
    return data.adapter_stream(examples, adapter, spec.seed, spec.data.max_length)


def planned_tokens(spec: StudySpec, adapter: AdapterSpec, examples: Sequence[data.Example],
                   plain: Callable[[int, int], int]) -> int:
    """Target tokens of the trial's ``max_steps * accumulation`` micro-batches; ``plain(micro_batch, n)``
    counts them for an unpacked stream (cached)."""
    n = adapter.max_steps * adapter.gradient_accumulation_steps
    if not adapter.sample_packing:
        return plain(adapter.micro_batch, n)
    return data.stream_tokens(examples, adapter, spec.seed, spec.data.max_length, n)


def check_packing(spec: StudySpec, packer: Packer) -> None:
    """Refuse a study that may sample-pack (fixed or searched) on a family packing is not verified for, or on a
    model whose packed rows' examples attend to each other under the installed transformers (before any trial)."""
    searched = any(p.name == "sample_packing" and True in p.choices for p in spec.search.params)
    if spec.train.sample_packing or searched:
        packer.check_sample_packing()


def check_data(spec: StudySpec) -> None:
    """Read and check every row of the training and held-out files (JSON, the format's fields, each row within
    ``data.max_line_bytes`` before it is parsed), before the model loads: a bad row is one line in seconds, not after
    the base model's load. (Tokenizing needs the model's tokenizer and comes after it.)

    Raises:
        DataError: the first bad row, as ``file:line``.
    """
    data.read_jsonl(spec.data.train, spec.data.format, spec.data.line_bytes)
    if spec.data.eval is not None:
        load_eval_data(spec.data.eval, None, fmt=spec.data.format, max_line_bytes=spec.data.line_bytes)


def step_lengths(spec: StudySpec, examples: Sequence[data.Example], capacity: int) -> tuple[int, ...]:
    """The padded lengths a pack's steps may take (``sweep.pack_step.bucket_lengths``, which ``sweep plan`` times
    with): at most a few, fitted to the rows of ``examples``."""
    return bucket_lengths(spec, [len(e.input_ids) for e in examples], capacity)
