"""Load the base of a sharded pack without any process holding it whole (``pack.shard: fsdp``).

Loading the base whole on every rank and then sharding it (``load_base`` + ``shard_base``) needs the whole base in
one process's memory: a 70B bf16 base (141 GB) cannot load on one H200 (141 GB). torchtune's distributed LoRA
recipe instead builds its model on the meta device, applies ``fully_shard`` and then loads the full state dict into
the sharded parameters (``torchtune.training.load_from_full_model_state_dict``: rank 0 reads every tensor whole and
each rank keeps its chunk of it, ``distribute_tensor``). Here each rank reads only its own chunk, so no process ever
holds a whole sharded tensor:

1. ``meta_model``: the model built from its ``config.json`` with its parameters on the meta device (no memory) and
   its buffers on the CPU, computed by the modules' own constructors (the rotary ``inv_freq``: recomputed, never
   left on meta; accelerate's ``init_empty_weights(include_buffers=False)``); a tied head stays tied.
2. ``PackedModel(model, device=...)``: the fused base ops chosen for the device the base will live on.
3. ``shard_base``: ``fully_shard`` on the meta parameters (FSDP2 keeps them on meta for deferred init and moves
   the buffers to the device).
4. ``materialise``: every sharded parameter's rows ``shard_rows(rows, world, rank)`` (FSDP2's ``Shard(0)``
   chunks) read from the checkpoint's safetensors files with ``safe_open(...).get_slice(name)[start:stop]`` (the
   checkpoint's name of the parameter, as ``from_pretrained`` renames it: GPT-NeoX stores its ``lm_head`` as
   ``embed_out``), cast
   to the study's dtype, moved to the device and set as the parameter's local shard (``DTensor.from_local``,
   ``load_state_dict(assign=True)``, whose FSDP post-load hook pads the shard as ``fully_shard`` would have); every
   parameter FSDP leaves whole (the output head, ``packer.model.shard``) read whole. One tensor at a time: besides the
   rank's share, a rank holds one tensor's rows in flight.

``load_sharded`` runs the four steps, or where they cannot run loads the base whole on every rank as before
(``load_base`` then ``shard_base``), saying why (``meta_load_refusal``): a hub id (no local files to read rows
from), a checkpoint without safetensors files (``pytorch_model.bin`` cannot be read by rows), ``model.quantize``
(NF4's blocks of 64 would have to align with the shard's rows, and an NF4 base is a quarter of the bf16 one: one
GPU holds it whole), or a checkpoint whose tensor names (once renamed) or shapes do not match the model's
parameters (transformers converts some, e.g. merged MoE experts). A GGUF source loads from its converted
safetensors directory, by rows.
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from safetensors import safe_open
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from lora_sweep.errors import UserError, first_line
from lora_sweep.kernels.ops import Impl
from lora_sweep.packer.model.load import DTYPES, check_checkpoint, load_base, load_tokenizer, resolve_base
from lora_sweep.packer.model.packed import PackedModel
from lora_sweep.packer.model.shard import Sharding, shard_base, shard_rows

__all__ = ["LoadStats", "ShardedLoad", "load_sharded", "meta_load_refusal", "meta_model", "materialise"]


@dataclass
class LoadStats:
    """What ``materialise`` read on this rank (bytes as stored in the checkpoint)."""

    read_bytes: int = 0
    """Every tensor's rows read from the checkpoint."""
    largest_read: int = 0
    """The largest single read: what a rank holds in flight beside its share."""
    tensors: int = 0


class ShardedLoad(NamedTuple):
    """``load_sharded``'s result."""

    pm: PackedModel
    tokenizer: Any
    sharding: Sharding
    stats: LoadStats | None
    """None: the base was loaded whole on every rank (``meta_load_refusal`` said why)."""


def _safetensors_index(directory: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file of ``directory`` holding it (sharded checkpoints: its index)."""
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        return {name: directory / file for name, file in json.loads(index.read_text())["weight_map"].items()}
    single = directory / "model.safetensors"
    if not single.is_file():
        return {}
    with safe_open(single, framework="pt") as f:
        return dict.fromkeys(f.keys(), single)


def _by_model_name(model: nn.Module, index: dict[str, Path]) -> dict[str, tuple[Path, str]]:
    """Model name -> (file, checkpoint name) of each tensor of the checkpoint ``index`` that transformers' loader
    renames only, as ``from_pretrained`` renames it (the model's checkpoint conversion mapping, e.g. GPT-NeoX's
    ``embed_out`` -> ``lm_head``, reverted by ``save_pretrained``; the base model's prefix added or dropped). A
    tensor the mapping converts (merges, splits, permutes) maps nowhere: its rows are not the parameter's."""
    try:  # transformers' loader internals (5.x): where they differ, names are taken as they are (no renames)
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

        transforms = get_model_conversion_mapping(model) if hasattr(model, "config") else []
        renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
        converters = [t for t in transforms if isinstance(t, WeightConverter)]
        names = dict.fromkeys([name for name, _, _ in _parameters(model)] + [n for n, _ in model.named_buffers()],
                              True)
        prefix = getattr(model, "base_model_prefix", None) or None
        found: dict[str, tuple[Path, str]] = {}
        for key, file in index.items():
            name, converted = rename_source_key(key, renamings, converters, prefix, names)
            if converted is None:
                found[name] = (file, key)
        return found
    except (ImportError, TypeError, AttributeError, ValueError):  # a checkpoint that needs a rename loads whole
        return {key: (file, key) for key, file in index.items()}


def meta_load_refusal(source: str, quantize: str | None) -> str | None:
    """Why the base at ``source`` (``resolve_base``'s answer) cannot be loaded by rows (module docstring), or None
    when it can (reads only file names and, for an unsharded file, its header)."""
    if quantize is not None:
        return f"model.quantize: {quantize} quantises the whole weights as they load"
    directory = Path(source)
    if not directory.is_dir():
        return f"{source} is not a local checkpoint directory (no files to read rows from)"
    if not _safetensors_index(directory):
        return f"{source} holds no safetensors files (model.safetensors or its index)"
    return None


def meta_model(source: str | Path | Any, dtype: str, attn_implementation: str | None = None) -> nn.Module:
    """The causal LM of ``source``'s ``config.json`` (or of ``source``, a transformers config) with its parameters
    on the meta device and its buffers computed on the CPU, in ``dtype`` (``auto``: the config's dtype, else
    float32).

    Raises:
        UserError: transformers cannot read the config (one line).
    """
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        config = AutoConfig.from_pretrained(source) if isinstance(source, str | Path) else source
    except (OSError, ValueError) as err:
        raise UserError(f"{source}: cannot load model config: {first_line(err)}") from err
    if attn_implementation:
        config._attn_implementation = attn_implementation
    torch_dtype = (getattr(config, "dtype", None) or torch.float32) if dtype == "auto" else DTYPES[dtype]
    with init_empty_weights(include_buffers=False):  # parameters on meta; buffers (rotary inv_freq) as constructed
        model = AutoModelForCausalLM.from_config(config, dtype=torch_dtype)
    # from_pretrained builds under the load dtype too, then runs the model's own initialisation once more outside it
    # (its _initialize_missing_keys), which recomputes the non-persistent buffers in float32: without that, a
    # sinusoidal position table (GPT-J's, CodeGen's) keeps the load dtype's rounding, and a rows-loaded bf16
    # CodeGen's logits differed from the whole load's. The parameters are on meta: their init does nothing.
    for module in model.modules():
        module.__dict__.pop("_is_hf_initialized", None)
    model.initialize_weights()
    model.tie_weights()  # again outside: the context's register_parameter made the tied head a parameter of its own
    return model


def _parameters(model: nn.Module) -> list[tuple[str, list[tuple[nn.Module, str]], nn.Parameter]]:
    """(path, every (module, leaf) holding it, parameter) of each distinct parameter, in module order (a tied
    head: the first path, the embeddings', with both holders)."""
    found: dict[int, tuple[str, list[tuple[nn.Module, str]], nn.Parameter]] = {}
    for path, module in model.named_modules(remove_duplicate=False):
        for leaf, p in module.named_parameters(recurse=False):
            name = f"{path}.{leaf}" if path else leaf
            found.setdefault(id(p), (name, [], p))[1].append((module, leaf))
    return list(found.values())


def _check_names(model: nn.Module, index: dict[str, tuple[Path, str]], files: dict[Path, Any]) -> str | None:
    """Why the checkpoint (``_by_model_name``'s ``index``) cannot fill ``model``: a parameter it lacks or holds in
    another shape (None: it can)."""
    for name, _, p in _parameters(model):
        if name not in index:
            return f"the checkpoint has no tensor {name}"
        file, key = index[name]
        shape = tuple(files[file].get_slice(key).get_shape())
        if shape != tuple(p.shape):
            return f"the checkpoint's {name} is {shape}, the model's {tuple(p.shape)}"
    return None


@contextmanager
def _opened(model: nn.Module, checkpoint: str | Path | None) -> Iterator[tuple[dict[str, tuple[Path, str]], dict]]:
    """``model``'s names -> (file, checkpoint name) of ``checkpoint`` (``_by_model_name``) and its safetensors files
    open for reading, kept open for the block ({} and {} without a checkpoint)."""
    with ExitStack() as stack:
        index = {} if checkpoint is None else _by_model_name(model, _safetensors_index(Path(checkpoint)))
        yield index, {f: stack.enter_context(safe_open(f, framework="pt")) for f, _ in set(index.values())}


def materialise(model: nn.Module, checkpoint: str | Path | None, *, dtype: torch.dtype, device: torch.device,
                seed: int = 0) -> LoadStats:
    """Give every meta parameter of ``model`` (sharded by ``shard_base`` or not) this rank's part, read from
    ``checkpoint``'s safetensors files by rows; with ``checkpoint`` None a random init instead (benchmarks:
    norms' weights one, biases zero, the rest normal(0, ``initializer_range``), drawn per parameter and rank from
    ``seed``, so a shard's values depend on the world size).

    Raises:
        ValueError: the checkpoint lacks a parameter or holds it in another shape (``load_sharded`` checks first).
    """
    with _opened(model, checkpoint) as (index, files):
        if checkpoint is not None and (why := _check_names(model, index, files)) is not None:
            raise ValueError(why)
        return _fill(model, index, files, dtype=dtype, device=device, seed=seed, random=checkpoint is None)


@torch.no_grad()
def _fill(model: nn.Module, index: dict[str, tuple[Path, str]], files: dict, *, dtype: torch.dtype,
          device: torch.device, seed: int, random: bool) -> LoadStats:
    """``materialise``'s work on a checked, opened checkpoint (``_opened``; ``random``: no checkpoint)."""
    stats = LoadStats()
    std = float(getattr(getattr(model, "config", None), "initializer_range", 0.02))
    for name, holders, p in _parameters(model):
        if not p.is_meta:
            continue
        local = p.to_local() if isinstance(p, DTensor) else p  # (rows here, ...) of a shard; else the whole
        start, stop = shard_rows(p.shape[0], p.device_mesh.size(), p.device_mesh.get_local_rank()) \
            if isinstance(p, DTensor) else (0, p.shape[0])
        assert stop - start == local.shape[0], f"{name}: FSDP's chunk is not Shard(0)'s rows"
        if random:
            rows = _random_rows(name, tuple(local.shape), dtype, device, std, seed)
        else:
            file, key = index[name]
            read = files[file].get_slice(key)[start:stop]  # (stop - start, ...) only: this rank's rows
            stats.read_bytes += read.numel() * read.element_size()
            stats.largest_read = max(stats.largest_read, read.numel() * read.element_size())
            rows = read.to(device=device, dtype=dtype)
        stats.tensors += 1
        _assign(holders, p, rows)
    _buffers_to(model, device)
    for path, module in model.named_modules():  # a persistent buffer the checkpoint stores: its values
        for leaf, b in module.named_buffers(recurse=False):
            name = f"{path}.{leaf}" if path else leaf
            if name in index and leaf not in module._non_persistent_buffers_set:
                b.copy_(files[index[name][0]].get_tensor(index[name][1]))
    return stats


def _random_rows(name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, std: float,
                 seed: int) -> torch.Tensor:
    """A random-init shard of parameter ``name`` (``materialise`` without a checkpoint)."""
    leaf = name.rpartition(".")[2]
    if leaf == "bias":
        return torch.zeros(shape, dtype=dtype, device=device)
    if len(shape) == 1:  # a norm's weight
        return torch.ones(shape, dtype=dtype, device=device)
    rank = dist.get_rank() if dist.is_initialized() else 0
    generator = torch.Generator(device=device).manual_seed(seed + zlib.crc32(f"{name}:{rank}".encode()))
    return torch.empty(shape, dtype=dtype, device=device).normal_(0.0, std, generator=generator)


def _assign(holders: list[tuple[nn.Module, str]], p: nn.Parameter, rows: torch.Tensor) -> None:
    """Set ``rows`` as parameter ``p``'s data on every module holding it (a tied head keeps one parameter)."""
    if isinstance(p, DTensor):  # FSDP's post-load hook on the module pads the shard as fully_shard would
        value = DTensor.from_local(rows, p.device_mesh, [Shard(0)], run_check=False, shape=p.shape, stride=p.stride())
        for module, leaf in holders:
            module.load_state_dict({leaf: nn.Parameter(value, requires_grad=False)}, strict=False, assign=True)
        return
    whole = nn.Parameter(rows, requires_grad=False)
    for module, leaf in holders:
        setattr(module, leaf, whole)


def _buffers_to(model: nn.Module, device: torch.device) -> None:
    """Buffers outside FSDP's units (which moved theirs) to ``device``, in place: an alias of a buffer (an
    ``original_inv_freq`` kept beside ``inv_freq``) follows it."""
    for b in model.buffers():
        if b.device != device:
            b.data = b.to(device)


def load_sharded(name_or_path: str, *, dtype: str, device: str, quantize: str | None = None, impl: Impl = "auto",
                 fused_base_ops: bool = True, attn_implementation: str | None = None, gguf_file: str | None = None,
                 log: Callable[[str], None] | None = None) -> ShardedLoad:
    """A pack of the base at ``name_or_path`` sharded over the default process group, each rank's shard read by
    rows (module docstring), or where that cannot be (``meta_load_refusal``, or names the checkpoint lacks) loaded
    whole on every rank and sharded after, as ``log`` is told.

    Args:
        name_or_path, gguf_file, dtype, quantize, attn_implementation: as ``load_base``.
        device: this rank's device (``cpu``, ``cuda``: the current GPU).
        impl, fused_base_ops: as ``PackedModel``.

    Raises:
        UserError, ConfigError: as ``load_base`` and ``shard_base``.
    """
    source = resolve_base(name_or_path, gguf_file, log=log)
    if Path(source).is_dir():  # a damaged config.json is one line here too, before any rank builds from it
        check_checkpoint(source, name_or_path)
    why = meta_load_refusal(source, quantize)
    if why is None:
        model = meta_model(source, dtype, attn_implementation)
        with _opened(model, source) as (index, files):  # names and shapes checked once, the files opened once
            why = _check_names(model, index, files)
            if why is None:
                target = torch.device(device)
                if target.type == "cuda" and target.index is None:
                    target = torch.device("cuda", torch.cuda.current_device())
                pm = PackedModel(model, impl=impl, fused_base_ops=fused_base_ops, device=target)
                sharding = shard_base(pm)  # names and shapes stay: FSDP2 swaps parameters, not modules
                stats = _fill(pm.model, index, files, dtype=next(pm.model.parameters()).dtype, device=target,
                              seed=0, random=False)
                return ShardedLoad(pm, load_tokenizer(source), sharding, stats)
    if log is not None:
        log(f"pack.shard: each rank loads the whole base, then shards it: {why}")
    model, tokenizer = load_base(source, dtype=dtype, device=device, quantize=quantize,
                                 attn_implementation=attn_implementation)
    pm = PackedModel(model, impl=impl, fused_base_ops=fused_base_ops)
    return ShardedLoad(pm, tokenizer, shard_base(pm), None)
