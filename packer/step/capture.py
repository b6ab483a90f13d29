"""A function captured as a CUDA graph, the PyTorch recipe (``torch.cuda.graphs``): warm-up runs on a side stream
(kernels compile, the caching allocator settles, lazily built buffers exist), then one run under capture.

The training step (``packer.step.train``), the fixed-shape evaluation forwards (``packer.step.eval_graph``) and the PEFT
baseline of ``benchmarks.gpu_graph`` capture through this one function. ``precompile`` compiles, in parallel,
the Triton kernels such a function launches before its first run.
"""

from __future__ import annotations

import os
import time
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import torch

from lora_sweep.errors import first_line

__all__ = ["Captured", "capture", "capture_failure", "precompile"]


class Captured(NamedTuple):
    graph: torch.cuda.CUDAGraph
    warmup_s: float
    capture_s: float


def capture(fn: Callable[[], object], *, warmups: int = 2, warmup: Callable[[], object] | None = None,
            pool: Any = None) -> Captured:
    """``fn`` captured as a CUDA graph after ``warmups`` runs of ``warmup`` (default: ``fn``) on a side stream.

    Args:
        fn: what the graph replays; it must not sync with the host or allocate outside the graph's pool.
        warmups: runs before capture (the recipe's side-stream warm-up; 2 settles autograd's buffers too).
        warmup: what those runs call, when it differs from ``fn`` (e.g. ``fn`` plus a reset of its gradients).
        pool: a ``torch.cuda.graph_pool_handle()`` shared with other graphs of the same owner, or None.

    Returns:
        The graph (not yet replayed: ``fn``'s effects are those of the warm-up runs and the captured run) and the
        seconds warm-up and capture took, each ended by a device synchronisation.

    Raises:
        Whatever the warm-up or the capture raise (a host sync under capture, an unsupported op): the caller
        decides how to fall back.
    """
    t0 = time.perf_counter()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmups):
            (warmup or fn)()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    t1 = time.perf_counter()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        fn()
    torch.cuda.synchronize()
    return Captured(graph, t1 - t0, time.perf_counter() - t1)


def capture_failure(err: BaseException) -> str:
    """``err``'s type, first line and the innermost frame outside torch that raised it: the line to change (e.g.
    ``transformers/masking_utils.py:604 in eager_mask``)."""
    first = first_line(err, "")
    torch_dir = str(Path(torch.__file__).parent) + os.sep
    frames = [f for f in traceback.extract_tb(err.__traceback__) if not f.filename.startswith(torch_dir)]
    where = ""
    if frames:
        f = frames[-1]
        parts = Path(f.filename).parts
        short = "/".join(parts[-2:]) if len(parts) >= 2 else f.filename
        where = f" (at {short}:{f.lineno} in {f.name})"
    return f"{type(err).__name__}: {first}{where}"


def precompile(fn: Callable[[], object]) -> None:
    """Compile, in parallel, the Triton kernel variants ``fn`` launches (``kernels.ops.precompile``: one pass of ``fn``
    whose launches are compile-only warm-ups; its torch ops run on unwritten kernel outputs, so ``fn`` must only
    write state its next real run rewrites). A failure is one warning: the kernels then compile as ``fn`` meets
    them, one after another (seconds each on a cold cache)."""
    from lora_sweep.kernels import ops

    try:
        ops.precompile(fn)
    except Exception as err:  # an optimisation only
        first = first_line(err, "")
        warnings.warn(f"kernel precompile failed, kernels compile as the step meets them: {type(err).__name__}: "
                      f"{first}", stacklevel=3)
