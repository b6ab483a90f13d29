"""Per-slot adapter hyperparameters.

``AdapterSpec`` is everything the packer needs to train one adapter in one slot of a pack. It is
owned by the packer: the sweep layer builds one per trial from its own study config, and the
packer never sees a study object. Stdlib only, so validation tests run in milliseconds.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from lora_sweep.packer import variants as _variants
from lora_sweep.packer.variants import INITS, Variant, require

__all__ = ["AdapterSpec", "ALL_LINEAR", "SCHEDULES", "INITS", "MemoryModel", "adapter_param_count",
           "ADAPTER_BYTES_PER_PARAM", "BaseShape"]

ALL_LINEAR = "all-linear"
"""Target value meaning every linear projection of the decoder (PEFT's ``"all-linear"``)."""

SCHEDULES = (
    "constant",
    "constant_with_warmup",
    "linear",
    "cosine",
    "cosine_with_restarts",
    "polynomial",
    "inverse_sqrt",
)
"""Learning-rate schedule names, as ``transformers.get_scheduler`` spells them."""

MAX_RANK = 256

_INIT_ALIASES = {"true": "kaiming", "default": "kaiming"}
"""Spellings of PEFT's default initialisation (``init_lora_weights: true``)."""


@dataclass(frozen=True)
class AdapterSpec:
    """Hyperparameters of one LoRA adapter trained in one slot.

    Field names follow PEFT/torchtune where they exist (``rank`` is PEFT's ``r``).
    """

    rank: int = 16
    """LoRA rank r, 1..256 and at most the smaller dimension of every targeted layer."""
    alpha: float = 32.0
    """LoRA alpha; the update is scaled by alpha/r (alpha/sqrt(r) with rsLoRA)."""
    rslora: bool = False
    """Rank-stabilised scaling alpha/sqrt(r) (PEFT ``use_rslora``)."""
    dropout: float = 0.0
    """Dropout probability on the LoRA input, in [0, 1)."""
    targets: tuple[str, ...] = (ALL_LINEAR,)
    """Leaf module names to adapt (e.g. ``q_proj``, GPT-2's ``c_attn``), or ``all-linear``."""
    lr: float = 2e-4
    """Peak learning rate of AdamW."""
    weight_decay: float = 0.0
    """AdamW decoupled weight decay."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW betas."""
    eps: float = 1e-8
    """AdamW epsilon."""
    warmup_steps: int = 0
    """Linear warm-up steps of the schedule."""
    schedule: str = "constant"
    """Learning-rate schedule after warm-up, one of ``SCHEDULES``."""
    max_steps: int = 100
    """Optimizer steps this adapter trains for."""
    micro_batch: int = 4
    """Sequences per step drawn from this slot's own data stream."""
    max_grad_norm: float | None = 1.0
    """Clip this adapter's gradient norm to this value (None: no clipping)."""
    seed: int = 0
    """Seeds A's initialisation, the data order and the dropout masks of this slot."""
    extra: dict[str, object] = field(default_factory=dict, compare=False, hash=False)
    """Free-form labels carried along (e.g. the trial number); never read by the packer."""
    gradient_accumulation_steps: int = 1
    """Micro-batches per optimizer step; the step's gradient is that of the mean over all target tokens of
    the ``micro_batch * gradient_accumulation_steps`` examples (transformers' ``num_items_in_batch``)."""
    sample_packing: bool = False
    """Pack several examples into each row up to the row length (``packer.data.packing``); ``micro_batch`` then
    counts rows, as in Axolotl."""
    lr_ratio: float = 1.0
    """LoRA+ (PEFT's ``loraplus_lr_ratio``): B's learning rate over A's; B's decay and step use ``lr * lr_ratio``
    (1: plain LoRA)."""
    dora: bool = False
    """DoRA (PEFT's ``use_dora``): a trained magnitude per output column over the direction of W + s B A."""
    init: str = "kaiming"
    """Initialisation of A and B, one of ``INITS`` (PEFT's ``init_lora_weights``; ``true`` / ``default`` mean
    ``kaiming``)."""
    lorafa: bool = False
    """LoRA-FA (PEFT's ``create_lorafa_optimizer``): A frozen at its init, B trained with the projected gradient
    (``packer.variants.lorafa``)."""

    def __post_init__(self) -> None:
        if self.init is True or str(self.init).lower() in _INIT_ALIASES:  # YAML's true, PEFT's default
            object.__setattr__(self, "init", "kaiming")
        _check(isinstance(self.rank, int) and 1 <= self.rank <= MAX_RANK, "rank", f"must be 1..{MAX_RANK}", self.rank)
        _check(math.isfinite(self.alpha) and self.alpha > 0, "alpha", "must be > 0", self.alpha)
        _check(0.0 <= self.dropout < 1.0, "dropout", "must be in [0, 1)", self.dropout)
        _check(len(self.targets) > 0 and all(isinstance(t, str) and t for t in self.targets),
               "targets", "must be a non-empty list of module names", self.targets)
        _check(math.isfinite(self.lr) and self.lr > 0, "lr", "must be > 0", self.lr)
        _check(self.weight_decay >= 0, "weight_decay", "must be >= 0", self.weight_decay)
        _check(len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas), "betas", "must be two values in [0, 1)",
               self.betas)
        _check(self.eps > 0, "eps", "must be > 0", self.eps)
        _check(isinstance(self.max_steps, int) and self.max_steps >= 1, "max_steps", "must be >= 1", self.max_steps)
        _check(isinstance(self.warmup_steps, int) and 0 <= self.warmup_steps, "warmup_steps", "must be >= 0",
               self.warmup_steps)
        _check(self.schedule in SCHEDULES, "schedule", f"must be one of {', '.join(SCHEDULES)}", self.schedule)
        _check(isinstance(self.micro_batch, int) and self.micro_batch >= 1, "micro_batch", "must be >= 1",
               self.micro_batch)
        accum = self.gradient_accumulation_steps
        _check(isinstance(accum, int) and not isinstance(accum, bool) and accum >= 1, "gradient_accumulation_steps",
               "must be an int >= 1",
               self.gradient_accumulation_steps)
        _check(isinstance(self.sample_packing, bool), "sample_packing", "must be true or false", self.sample_packing)
        _check(self.max_grad_norm is None or self.max_grad_norm > 0, "max_grad_norm", "must be > 0 or null",
               self.max_grad_norm)
        _variants.check(self)  # the variants' own fields: lr_ratio, dora, init, lorafa (packer.variants)

    @property
    def principal(self) -> bool:
        """Whether A and B start from the base weight's principal part (``pissa``, ``olora``), which the pack keeps
        as a frozen correction ``-s B0 A0`` beside the shared base (``packer.variants.decompose``)."""
        return _variants.principal.VARIANT.applies(self)

    @property
    def variants(self) -> tuple[Variant, ...]:
        """The slot's adapter variants (``packer.variants.of``), which the pack's call sites ask."""
        return _variants.of(self)

    @property
    def rows(self) -> int:
        """Rows of A and B^T the slot's forward reads per layer: its rank, and as many again for the frozen
        principal correction of ``pissa`` / ``olora`` (a variant's ``rows``)."""
        return max([self.rank, *(v.rows(self) for v in self.variants if v.rows is not None)])

    @property
    def scale(self) -> float:
        """The factor s in ``y = W x + s * B A x`` (PEFT's ``scaling``)."""
        return self.alpha / (math.sqrt(self.rank) if self.rslora else self.rank)


_check = require


ADAPTER_BYTES_PER_PARAM = 16
"""fp32 weight + fp32 gradient + AdamW's two fp32 moments: the least an adapter parameter costs."""


@dataclass(frozen=True)
class MemoryModel:
    """Peak memory and time of one packed training step, linear in its parts.

    ``peak = base + tokens * (bytes_per_token + bytes_per_token_rank * rank_width) + ce
    + bytes_per_param * params``:
    ``base`` is the frozen base (weights, buffers); ``bytes_per_token`` the activations kept for
    backward plus, without chunked cross-entropy, the logits and loss buffers of one padded token;
    ``bytes_per_token_rank`` the LoRA intermediates per unit of the pack's rank width (a token meets only its own
    slot's rank bucket, on the Triton kernels and the torch path alike: the largest rank); ``ce`` the chunked
    cross-entropy's transient logits, which grow with the tokens only up to one chunk; the last term every slot's
    adapter weights, gradients and AdamW moments, and the per-layer gathered copies the packed layers
    make of them and of their gradients (with ``optimizer_in_backward`` no gradient buffer: 12 B of the 16 B, plus
    the one layer's gradient alive at a time). The measured numbers come from ``packer.probe.calibrate``.
    """

    base_bytes: int
    """The frozen base's memory (weights, buffers) with no step running: what the device holds once the model is
    loaded, or the calibration fit's intercept where that is larger."""
    bytes_per_token: float
    """Extra peak memory per padded token of a step."""
    bytes_per_token_rank: float = 0.0
    """Extra peak memory per padded token and unit of the pack's rank width."""
    seconds_per_token: float = 0.0
    """Forward + backward time per padded token (for time predictions)."""
    seconds_per_step: float = 0.0
    """Fixed time per step (launches, optimizer, Python)."""
    ce_chunk_bytes: int = 0
    """Peak transient memory of the chunked cross-entropy over one full chunk (0: not chunked)."""
    ce_chunk_tokens: int = 0
    """Tokens per cross-entropy chunk."""
    bytes_per_param: float = ADAPTER_BYTES_PER_PARAM
    """Peak memory per trainable adapter parameter (measured by the probe; at least the optimizer's 16 B, or 12 B
    with ``optimizer_in_backward``)."""
    optimizer_in_backward: bool = False
    """Calibrated with the optimizer step in the backward: the gradients of one layer at a time instead of every
    slot's gradient buffer (what remains of them, one layer's share, is in ``bytes_per_param``, measured)."""

    def ce_bytes(self, tokens: int) -> float:
        """Transient memory of the chunked cross-entropy over a step of ``tokens`` tokens."""
        return self.ce_chunk_bytes * min(tokens, self.ce_chunk_tokens) / self.ce_chunk_tokens if self.ce_chunk_tokens \
            else 0.0

    def predict(self, tokens: int, adapter_params: int, total_rank: int = 0, max_rank: int | None = None) -> int:
        """Peak bytes of a step over ``tokens`` padded tokens, ``adapter_params`` trainable parameters and
        slots whose ranks add up to ``total_rank`` (the largest of them ``max_rank``, default the sum)."""
        width = total_rank if max_rank is None else max_rank
        per_token = self.bytes_per_token + self.bytes_per_token_rank * width
        return int(self.base_bytes + per_token * tokens + self.ce_bytes(tokens)
                   + self.bytes_per_param * adapter_params)

    def step_seconds(self, tokens: int) -> float:
        return self.seconds_per_step + self.seconds_per_token * tokens

    def max_slots(self, budget_bytes: int, tokens_per_slot: int, params_per_slot: int, rank: int,
                  limit: int = 256) -> int:
        """Most slots of ``tokens_per_slot`` tokens, ``params_per_slot`` parameters and rank ``rank`` each
        whose step fits in ``budget_bytes`` (0 if not even one fits)."""
        n = 0
        while n < limit and self.predict(tokens_per_slot * (n + 1), params_per_slot * (n + 1),
                                         rank * (n + 1), rank) <= budget_bytes:
            n += 1
        return n

    def pack_peak(self, base: BaseShape, slots: int, rows: int, tokens_per_slot: int, gpus: int = 1) -> int:
        """Peak bytes of a step of ``slots`` slots as wide as a slot gets: every projection of ``base`` adapted with
        ``rows`` rows (a PiSSA / OLoRA slot's 2r: ``AdapterSpec.rows``), ``tokens_per_slot`` padded tokens each; on
        one of ``gpus`` GPUs the base is sharded over (``base_bytes``: one rank's share in place of the whole base,
        the slots replicated on every GPU)."""
        return self.predict(slots * tokens_per_slot, slots * base.adapter_params(rows), slots * rows, rows) + \
            base.shard_extra(gpus)

    def slots_for(self, base: BaseShape, rows: int, tokens_per_slot: int, budget_bytes: int, limit: int = 256,
                  gpus: int = 1) -> int:
        """Most slots of ``pack_peak``'s kind whose step fits in ``budget_bytes`` (0 if not even one fits)."""
        return self.max_slots(budget_bytes - base.shard_extra(gpus), tokens_per_slot, base.adapter_params(rows), rows,
                              limit=limit)

    def base_on(self, base: BaseShape, gpus: int = 1) -> int:
        """The base's part of the peak on one of ``gpus`` GPUs: the whole base, or one rank's share of it sharded."""
        return self.base_bytes + base.shard_extra(gpus)


def adapter_param_count(shapes: list[tuple[int, int]], rank: int) -> int:
    """Trainable parameters of a rank-``rank`` adapter on layers of (D_in, D_out) ``shapes``."""
    return sum(rank * (d_in + d_out) for d_in, d_out in shapes)


@dataclass(frozen=True)
class BaseShape:
    """What a plan needs of the base model, without its weights (``packer.probe.base_shape`` reads it from a model;
    ``to_json`` / ``from_json`` keep it beside a cached calibration)."""

    projections: tuple[tuple[str, int, int], ...]
    """(leaf name, D_in, D_out) of every adaptable projection, in module order (output head excluded)."""
    param_bytes: int
    """Bytes of the base's parameters (distinct tensors; the FSDP share replaces them per rank)."""
    shard_peak: dict[int, int] = dataclasses.field(default_factory=dict)
    """World size -> the most parameter bytes one rank holds at once under ``packer.model.shard`` (``BaseShare.peak`` of
    rank 0); only for models ``packer.model.shard`` can shard."""
    shard_load: dict[int, int] = dataclasses.field(default_factory=dict)
    """World size -> the most parameter bytes one rank holds while it loads its share by rows (``BaseShare.load_peak``
    of rank 0, ``packer.model.shard_load``)."""
    forward_s: float = 0.0
    """Seconds of one forward of the base over one short row without gradients (``packer.probe.forward_seconds``):
    the fixed cost of each of an evaluation's forwards; 0: not measured."""
    load_s: float = 0.0
    """Seconds the base took to load (weights and tokenizer) where the calibration loaded it; 0: not measured."""
    imports_s: float = 0.0
    """Seconds a ``sweep run`` process spends before it loads the model (its imports, the study file): measured in
    the process that calibrated, with what a run imports; 0: not measured."""

    def shard_extra(self, gpus: int) -> int:
        """Bytes one of ``gpus`` ranks holds of the base sharded over them, beyond the whole base a calibration
        counted (negative: the saving); 0 for one GPU.

        Raises:
            KeyError: no share was computed for ``gpus`` (``shard_peak``).
        """
        return self.shard_peak[gpus] - self.param_bytes if gpus > 1 else 0

    def adapter_params(self, rank: int) -> int:
        """Trainable parameters of a rank-``rank`` adapter on every projection."""
        return adapter_param_count([(d_in, d_out) for _, d_in, d_out in self.projections], rank)

    def has_targets(self, target_sets: Iterable[Iterable[str]]) -> bool:
        """Whether every set names only projections this base has (``all-linear`` included)."""
        leaves = {leaf for leaf, _, _ in self.projections}
        return all(ALL_LINEAR in names or set(names) <= leaves for names in map(set, target_sets))

    def to_json(self) -> dict[str, Any]:
        return {"projections": [list(p) for p in self.projections], "param_bytes": self.param_bytes,
                "shard_peak": {str(w): b for w, b in self.shard_peak.items()},
                "shard_load": {str(w): b for w, b in self.shard_load.items()},
                "forward_s": self.forward_s, "load_s": self.load_s, "imports_s": self.imports_s}

    @classmethod
    def from_json(cls, record: dict[str, Any]) -> BaseShape:
        return cls(tuple((str(leaf), int(d_in), int(d_out)) for leaf, d_in, d_out in record["projections"]),
                   int(record["param_bytes"]), {int(w): int(b) for w, b in record["shard_peak"].items()},
                   {int(w): int(b) for w, b in record["shard_load"].items()}, float(record["forward_s"]),
                   float(record["load_s"]), float(record["imports_s"]))
