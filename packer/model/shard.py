"""One pack over several processes: the frozen base sharded with PyTorch FSDP2, the adapter slots replicated.

``shard_base(pm)`` applies ``torch.distributed.fsdp.fully_shard`` to every decoder layer of the pack's base
(one FSDP unit per layer, ``reshard_after_forward=True``: a layer's full weights exist only while it runs,
all-gathered in its forward and again in the backward) and then to the decoder body (``decoder_body``: the
embeddings and the final norm), the root unit. FSDP gathers a unit's own weights in that unit's forward only, so
the body must be the module whose forward the causal LM calls, in ``PackedModel.forward`` and ``forward_hidden``
alike: the innermost module holding the input embeddings and every decoder layer. That is ``base_model`` for most
families, but OPT's causal LM calls ``model.decoder`` itself, past ``OPTModel``'s forward, which would leave a
root unit on ``base_model`` ungathered (and ``forward_hidden``, through ``OPTModel``, reaches the decoder too).
Every tiny family of ``packer.tiny`` shards so. A family whose forward still ran a module of the body's own unit
past the body's forward is refused in one line when it does (``_refuse_ungathered``), rather than failing inside
the module or computing with one rank's rows. Each rank then holds 1/world of the body's weights (loaded so, by
rows, without a whole copy in any process: ``packer.model.shard_load``). The output head stays whole on every
rank: the chunked loss calls it outside the body's forward, where an FSDP unit's weights are sharded (and a head
tied to the input embeddings is left out of the body's shard for the same reason, ``ignored_params``).

The adapter slots are not FSDP's: their A/B live in the slot store's fp32 buffers, outside every FSDP unit's
parameter group (a slot is added after ``fully_shard``, so FSDP never sees it), replicated on every rank with
their gradients and AdamW state. Why replicated rather than sharded with their layer: replicated, the slot math,
the slot store, its optimizer step and the Triton kernels see exactly the tensors they see in a
one-GPU pack (nothing of them changes, and a slot's update needs no collective but one gradient broadcast), and a
slot is small beside the base: a rank-16 adapter on every projection of Llama-3-70B has 207M parameters (80
layers x 16 x 161,792), 3.3 GB with its fp32 gradient and both AdamW moments (16 B each), against 141 GB of bf16
base. Eight such slots (26.5 GB per rank) are where sharding the slots' optimizer state would start to pay.

Every rank trains the same pack on the same rows (the job queue is deterministic, so each rank makes the same
slot decisions), which makes every slot's gradient the same on every rank. After each backward the slots'
gradient buffers are broadcast from rank 0 in one bucket (``_SlotGradSync``): bitwise the same replicas
whatever the kernels' reduction order on each rank, and, unlike an averaging all-reduce, no rounding of its
own, so a sharded slot takes the very step an unsharded one takes. The sharding buys memory (a base larger
than one GPU), not speed: every rank computes the whole pack. Splitting the pack's rows between ranks (the slot
gradients then partial sums to all-reduce) would not take the one-process step exactly as the step stands: a
slot's dropout mask is keyed by each row's position within the slot's rows (``kernels.triton_dropout``: a row
moved to another rank draws another mask), a slot's mean loss and its accumulation weights are normalised over
the target tokens of the rows one rank sees, and an accumulating slot's gradient buffer would be reduced at each
micro-batch, not once per optimizer step. Each needs the step itself to count the slot's tokens over all
ranks and offset its rows; ``sweep.ranks`` runs a study over the ranks as they are.

Only the eager step runs sharded (``train(..., cuda_graphs="off")``). FSDP2 all-gathers into buffers it
allocates and frees per layer (``untyped_storage().resize_``), runs the collectives on its own streams and
decides in Python hooks, per call, what to gather, prefetch and reshard; a CUDA graph would freeze one call's
allocations and skip the hooks on replay, and the collectives of a process group are not captured with it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor, init_device_mesh

from lora_sweep.errors import ConfigError
from lora_sweep.packer.model.packed import PackedModel

__all__ = ["Sharding", "shard_base", "local_param_bytes", "decoder_layers", "decoder_body", "is_sharded", "BaseShare",
           "base_share", "shard_rows"]


@dataclass
class Sharding:
    """What ``shard_base`` did to a pack."""

    world: int
    rank: int
    units: int
    """FSDP units: the decoder layers and the body."""
    sync: _SlotGradSync

    def remove(self) -> None:
        """Stop synchronising slot gradients (the base stays sharded)."""
        self.sync.handle.remove()


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The decoder layers of a Hugging Face causal LM (its ``_no_split_modules`` classes, in module order).

    Raises:
        ConfigError: the model names no decoder-layer class or none is found.
    """
    names = set(getattr(model, "_no_split_modules", None) or ())
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        raise ConfigError(f"pack.shard: {_family(model)} has no decoder layers to shard (_no_split_modules)")
    return layers


def _family(model: nn.Module) -> str:
    """``model_type (ClassName)``, the family errors name."""
    kind = getattr(getattr(model, "config", None), "model_type", None)
    return f"{kind} ({type(model).__name__})" if kind else type(model).__name__


def decoder_body(model: nn.Module) -> nn.Module:
    """The module of a causal LM that runs its decoder without the head, which ``shard_base`` makes FSDP's root
    unit: the innermost module holding the input embeddings and every decoder layer (module docstring).

    Raises:
        ConfigError: as ``decoder_layers``; no input embeddings; or only the causal LM itself holds them and the
            layers (no body apart from the head), naming the family.
    """
    get = getattr(model, "get_input_embeddings", None)
    embeddings = get() if get is not None else None
    paths = {id(m): name for name, m in model.named_modules()}
    if embeddings is None or id(embeddings) not in paths:
        raise ConfigError(f"pack.shard: {_family(model)} has no input embeddings to find its decoder body by")
    parts = [paths[id(m)].split(".") for m in (embeddings, *decoder_layers(model))]
    body = model.get_submodule(".".join(os.path.commonprefix(parts)))  # the paths' longest common list of names
    if body is model:
        raise ConfigError(f"pack.shard: {_family(model)} keeps its embeddings and decoder layers beside the head, "
                          "with no decoder body to shard apart from it")
    return body


def shard_base(pm: PackedModel, *, reshard_after_forward: bool = True) -> Sharding:
    """Shard ``pm``'s frozen base over the default process group with FSDP2; call before any slot is added.

    Args:
        pm: the pack, no slot yet; ``torch.distributed`` initialised (any backend; world size 1 runs the same
            path: every "shard" is the whole weight and the broadcast is a no-op).
        reshard_after_forward: free each layer's gathered weights after its forward (gather again in the
            backward); False keeps them until the backward, trading memory for one all-gather per layer.

    Returns:
        The ``Sharding``; the slots' gradients are synchronised after every backward from now on.

    Raises:
        ConfigError: slots already present, or a model without decoder layers or a separate body
            (``decoder_body``).
    """
    if pm.specs:
        raise ConfigError("pack.shard: shard the base before adding slots")
    if not dist.is_initialized():
        raise RuntimeError("shard_base needs torch.distributed initialised (init_process_group)")
    model = pm.model
    body = decoder_body(model)
    mesh = init_device_mesh(pm.device.type, (dist.get_world_size(),))
    head = model.get_output_embeddings()
    kept = set(head.parameters()) if head is not None else set()  # tied to the embeddings: keep whole (docstring)
    layers = decoder_layers(body)
    for layer in layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=reshard_after_forward)
    fully_shard(body, mesh=mesh, reshard_after_forward=reshard_after_forward, ignored_params=kept & set(
        body.parameters()))
    _refuse_ungathered(model, body, layers, kept)
    sync = _SlotGradSync(pm)
    sync.handle = body.register_forward_hook(sync.on_forward)
    return Sharding(dist.get_world_size(), dist.get_rank(), len(layers) + 1, sync)


def _refuse_ungathered(model: nn.Module, body: nn.Module, layers: list[nn.Module], kept: set[nn.Parameter]) -> None:
    """Refuse to run a module of the body's own unit (the embeddings, the final norm) while its weights are
    sharded: a causal LM whose forward reached it past the body's forward, which gathers them, would fail inside it
    or, on some backend, compute with the rank's shard. Every rank runs the same forward, so all of them raise."""
    names = {id(m): name for name, m in model.named_modules()}
    in_layers = {id(m) for layer in layers for m in layer.modules()}

    def check(module: nn.Module, args: object) -> None:
        if any(isinstance(p, DTensor) for p in module.parameters(recurse=False)):
            raise ConfigError(f"pack.shard: {_family(model)} runs {names[id(module)]} outside the forward of its "
                              f"decoder body ({names[id(body)]}), so FSDP never gathers its weights")

    for module in body.modules():
        if id(module) not in in_layers and any(p not in kept for p in module.parameters(recurse=False)):
            module.register_forward_pre_hook(check)


class _SlotGradSync:
    """Broadcast the slots' gradient buffers from rank 0 once the backward of a forward through the body is done:
    the slot store's one gradient buffer.

    A hook on the body's output (its first tensor, which needs a gradient whenever a slot is active) runs at the
    start of that output's backward and queues a callback on autograd's engine, which runs when the whole backward
    has finished (every layer has added its gradient into the store's buffer): FSDP's own trick for its
    post-backward work.
    """

    def __init__(self, pm: PackedModel) -> None:
        self.pm = pm
        self.handle: torch.utils.hooks.RemovableHandle | None = None  # type: ignore[assignment]

    def on_forward(self, module: nn.Module, args: object, output: object) -> None:
        out = output[0] if isinstance(output, tuple) else getattr(output, "last_hidden_state", output)
        if isinstance(out, torch.Tensor) and out.requires_grad:
            out.register_hook(self._queue)

    def _queue(self, grad: torch.Tensor) -> torch.Tensor:
        torch.autograd.Variable._execution_engine.queue_callback(self.broadcast)
        return grad

    def broadcast(self) -> None:
        """Rank 0's gradient of every slot, in one flat bucket (the slots in slot order: the same on all ranks)."""
        store = self.pm.store
        grads = [store.grad] if store is not None else []
        if dist.get_world_size() == 1 or not grads:
            return
        bucket = torch.cat(grads)  # (sum of slot sizes,)
        dist.broadcast(bucket, src=0)
        off = 0
        for g in grads:
            g.copy_(bucket[off:off + g.numel()])
            off += g.numel()


def local_param_bytes(module: nn.Module) -> int:
    """Bytes of ``module``'s parameters held by this rank: a sharded parameter counts its local shard only."""
    total = 0
    for p in module.parameters():
        t = p.to_local() if isinstance(p, DTensor) else p
        total += t.numel() * t.element_size()
    return total


def is_sharded(module: nn.Module) -> bool:
    """Whether FSDP2 manages ``module`` or one of its children."""
    return any(isinstance(m, FSDPModule) for m in module.modules())


@dataclass(frozen=True)
class BaseShare:
    """What one rank holds of a base sharded by ``shard_base`` over ``world`` ranks (bytes; the planner's count)."""

    whole: int
    """Parameters every rank keeps whole: the output head (and whatever else is outside the body)."""
    shard: int
    """This rank's shard of the body's parameters: dim 0 of each cut in ``world`` chunks of ceil(rows / world)
    (FSDP2's ``Shard(0)``; the last ranks' chunks may be shorter or empty)."""
    gathered: int
    """The two largest FSDP units' parameters in full (a decoder layer; the body's own: embeddings and final norm):
    FSDP2 all-gathers the next unit while one runs (the CPU issues it ahead, and the backward prefetches one), so
    at most two units are unsharded at once (``reshard_after_forward=True``, the body's unit included)."""

    staging: int = 0
    """The largest parameter's padded chunk: loaded by rows (``packer.model.shard_load``), a rank holds its share and
    one chunk more while FSDP pads the chunk it has just read."""

    @property
    def peak(self) -> int:
        return self.whole + self.shard + self.gathered

    @property
    def load_peak(self) -> int:
        """The most parameter bytes one rank holds while ``packer.model.shard_load`` loads its share by rows (loaded
        whole and sharded after, a rank holds the whole base first)."""
        return self.whole + self.shard + self.staging


def base_share(model: nn.Module, world: int, rank: int = 0) -> BaseShare:
    """Bytes of ``model``'s parameters rank ``rank`` of ``world`` holds once ``shard_base`` shards it, computed
    from the unsharded model (rank 0 holds the most).

    Raises:
        ConfigError: as ``decoder_body``.
    """
    body = decoder_body(model)
    head = model.get_output_embeddings()
    kept = set(head.parameters()) if head is not None else set()
    sharded = {id(p): p for p in body.parameters() if p not in kept}

    def rows_here(p: torch.Tensor) -> int:
        start, stop = shard_rows(p.shape[0] if p.dim() else 1, world, rank)
        return stop - start

    def size(p: torch.Tensor) -> int:
        return p.numel() * p.element_size()

    def row_bytes(p: torch.Tensor) -> int:
        return p.numel() // max(p.shape[0] if p.dim() else 1, 1) * p.element_size()

    shard = sum(rows_here(p) * row_bytes(p) for p in sharded.values())
    chunk = max((-(-(p.shape[0] if p.dim() else 1) // world) * row_bytes(p) for p in sharded.values()), default=0)
    whole = sum(size(p) for p in {id(p): p for p in model.parameters()}.values() if id(p) not in sharded)
    layers = decoder_layers(body)
    in_layers = {id(p) for layer in layers for p in layer.parameters()}
    units = [sum(size(p) for p in layer.parameters()) for layer in layers]
    units.append(sum(size(p) for i, p in sharded.items() if i not in in_layers))  # the body's own: embeddings, norm
    first, second = sorted(units)[-2:]
    return BaseShare(whole, shard, first + second if world > 1 else 0, chunk if world > 1 else 0)


def shard_rows(rows: int, world: int, rank: int) -> tuple[int, int]:
    """The rows ``[start, stop)`` of a parameter's dim 0 that rank ``rank`` of ``world`` holds under FSDP2's
    ``Shard(0)``: ``torch.chunk``'s chunks of ceil(rows / world) rows, the last ranks' shorter or empty."""
    chunk = -(-rows // world)
    start = min(rows, rank * chunk)
    return start, min(rows, start + chunk)
