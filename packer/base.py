"""The packer as one object: ``open_base`` loads a frozen base once and returns the ``Packer`` that trains, measures
and saves adapters over it.

What the floors above ask the packer, by verb (PEFT's ``PeftModel.from_pretrained`` / ``save_pretrained`` and
torchtune's recipe ``setup`` / ``train`` are the shapes it follows):

- **open**: ``open_base(path, ...)``: the base model and its tokenizer, wrapped as a pack (``PackedModel``), whole
  or sharded over the process group; ``Packer.examples`` tokenizes a data file with the base's tokenizer.
- **plan**: ``Packer.shape`` (the base's projections and bytes, ``packer.plan.BaseShape``), ``Packer.calibrate``
  (a measured ``packer.plan.MemoryModel``, its probes' options for a space from ``Packer.probe_options``, what it
  depends on from ``Packer.measured_on``), ``Packer.forward_seconds``, ``Packer.sharded_load_peak`` and
  ``Packer.check_sample_packing``.
- **train**: ``Packer.train(capacity, next_job, on_step=..., should_stop=..., on_end=...)``, the one training loop
  (``packer.step.train.train``).
- **evaluate**: ``Packer.model`` is what an evaluator scores (``evaluators.registry.evaluate``), through
  ``packer.evaluation`` (every item's loss under every slot, greedy decoding).
- **save / export**: ``Packer.save`` writes slots as PEFT adapter directories off the caller's path; what needs no
  base opened is a static method: the adapter directories' ``read_adapter``, ``write_adapter`` and
  ``discard_adapter``, the base an export merges into (``merge_base``), the tokenizer alone (``read_tokenizer``), the
  device's free memory (``free_memory``) and whether a sharded load reads by rows (``shard_load_refusal``).

This module imports no torch: a method imports the packer module it runs when it is called, so the face
(``packer.api``) and a study file's check stay light.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lora_sweep.packer.plan import AdapterSpec, BaseShape, MemoryModel

if TYPE_CHECKING:
    import torch

    from lora_sweep.kernels.ops import Impl
    from lora_sweep.packer.data.rows import Example
    from lora_sweep.packer.model.checkpoint import AdapterWriter
    from lora_sweep.packer.model.packed import PackedModel
    from lora_sweep.packer.probe import PackTiming
    from lora_sweep.packer.step.jobs import SlotEnd, SlotJob, StepReport, TrainResult

__all__ = ["Packer", "open_base", "tiny_base"]


@dataclass
class Packer:
    """One frozen base with its adapter slots, and what the packer does over it (module docstring).

    Built by ``open_base``, or around a ``PackedModel`` built elsewhere (``Packer(pm, tokenizer)``).
    """

    model: PackedModel
    """The packed model: the frozen base, its adapter slots; what evaluators score."""
    tokenizer: Any = None
    source: str = ""
    """What the base was loaded from, as adapters name it (``base_model_name_or_path``): the path given, or a GGUF
    source's cached checkpoint directory."""
    gguf: Path | None = None
    """The GGUF file the base was converted from, if any."""
    _writer: AdapterWriter | None = field(default=None, repr=False)
    _saved_s: float = field(default=0.0, repr=False)

    @property
    def pad_id(self) -> int:
        """The tokenizer's padding id (its EOS id when it has none)."""
        pad = self.tokenizer.pad_token_id
        return pad if pad is not None else self.tokenizer.eos_token_id

    def examples(self, path: str | Path, *, fmt: str = "auto", max_length: int = 512, train_on_prompt: bool = False,
                 max_line_bytes: int | None = None) -> list[Example]:
        """The rows of the JSON-lines file ``path`` tokenized with the base's tokenizer, labels masked on the prompt
        (``packer.data.rows.load_examples``)."""
        from lora_sweep.packer.data.rows import load_examples

        extra = {} if max_line_bytes is None else {"max_line_bytes": max_line_bytes}
        return load_examples(path, self.tokenizer, fmt=fmt, max_length=max_length, train_on_prompt=train_on_prompt,
                             **extra)

    # -- plan

    def shape(self, worlds: Sequence[int] = ()) -> BaseShape:
        """What a plan needs of the base (``packer.probe.base_shape``): its adaptable projections, parameter bytes and
        what one rank of an FSDP shard over each of ``worlds`` holds."""
        from lora_sweep.packer.probe import base_shape

        return base_shape(self.model.model, worlds)

    def forward_seconds(self) -> float:
        """The fixed time of one evaluation forward of the base (``packer.probe.forward_seconds``)."""
        from lora_sweep.packer.probe import forward_seconds

        return forward_seconds(self.model)

    def calibrate(self, seq_len: int, **options: Any) -> MemoryModel:
        """A memory model measured by probe packs on this base at ``seq_len`` tokens (``packer.probe.calibrate``;
        ``options``: its training options)."""
        from lora_sweep.packer.probe import calibrate

        return calibrate(self.model, seq_len, **options)

    def targets(self, modules: Sequence[str]) -> dict[str, tuple[int, int] | None]:
        """The base's projections ``modules`` names (leaf names or ``ALL_LINEAR``), in module order, each with its
        (D_in, D_out) (None for a module the packer does not adapt) (``packer.model.inject``).

        Raises:
            ConfigError: a target matches no projection; the message lists the names that exist.
        """
        from lora_sweep.packer.model.inject import linear_shape, resolve_targets

        model = self.model.model
        return {path: linear_shape(model.get_submodule(path)) for path in resolve_targets(model, modules)}

    @staticmethod
    def probe_options(values: Callable[[str], Collection[Any]]) -> dict[str, Any]:
        """``calibrate``'s adapter options (``dora``, ``dropout``) that size the dearest slot of a space whose slots
        take ``values(field)`` for an ``AdapterSpec`` field (its choices, or a range's ends). A space that can train
        DoRA is probed with DoRA slots (their magnitudes, the norm per step and, on the Triton kernels, each
        projection's output kept for the rescale's backward) at the largest dropout it can train (a DoRA slot with
        dropout also keeps ``W (x - drop(x))`` per projection); else with plain slots without dropout. What a
        calibration measured depends on them: a cached one is keyed by them too."""
        dora = True in values("dora")
        return {"dora": dora, "dropout": float(max(values("dropout"))) if dora else 0.0}

    @property
    def probe_steps(self) -> int:
        """Steps each probe pack of ``calibrate`` trains (``packer.probe.PROBE_STEPS``)."""
        from lora_sweep.packer.probe import PROBE_STEPS

        return PROBE_STEPS

    def time_pack(self, specs: Sequence[AdapterSpec], rows: int, length: int, **options: Any) -> PackTiming:
        """Seconds a step of the pack ``sweep plan`` sized takes on this base: real steps of ``len(specs)`` slots of
        ``rows`` rows of ``length`` tokens on the run's step (``packer.probe.time_pack``; ``options``: its steps,
        warm-up, rank bucket and training options)."""
        from lora_sweep.packer.probe import time_pack

        return time_pack(self.model, specs, rows, length, **options)

    def check_sample_packing(self) -> None:
        """Refuse sample packing on this base (``packer.step.isolation.check_sample_packing``).

        Raises:
            ConfigError: the family is not verified, or packed examples attend to each other.
        """
        from lora_sweep.packer.step.isolation import check_sample_packing

        check_sample_packing(self.model)

    # -- train

    @staticmethod
    def length_buckets(row_lengths: Sequence[int], rows_per_step: int) -> tuple[int, ...]:
        """At most a few padded step lengths for a pack whose steps hold ``rows_per_step`` rows drawn from rows of
        ``row_lengths`` tokens (``packer.step.shapes.length_buckets``): ``train``'s ``lengths``, its bounded shapes."""
        from lora_sweep.packer.step.shapes import length_buckets

        return length_buckets(row_lengths, rows_per_step)

    def train(self, capacity: int, next_job: Callable[[int], SlotJob | None], *,
              on_step: Callable[[list[StepReport]], None] | None = None,
              should_stop: Callable[[StepReport], bool] | None = None,
              on_end: Callable[[list[SlotEnd]], None] | None = None, **options: Any) -> TrainResult:
        """Train adapters in ``capacity`` slots until ``next_job`` has none left (``packer.step.train.train``: its
        callbacks, and ``options`` such as ``max_global_steps``, ``chunked_ce``, ``lengths``); pads with ``pad_id``
        unless ``options`` names one."""
        from lora_sweep.packer.step.train import train

        options.setdefault("pad_id", self.pad_id)
        return train(self.model, capacity, next_job, on_step=on_step, should_stop=should_stop, on_end=on_end,
                     **options)

    # -- save / export

    def save(self, items: Sequence[tuple[int, str | Path, dict[str, str] | None]], *,
             base_model_name_or_path: str | None = None) -> list[Future[Path]]:
        """Queue each ``(slot, out_dir, metadata)`` slot's adapter as a PEFT adapter directory, written on
        background threads (``packer.model.checkpoint.AdapterWriter``); returns one future per item, done once the
        directory is in place and on disk. ``base_model_name_or_path``: what the adapters name (``source``)."""
        if self._writer is None:
            from lora_sweep.packer.model.checkpoint import AdapterWriter

            self._writer = AdapterWriter()
        return self._writer.submit(self.model, items, base_model_name_or_path=base_model_name_or_path or self.source)

    @property
    def save_seconds(self) -> float:
        """Seconds the writer's threads spent writing adapters, summed over the threads."""
        return self._saved_s + (self._writer.busy_s if self._writer is not None else 0.0)

    def close(self) -> None:
        """Wait for every queued adapter write (``save``); a later ``save`` starts new threads."""
        if self._writer is not None:
            self._writer.close()
            self._saved_s += self._writer.busy_s
            self._writer = None

    # -- what the packer answers without a base opened

    @staticmethod
    def read_tokenizer(path: str, gguf_file: str | None = None) -> Any:
        """The base's tokenizer alone, its weights not read (``packer.model.load.load_tokenizer``)."""
        from lora_sweep.packer.model.load import load_tokenizer

        return load_tokenizer(path, gguf_file=gguf_file)

    @staticmethod
    def free_memory(device: str) -> int:
        """Bytes a pack may use on ``device`` (``cpu``, ``cuda``, ``cuda:1``): free GPU memory, or the machine's
        available RAM (``packer.probe.available_memory``)."""
        import torch

        from lora_sweep.packer.probe import available_memory

        return available_memory(torch.device(device))

    @staticmethod
    def measured_on(device: str) -> dict[str, Any]:
        """What a measurement on ``device`` (``calibrate``, ``time_pack``) depends on beyond the base and the options
        it is given: the device, a GPU by its model rather than its index (``cuda`` as a plan names it and a pack's
        ``cuda:0`` are one), torch's version and its CPU threads."""
        import torch

        where = torch.device(device)
        if where.type == "cuda":
            device = f"cuda {torch.cuda.get_device_name(where)}"
        return {"device": device, "torch": torch.__version__, "threads": torch.get_num_threads()}

    @staticmethod
    def shard_load_refusal(path: str, gguf_file: str | None = None, quantize: str | None = None) -> str | None:
        """Why a sharded pack cannot read the base at ``path`` by rows (each rank then loads it whole first), or None
        when it can (``packer.model.shard_load.meta_load_refusal``; reads file names and headers only)."""
        from lora_sweep.packer.model.load import resolve_base
        from lora_sweep.packer.model.shard_load import meta_load_refusal

        return meta_load_refusal(resolve_base(path, gguf_file), quantize)

    @staticmethod
    def sharded_load_peak(base: BaseShape, gpus: int, path: str, gguf_file: str | None = None,
                          quantize: str | None = None) -> tuple[int, str]:
        """The base bytes one of ``gpus`` GPUs holds while the base at ``path`` (of shape ``base``) loads sharded, and
        how it loads (``packer.model.shard_load.load_sharded``): its share and a chunk read by rows
        (``BaseShape.shard_load``) where ``shard_load_refusal`` allows, else the whole base on every rank first."""
        why = Packer.shard_load_refusal(path, gguf_file, quantize)
        if why is None and gpus in base.shard_load:
            return base.shard_load[gpus], "each rank reads its shard by rows"
        return base.param_bytes, f"each rank loads the whole base first: {why or 'no shard computed'}"

    @staticmethod
    def read_adapter(adapter_dir: str | Path) -> tuple[dict, dict[str, torch.Tensor]]:
        """A PEFT adapter directory's config and tensors (``packer.model.checkpoint.read_adapter``)."""
        from lora_sweep.packer.model.checkpoint import read_adapter

        return read_adapter(adapter_dir)

    @staticmethod
    def discard_adapter(adapter_dir: str | Path) -> None:
        """Remove an adapter directory, and a half-written one beside it (``packer.model.checkpoint``)."""
        from lora_sweep.packer.model.checkpoint import discard_adapter

        discard_adapter(adapter_dir)

    @staticmethod
    def write_adapter(out_dir: str | Path, config: dict, tensors: dict[str, torch.Tensor],
                      metadata: dict[str, str] | None = None) -> None:
        """Write ``config`` and ``tensors`` into the existing directory ``out_dir`` as PEFT's two adapter files
        (``adapter_config.json``, ``adapter_model.safetensors``); the caller makes the directory appear whole."""
        import json

        from safetensors.torch import save_file

        from lora_sweep.packer.model.checkpoint import CONFIG_NAME, WEIGHTS_NAME

        out = Path(out_dir)
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / WEIGHTS_NAME),
                  metadata={"format": "pt", **(metadata or {})})
        (out / CONFIG_NAME).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")

    @staticmethod
    def vllm_refusal(config: dict, tensors: dict[str, torch.Tensor]) -> str | None:
        """Why vLLM cannot serve a read adapter as it is, or None (``packer.model.peft_adapter.vllm_refusal``)."""
        from lora_sweep.packer.model.peft_adapter import vllm_refusal

        return vllm_refusal(config, tensors)

    @staticmethod
    def vllm_adapter(config: dict, tensors: dict[str, torch.Tensor], hint: str = "use vllm=False"
                     ) -> tuple[dict, dict[str, torch.Tensor], list[str]]:
        """The read adapter under vLLM's rules, the same function: (config, tensors, the changes made)
        (``packer.model.peft_adapter.vllm_adapter``)."""
        from lora_sweep.packer.model.peft_adapter import vllm_adapter

        return vllm_adapter(config, tensors, hint)

    @staticmethod
    def merge_adapter(model: torch.nn.Module, config: dict, tensors: dict[str, torch.Tensor]) -> None:
        """Fold a read adapter into ``model`` (``merge_base``'s) in place, each variant's tensors by its ``merge``
        (``packer.model.peft_adapter.merge_adapter``)."""
        from lora_sweep.packer.model.peft_adapter import merge_adapter

        merge_adapter(model, config, tensors)

    @staticmethod
    def merge_base(path: str, quantize: str | None = None) -> tuple[torch.nn.Module, Any]:
        """The base at ``path`` and its tokenizer as an export merges an adapter into it: in the checkpoint's own
        dtype, on the CPU; for an adapter trained over a quantized base (``quantize``: ``nf4``), its projections
        quantized and dequantized again (``packer.model.quant``), the weights the adapter trained against."""
        from lora_sweep.packer.model.load import load_base

        model, tokenizer = load_base(path, dtype="auto")
        if quantize:
            from lora_sweep.packer.model.quant import dequantize_base, quantize_base

            quantize_base(model, quantize)
            dequantize_base(model)
        return model, tokenizer


def open_base(path: str, *, gguf_file: str | None = None, dtype: str = "float32", device: str = "cpu",
              quantize: str | None = None, kernels: Impl = "auto", fused_base_ops: bool = True,
              sharded: bool = False, kernel_cache: Path | None = None,
              log: Callable[[str], None] | None = None) -> Packer:
    """Load the base model at ``path`` and its tokenizer as a pack (``packer.model``).

    Args:
        path, gguf_file: a local directory saved with ``save_pretrained``, a hub id, a ``.gguf`` file or the directory
            of ``gguf_file``; a GGUF source loads from its cached plain checkpoint (``packer.model.load.resolve_base``).
        dtype, device, quantize: as ``packer.model.load.load_base``.
        kernels, fused_base_ops: the packed layer's implementation and base ops (``PackedModel``).
        sharded: each rank of the default process group reads its FSDP2 shard of the base
            (``packer.model.shard_load.load_sharded``).
        kernel_cache: a folder that keeps the compiled kernels between runs; given, their hash is computed on a
            thread beside the load (``packer.model.load.prepare_kernels``).
        log: told of a GGUF conversion and of a sharded load's route.

    Raises:
        UserError: the base cannot be read.
    """
    from lora_sweep.packer.model.gguf import gguf_source
    from lora_sweep.packer.model.load import load_base, prepare_kernels, resolve_base
    from lora_sweep.packer.model.packed import PackedModel

    if kernel_cache is not None:
        prepare_kernels(kernels, device, kernel_cache)
    source = resolve_base(path, gguf_file, log=log)
    if sharded:
        from lora_sweep.packer.model.shard_load import load_sharded

        loaded = load_sharded(source, dtype=dtype, device=device, quantize=quantize, impl=kernels,
                              fused_base_ops=fused_base_ops, log=log)
        pm, tokenizer = loaded.pm, loaded.tokenizer
    else:
        model, tokenizer = load_base(source, dtype=dtype, device=device, quantize=quantize)
        pm = PackedModel(model, impl=kernels, fused_base_ops=fused_base_ops)
    return Packer(pm, tokenizer, source=source, gguf=gguf_source(path, gguf_file))


def tiny_base(family: str, out_dir: str | Path, *, seed: int = 0) -> Path:
    """A tiny random-init model of ``family`` (one of ``FAMILY_NAMES``) and a local tokenizer, saved in ``out_dir``
    with ``save_pretrained``: a base ``open_base`` loads in a second (``packer.tiny.models.build_tiny_model``)."""
    from lora_sweep.packer.tiny.models import build_tiny_model

    return build_tiny_model(family, out_dir, seed=seed)
