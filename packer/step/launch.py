"""Start one process per rank for a sharded pack (``packer.model.shard``) and join them.

``spawn(fn, world, *args)`` runs ``fn(rank, world, *args)`` in ``world`` fresh processes (the ``spawn`` start
method: CUDA and threads do not survive a fork) with ``torch.distributed`` initialised over a rendezvous file, the
way ``torchrun`` would start them on one host but without a second entry point. ``fn`` must be importable at module
level (the children unpickle it by name). The default backend is gloo (CPU); on GPUs pass ``nccl``, and ``fn``
selects its device with ``torch.cuda.set_device(rank)``.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["spawn"]


def _entry(rank: int, fn: Callable[..., Any], world: int, backend: str, init_file: str, threads: int | None,
           args: tuple[Any, ...]) -> None:
    if threads is not None:
        torch.set_num_threads(threads)
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        fn(rank, world, *args)
    finally:
        dist.destroy_process_group()


def spawn(fn: Callable[..., Any], world: int, *args: Any, backend: str = "gloo", threads: int | None = 1) -> None:
    """Run ``fn(rank, world, *args)`` on ``world`` ranks of a new process group and wait for all of them.

    Args:
        fn: a module-level function; its return value is dropped (ranks report through files).
        world: number of processes, >= 1 (1 runs the same path: a process group of one).
        args: passed to ``fn`` after ``rank`` and ``world``; picklable.
        backend: ``gloo`` (CPU) or ``nccl`` (one GPU per rank).
        threads: ``torch.set_num_threads`` in each rank (None: torch's default), so ranks sharing a few cores
            do not oversubscribe them.

    Raises:
        ValueError: ``world`` < 1.
        torch.multiprocessing.ProcessRaisedException: a rank raised (its traceback in the message).
    """
    if world < 1:
        raise ValueError(f"world must be >= 1 (got {world})")
    with tempfile.TemporaryDirectory(prefix="lora-sweep-pg-") as tmp:
        init_file = str(Path(tmp) / "rendezvous")
        mp.start_processes(_entry, args=(fn, world, backend, init_file, threads, args), nprocs=world,
                           start_method="spawn", join=True)
