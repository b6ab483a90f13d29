"""Sample packing on short instruction rows: padding fraction and tokens/s with and without it.

A command, not a timed test: ``python -m lora_sweep.benchmarks.packing_bench`` (CPU: the tiny Llama;
``--shape qwen2.5-0.5b`` on a GPU: a random-init model of that shape, ``benchmarks.shapes.SHAPES``).
The rows are synthetic short instruction rows: random tokens, lengths drawn log-normally (median 25
tokens, sigma 0.8, clipped to 8..``--row-len``; seed 0), the first half of each row a masked prompt.
Both runs train ``--slots`` adapters for the same steps: unpacked, each slot's
micro-batch is ``--micro`` examples padded to the pack's longest row; packed, each slot's micro-batch
is as many rows of ``--row-len`` tokens as hold about as many examples. Reported per run: examples
and real (non-padding) tokens per step, the padding fraction of the padded batch, the median step
time (``timing.timed_steps``: the loss read back and the device synchronised after every step), and real tokens/s.
Unpacked steps pad to the step lengths a sweep fits to the data (at most ``packer.step.shapes.MAX_BUCKETS``:
bounded shapes, so bounded CUDA graphs; ``--unbounded``: a multiple of 16 each, as before); each run also says the
step shapes and graphs it took and, on CUDA, the most memory the allocator reserved (the graphs' pool included).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import tempfile
from typing import Any

import torch

from lora_sweep.benchmarks.shapes import PROJ, build_shape
from lora_sweep.benchmarks.timing import check_row, counted_params, gemm_tflops, sig, step_flops, timed_steps
from lora_sweep.packer.data.packing import SamplePackedStream, slot_stream
from lora_sweep.packer.data.rows import IGNORE_INDEX, Example, SlotStream, load_examples
from lora_sweep.packer.model.load import load_base
from lora_sweep.packer.model.packed import PackedModel
from lora_sweep.packer.plan import AdapterSpec
from lora_sweep.packer.step.loop import SEQ_MULTIPLE
from lora_sweep.packer.step.shapes import length_buckets, padded_length
from lora_sweep.packer.step.train import SlotJob
from lora_sweep.packer.tiny.models import build_tiny_model

__all__ = ["run", "main"]

class _Recorded:
    """A stream that keeps the rows it served, to measure the padded batches afterwards."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.served = inner, []  # type: ignore[var-annotated]

    def next_batch(self) -> list[Any]:
        rows = self.inner.next_batch()
        self.served.append(rows)
        return rows


def _examples(n: int, row_len: int, vocab: int = 500) -> list[Example]:
    rng = random.Random(0)
    out = []
    for _ in range(n):
        length = min(row_len, max(8, round(rng.lognormvariate(math.log(25), 0.8))))
        ids = tuple(rng.randrange(3, vocab) for _ in range(length))
        out.append(Example(ids, (IGNORE_INDEX,) * (length // 2) + ids[length // 2:]))
    return out


def _run(model: torch.nn.Module, examples: list[Example], *, slots: int, micro: int, packed: bool, row_len: int,
         steps: int, warmup: int, flops_per_token: float, tflops: float, bounded: bool = True) -> dict:
    """One run's row (module docstring), checked (``check_row``) against the device's GEMM rate ``tflops``."""
    lengths = length_buckets([len(e.input_ids) for e in examples], slots * micro) if bounded and not packed else None
    cuda = next(model.parameters()).is_cuda
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    pm = PackedModel(model, impl="triton" if next(model.parameters()).is_cuda else "torch")
    streams = []
    jobs = []
    for i in range(slots):
        inner = SamplePackedStream(examples, micro, i, row_len) if packed else SlotStream(examples, micro, i)
        streams.append(_Recorded(inner))
        spec = AdapterSpec(rank=16, alpha=32, targets=PROJ, micro_batch=micro, max_steps=warmup + steps, seed=i,
                           lr=1e-4, sample_packing=packed)
        jobs.append(SlotJob(spec, streams[-1], key=i))
    timed = timed_steps(pm, jobs, slots, chunked_ce=True, lengths=lengths)
    step_s = timed.median(warmup)
    padded, examples_per_step = [], []
    for step in range(warmup, warmup + steps):
        rows = [r for s in streams for r in s.served[step]]
        padded.append(len(rows) * padded_length(max(len(r.input_ids) for r in rows), SEQ_MULTIPLE, lengths))
        examples_per_step.append(sum(getattr(r, "n_examples", 1) for r in rows))
    real_tokens = timed.input_tokens(warmup)
    row = dict(mode="packed" if packed else "unpacked", slots=slots, micro=micro,
               row_len=row_len if packed else None, examples_per_step=round(statistics.mean(examples_per_step), 1),
               real_tokens_per_step=round(real_tokens), padding=round(1 - real_tokens / statistics.mean(padded), 3),
               step_ms=sig(step_s * 1e3), tok_s=round(real_tokens / step_s), shapes=len(timed.result.shapes),
               graphs=timed.result.graphs,
               reserved_gib=round(torch.cuda.max_memory_reserved() / 2**30, 2) if cuda else None)
    return check_row(row, f"{row['mode']} {slots} slots", flops_per_token=flops_per_token, tflops=tflops)


def run(shape: str | None, *, slots: int, micro: int, row_len: int, steps: int, warmup: int,
        bounded: bool = True) -> list[dict]:
    """Both runs; ``shape`` None: the tiny Llama on the CPU."""
    if shape is None:
        with tempfile.TemporaryDirectory() as tmp:
            model, _ = load_base(str(build_tiny_model("llama", tmp, seed=0)), attn_implementation="sdpa")
    else:
        model = build_shape(shape)
    examples = _examples(4000, row_len, vocab=min(500, model.config.vocab_size))
    mean_len = statistics.mean(len(e.input_ids) for e in examples)
    rows = max(1, round(micro * mean_len / row_len))  # packed rows holding about ``micro`` examples
    # at least 4 FLOPs per counted weight and real token (step_flops of one token): a lower bound of the work
    ceiling = dict(flops_per_token=step_flops(model.config, counted_params(model), 1, 1),
                   tflops=gemm_tflops(next(model.parameters()).device))
    out = [_run(model, examples, slots=slots, micro=micro, packed=False, row_len=row_len, steps=steps,
                warmup=warmup, bounded=bounded, **ceiling),
           _run(model, examples, slots=slots, micro=rows, packed=True, row_len=row_len, steps=steps, warmup=warmup,
                **ceiling)]
    for r in out:
        r.update(shape=shape or "tiny-llama", mean_example_tokens=round(mean_len, 1))
    return out


def layout(examples: list[Example], *, micro: int, row_len: int, steps: int = 150, seed: int = 0) -> list[dict]:
    """What one slot's steps hold, without training: per mode (one example per row, padded to the step's longest
    rounded up to ``SEQ_MULTIPLE`` as the step pads it; or sample-packed rows of ``row_len``, ``micro`` per step),
    the mean positions the step computes, real tokens and examples per step over ``steps`` steps."""
    out = []
    for packed in (False, True):
        stream = slot_stream(examples, micro, seed, sample_packing=packed, row_len=row_len)
        positions, real, n = [], [], []
        for _ in range(steps):
            rows = stream.next_batch()
            positions.append(len(rows) * -(-max(len(r.input_ids) for r in rows) // SEQ_MULTIPLE) * SEQ_MULTIPLE)
            real.append(sum(len(r.input_ids) for r in rows))
            n.append(sum(getattr(r, "n_examples", 1) for r in rows))
        out.append(dict(mode="packed" if packed else "unpacked", micro=micro, row_len=row_len if packed else None,
                        positions_per_step=round(statistics.mean(positions), 1),
                        real_tokens_per_step=round(statistics.mean(real), 1),
                        examples_per_step=round(statistics.mean(n), 1)))
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m lora_sweep.benchmarks.packing_bench", description=__doc__.splitlines()[0])
    p.add_argument("--shape", default=None, help="a benchmarks.shapes shape (GPU); default: tiny Llama on CPU")
    p.add_argument("--slots", type=int, default=8)
    p.add_argument("--micro", type=int, default=16, help="examples per slot and step, unpacked")
    p.add_argument("--row-len", type=int, default=512)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--unbounded", action="store_true", help="unpacked steps padded to a multiple of 16 each (one "
                   "CUDA graph per length) instead of at most MAX_BUCKETS lengths fitted to the rows")
    p.add_argument("--layout", metavar="JSONL", help="no training: what a slot's steps hold on this dataset, "
                   "tokenized by --tokenizer (a model directory), unpacked (--micro examples) and packed (--micro "
                   "rows of --row-len), over 150 steps")
    p.add_argument("--tokenizer", help="with --layout: the model directory whose tokenizer to use")
    p.add_argument("--format", default="auto", help="with --layout: the dataset's format (as data.format)")
    a = p.parse_args(argv)
    if a.layout:
        from transformers import AutoTokenizer

        examples = load_examples(a.layout, AutoTokenizer.from_pretrained(a.tokenizer), fmt=a.format,
                                 max_length=a.row_len)
        for r in layout(examples, micro=a.micro, row_len=a.row_len):
            print(json.dumps(r))
        return
    rows = run(a.shape, slots=a.slots, micro=a.micro, row_len=a.row_len, steps=a.steps, warmup=a.warmup,
               bounded=not a.unbounded)
    for r in rows:
        print(json.dumps(r))


if __name__ == "__main__":
    main()
