"""One pack over several processes (``pack.shard: fsdp``): rank 0 leads the study, the other ranks follow it.

Every rank holds a shard of the frozen base (``packer.model.shard.shard_base``) and runs the same
``packer.step.train.train``
on the same rows, so every collective of FSDP2 (the all-gathers of a layer in its forward and backward, the slot
gradients' broadcast) is met by every rank in the same order. Rank 0 alone owns the study: its directory and lock,
Optuna, the results store, the budget, pruning, and saving (a slot is replicated, so rank 0 holds every adapter
whole: nothing to gather). The other ranks hold no study state: each of their training-loop callbacks waits for
what rank 0 decided in its own (``Follower``):

- ``next_job``: the trial's ``AdapterSpec`` and number (or None), from which a follower builds the same
  ``SlotJob`` (``trial_stream`` is deterministic in the study's seed);
- ``should_stop``: rank 0's answer;
- ``on_step`` / ``on_end``: that rank 0 is done, and in the meantime every evaluation it runs (rung scores,
  ``eval_every`` curves, the final scores of finished trials): these forward through the sharded base, so a
  follower runs the same ``evaluate`` on the same slots at the same time and drops the result.

The messages go over a gloo group of their own (``Channel``): plain Python objects, never through the GPUs'
NCCL group. ``run_ranks`` starts the followers beside the calling process (``sweep run --gpus N``);
``torchrun_channel`` joins the ranks ``torchrun`` or Slurm started (``sweep worker``).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lora_sweep.errors import UserError
from lora_sweep.evaluators.registry import evaluate, load_eval_data
from lora_sweep.packer.api import Packer, jobs, open_base
from lora_sweep.store.api import StudyDir
from lora_sweep.sweep._trial_data import trial_stream
from lora_sweep.sweep.config.spec import StudySpec

__all__ = ["Channel", "Follower", "follow", "run_ranks", "torchrun_channel", "rank_backend"]

T = TypeVar("T")


@dataclass
class Channel:
    """Rank 0's decisions to the other ranks, over a gloo group (objects, in order)."""

    rank: int
    world: int
    group: Any
    """The gloo process group of the messages (the default group may be NCCL's)."""

    @property
    def leads(self) -> bool:
        return self.rank == 0

    def send(self, kind: str, payload: Any = None) -> None:
        """Rank 0: tell every other rank ``(kind, payload)``."""
        assert self.leads, "only rank 0 decides"
        if self.world > 1:
            dist.broadcast_object_list([(kind, payload)], src=0, group=self.group)

    def recv(self) -> tuple[str, Any]:
        """A follower: the next ``(kind, payload)`` rank 0 sent."""
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def lead(self, next_job: Callable[[int], jobs.SlotJob | None],
             on_step: Callable[[list[jobs.StepReport]], None], should_stop: Callable[[jobs.StepReport], bool],
             on_end: Callable[[list[jobs.SlotEnd]], None]) -> tuple[
                 Callable[[int], jobs.SlotJob | None], Callable[[list[jobs.StepReport]], None],
                 Callable[[jobs.StepReport], bool], Callable[[list[jobs.SlotEnd]], None]]:
        """Rank 0's training-loop callbacks, each telling the followers its outcome once it has one."""
        def job(slot: int) -> jobs.SlotJob | None:
            got = next_job(slot)
            self.send("job", None if got is None else (got.spec, got.key))
            return got

        def step(reports: list[jobs.StepReport]) -> None:
            on_step(reports)
            self.send("step")

        def stop(report: jobs.StepReport) -> bool:
            said = should_stop(report)
            self.send("stop", said)
            return said

        def end(ends: list[jobs.SlotEnd]) -> None:
            on_end(ends)
            self.send("ended")

        return job, step, stop, end


class Follower:
    """A rank other than 0 training the pack rank 0 leads: its callbacks do what rank 0's did."""

    def __init__(self, spec: StudySpec, channel: Channel, packer: Packer, examples: list, eval_data: Any) -> None:
        self.spec, self.channel, self.packer = spec, channel, packer
        self.examples, self.eval_data = examples, eval_data

    def serve(self, expected: str) -> Any:
        """Run the evaluations rank 0 announces until it sends ``expected``; returns its payload."""
        while True:
            kind, payload = self.channel.recv()
            if kind == "evaluate":
                slots, entries = payload
                evaluate(self.packer.model, slots, self.eval_data, entries)
                continue
            if kind != expected:  # a follower out of step would deadlock in FSDP's next collective: say it now
                raise RuntimeError(f"rank {self.channel.rank}: expected {expected!r} from rank 0, got {kind!r}")
            return payload

    def next_job(self, slot: int) -> jobs.SlotJob | None:
        got = self.serve("job")
        if got is None:
            return None
        adapter, key = got
        return jobs.SlotJob(adapter, trial_stream(self.spec, adapter, self.examples), key=key)

    def on_step(self, reports: list[jobs.StepReport]) -> None:
        self.serve("step")

    def should_stop(self, report: jobs.StepReport) -> bool:
        return bool(self.serve("stop"))

    def on_end(self, ends: list[jobs.SlotEnd]) -> None:
        self.serve("ended")


def follow(spec: StudySpec, channel: Channel) -> None:
    """A follower's whole run: load its shard of the base as rank 0 does (``packer.model.shard_load``), then train each
    pack rank 0 starts (``pack``: its capacity, pad id and ``train`` options) until it sends ``end``."""
    device = "cpu" if spec.model.device == "cpu" else "cuda"  # this rank's GPU, made current by whoever started it
    packer = open_base(spec.model.path, gguf_file=spec.model.gguf_file, dtype=spec.model.dtype, device=device,
                       quantize=spec.model.quantize, kernels=spec.pack.kernels,
                       fused_base_ops=spec.pack.fused_base_ops, sharded=True)
    d = spec.data
    examples = packer.examples(d.train, fmt=d.format, max_length=d.max_length, train_on_prompt=d.train_on_prompt,
                               max_line_bytes=d.line_bytes)
    eval_data = (load_eval_data(d.eval, packer.tokenizer, fmt=d.format, max_length=d.max_length,
                                train_on_prompt=d.train_on_prompt, work_dir=StudyDir(spec.out_dir).root,
                                max_line_bytes=d.line_bytes)
                 if d.eval is not None else None)
    f = Follower(spec, channel, packer, examples, eval_data)
    while True:
        kind, payload = channel.recv()
        if kind == "end":
            return
        if kind != "pack":
            raise RuntimeError(f"rank {channel.rank}: expected a pack from rank 0, got {kind!r}")
        capacity, pad_id, options = payload
        packer.train(capacity, f.next_job, pad_id=pad_id, on_step=f.on_step, should_stop=f.should_stop,
                     on_end=f.on_end, **options)


def rank_backend(spec: StudySpec, gpus: int) -> str:
    """The process group's backend for ``gpus`` ranks of ``spec``: gloo on ``model.device: cpu`` (CPU processes,
    for testing), NCCL on CUDA.

    Raises:
        UserError: fewer than ``gpus`` CUDA devices are visible, or ``model.device`` names one GPU.
    """
    device = spec.model.device
    if device == "cpu":
        return "gloo"
    if device.startswith("cuda:"):
        raise UserError(f"--gpus {gpus} (gpus={gpus} in the API): model.device: {device} names one GPU; a sharded "
                        f"pack takes one GPU per rank (model.device: auto or cuda)")
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count < gpus:
        raise UserError(f"--gpus {gpus} (gpus={gpus} in the API): {count} CUDA device(s) visible (CUDA_VISIBLE_DEVICES="
                        f"{os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}); model.device: cpu runs the ranks as "
                        f"CPU processes (gloo), for testing")
    return "nccl"


CONTROL_TIMEOUT = timedelta(days=7)
"""How long a follower waits for rank 0's next message: as long as rank 0 may be busy alone (loading the next
pack's base, a worker waiting for the others' trials to end). A rank 0 that dies closes its sockets, which ends
the wait at once."""


def _channel(rank: int, world: int) -> Channel:
    return Channel(rank, world, dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT) if world > 1 else None)


def _follower_entry(index: int, spec: StudySpec, world: int, backend: str, init_file: str, threads: int | None) -> None:
    rank = index + 1  # rank 0 is the process that started the followers
    if threads is not None:
        torch.set_num_threads(threads)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        follow(spec, _channel(rank, world))
    finally:
        dist.destroy_process_group()


def run_ranks(spec: StudySpec, gpus: int, lead: Callable[[Channel], T]) -> T:
    """``sweep run --gpus N``: start ranks 1..N-1 as followers, be rank 0 in this process, and return what
    ``lead(channel)`` (the study's run) returns once every rank has finished.

    On CPU each rank gets an equal share of the cores' threads. A rank that fails is named in the raised error.

    Raises:
        UserError: as ``rank_backend``.
    """
    backend = rank_backend(spec, gpus)
    threads = max(1, (os.cpu_count() or 1) // gpus) if backend == "gloo" else None
    with tempfile.TemporaryDirectory(prefix="lora-sweep-ranks-") as tmp:
        init_file = str(Path(tmp) / "rendezvous")
        ctx = (mp.start_processes(_follower_entry, args=(spec, gpus, backend, init_file, threads), nprocs=gpus - 1,
                                  start_method="spawn", join=False) if gpus > 1 else None)
        own_threads = torch.get_num_threads()
        try:
            if threads is not None:
                torch.set_num_threads(threads)
            if backend == "nccl":
                torch.cuda.set_device(0)
            dist.init_process_group(backend, init_method=f"file://{init_file}", rank=0, world_size=gpus)
            channel = _channel(0, gpus)
            try:
                out = lead(channel)
                channel.send("end")
            finally:
                dist.destroy_process_group()
        except BaseException as err:
            if ctx is not None:
                _stop_followers(ctx, surface=not isinstance(err, UserError | KeyboardInterrupt))
            raise
        finally:
            torch.set_num_threads(own_threads)
        while ctx is not None and not ctx.join():
            pass
    return out


def _stop_followers(ctx: mp.ProcessContext, surface: bool) -> None:
    """After rank 0 stopped: end the followers. ``surface``: rank 0 failed (not a user error, an interrupt or a
    SIGTERM, which are its own): first wait a moment for a follower's own failure, often the cause (a rank 0 whose
    peer died fails in the collective it waited in), and raise it (chained to rank 0's)."""
    try:
        if surface:
            ctx.join(timeout=5)
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.terminate()


def torchrun_channel(spec: StudySpec) -> Channel | None:
    """Join the ranks ``torchrun`` (or Slurm through it) started, from its environment (``RANK``, ``WORLD_SIZE``,
    ``LOCAL_RANK``, ``MASTER_ADDR``/``MASTER_PORT``); None when not started so (one process)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if spec.pack.shard != "fsdp" or "RANK" not in os.environ:
        return None
    local = int(os.environ.get("LOCAL_RANK", "0"))
    backend = rank_backend(spec, int(os.environ.get("LOCAL_WORLD_SIZE", world)))
    if backend == "nccl":
        torch.cuda.set_device(local)
    dist.init_process_group(backend, init_method="env://", rank=int(os.environ["RANK"]), world_size=world)
    return _channel(dist.get_rank(), world)
