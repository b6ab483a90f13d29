"""``shard_bench``'s baseline: one adapter at a time on a base sharded with FSDP2, the way torchtune's distributed LoRA
recipe trains it, built with PEFT.

torchtune's ``lora_finetune_distributed`` builds the model on the meta device, leaves only the LoRA weights
trainable, wraps each decoder layer (in its activation-checkpointing wrapper when that is on) and then the root in
``fully_shard`` (``training.shard_model`` with the decoder layers as the shard condition), gives each rank its
shard of the base (``load_from_full_model_state_dict``) and initialises the adapters' shards, then trains data
parallel: each rank a batch of rows of its own, the adapter's gradients reduce-scattered by FSDP. The LoRA A/B of a
projection belong to its layer's FSDP unit: sharded by rows with the frozen weights, gathered with them per layer,
their gradients and AdamW moments sharded too.

Here the same on a Hugging Face model: PEFT's ``LoraConfig`` (rank r, alpha 2r as the pack's slots, the seven
projections, no dropout) put on the meta model (``low_cpu_mem_usage``: its A/B on meta too), torch's
``checkpoint_wrapper`` around every decoder layer when activation checkpointing is on (non-reentrant, what
torchtune's ``set_activation_checkpointing`` applies), ``fully_shard`` per decoder layer then the root, a random
init of each rank's shard of the base (``packer.model.shard_load.materialise``, as the pack's) and PEFT's init of
its adapter shard (A Kaiming-uniform(a=sqrt(5)), B zero). One choice differs from torchtune, to compare like with
like: the adapter's weights, gradients and AdamW moments are fp32 (PEFT's ``autocast_adapter_dtype`` default, and
what a pack's slot holds), where torchtune keeps them in the model's bf16. FSDP2 gathers a unit's bf16 and fp32
weights in one byte buffer and reduce-scatters the fp32 gradients. The loss is transformers' own (the whole
logits, cross-entropy in fp32), as PEFT with transformers' ``Trainer`` computes it.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Shard, init_device_mesh

from lora_sweep.benchmarks.shapes import PROJ
from lora_sweep.benchmarks.timing import time_calls
from lora_sweep.packer.model.load import DTYPES
from lora_sweep.packer.model.shard import decoder_layers
from lora_sweep.packer.model.shard_load import materialise, meta_model

__all__ = ["peft_model", "trainable_params", "timed_peft_steps"]


def peft_model(config: object, *, rank: int, dtype: str, device: torch.device,
               activation_checkpointing: bool) -> nn.Module:
    """A PEFT LoRA model of ``config`` (rank ``rank`` on ``PROJ``) sharded over the default process group as
    torchtune shards it (module docstring), each rank's shard of the base random, its adapter shard PEFT's init.

    Args:
        config: a transformers config.
        rank: the adapter's rank r (alpha 2r).
        dtype: the base's dtype (``bfloat16``, ``float32``); the adapter is fp32.
        device: this rank's device.
        activation_checkpointing: wrap every decoder layer in torch's non-reentrant ``checkpoint_wrapper``.

    Returns:
        The ``PeftModel``; its trainable parameters (``DTensor``s, Shard(0)) are the adapter's A and B only.
    """
    from peft import LoraConfig, get_peft_model
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointWrapper,
        apply_activation_checkpointing,
    )

    lora = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=list(PROJ), lora_dropout=0.0, bias="none")
    model = get_peft_model(meta_model(config, dtype, "sdpa"), lora, low_cpu_mem_usage=True)  # freezes the base
    units = decoder_layers(model)
    if activation_checkpointing:
        wrap = {id(layer) for layer in units}
        apply_activation_checkpointing(model, check_fn=lambda m: id(m) in wrap)
        units = [m for m in model.modules() if isinstance(m, CheckpointWrapper)]  # torchtune shards the wrapper
    mesh = init_device_mesh(device.type, (torch.distributed.get_world_size(),))
    for unit in units:
        fully_shard(unit, mesh=mesh)
    fully_shard(model, mesh=mesh)
    _init_adapter(model, device)
    materialise(model, None, dtype=DTYPES[dtype], device=device)  # the base: meta until here
    model.train()
    return model


@torch.no_grad()
def _init_adapter(model: nn.Module, device: torch.device) -> None:
    """Give each LoRA weight (meta, sharded by rows) this rank's rows in fp32: A (r, D_in) Kaiming-uniform as PEFT
    draws it (a row's bound depends on D_in only, so a shard draws as the whole would), B (D_out, r) zero."""
    for path, module in model.named_modules():
        for leaf, p in list(module.named_parameters(recurse=False)):
            if not (p.requires_grad and p.is_meta):
                continue
            rows = torch.zeros(p.to_local().shape, dtype=torch.float32, device=device)  # (rows here, D_in or r)
            if ".lora_A." in f".{path}.":
                nn.init.kaiming_uniform_(rows, a=math.sqrt(5))
            value = DTensor.from_local(rows, p.device_mesh, [Shard(0)], run_check=False, shape=p.shape,
                                       stride=p.stride())
            # assign keeps requires_grad; FSDP's post-load hook re-pads the shard and takes the new parameter
            module.load_state_dict({leaf: nn.Parameter(value)}, strict=False, assign=True)


def trainable_params(model: nn.Module) -> int:
    """Parameters of the adapter, whole (a ``DTensor``'s ``numel`` is its global size, not this rank's shard)."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def timed_peft_steps(model: nn.Module, ids: torch.Tensor, warmup: int, steps: int) -> float:
    """Mean seconds of the ``steps`` steps after ``warmup`` of AdamW (lr 1e-4, as the pack's slots) on this rank's
    fixed rows ``ids`` (micro, seq), next-token loss on every token, timed by ``timing.time_calls`` (the device
    synchronised before and after); each step reads its loss on the host, as the pack's steps read back theirs.

    Raises:
        ValueError: ``warmup`` < 1 (the timed steps start after the compile and allocations of the first).
        FloatingPointError: a step's loss is not finite (its time would measure nothing).
    """
    if warmup < 1:
        raise ValueError(f"warmup must be >= 1 (got {warmup})")
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)

    def step() -> None:
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if not math.isfinite(loss.item()):
            raise FloatingPointError(f"PEFT baseline: loss {loss.item()}")

    return time_calls(step, warmup, steps, ids.device)
