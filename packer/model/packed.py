"""``PackedModel``: one frozen base causal LM with adapter slots that come and go.

The base model is loaded once (``from_pretrained``: a local checkpoint directory, a hub id, or a GGUF
file's cached plain checkpoint, ``packer.model.gguf``), frozen, and kept in eval mode so its own dropout never
draws random numbers; slots add their LoRA weights to the projections they target. No weight of the base is
copied or modified: its target projections are wrapped (``packer.model.inject``) and, on the Triton path, its
RMSNorms and SiLU-gated MLPs are swapped for fused modules over the same parameters and its attention modules
run the fused RoPE (``packer.model.fuse``).

Activation checkpointing uses transformers' own per-decoder-layer mechanism, which only checkpoints a
layer whose ``training`` flag is set. Rather than ``model.train()`` (which would turn on every dropout
of the base, GPT-2's included), only the decoder-layer modules get ``training = True``, non-recursively:
their children (attention, MLP, dropout) stay in eval mode. The recompute in the backward runs after
``forward`` has cleared the pack's layout, so each checkpoint captures the layout it ran with and
restores it while recomputing; LoRA dropout masks are counter-based (slot seed, slot step, layer), so
the recompute draws the same masks.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from lora_sweep.errors import ConfigError
from lora_sweep.kernels.ops import IMPLS, Impl, PackLayout, resolve_impl
from lora_sweep.packer.loss import plain_output_head
from lora_sweep.packer.model.fuse import fuse_base_ops
from lora_sweep.packer.model.inject import inject, resolve_targets
from lora_sweep.packer.model.layer import PackedLoRALinear, PackState
from lora_sweep.packer.model.store import SlotStore, rank_bucket_for
from lora_sweep.packer.plan import AdapterSpec

__all__ = ["PackedModel"]

_Moments = tuple[torch.Tensor, torch.Tensor]
"""AdamW's (exp_avg, exp_avg_sq) of one parameter."""

class PackedModel:
    """A frozen causal LM with LoRA adapter slots.

    Args:
        model: a Hugging Face causal LM (``AutoModelForCausalLM``) or any module with the same
            ``forward(input_ids, attention_mask) -> .logits`` contract.
        impl: packed-LoRA implementation of ``kernels.ops`` (``packed_lora``, ``packed_lora_eval``; ``auto``: the Triton
            kernels on CUDA, PyTorch on CPU).
        fused_base_ops: where ``impl`` means the Triton kernels, run the base's RMSNorms, SiLU-gated MLP middles
            and rotary embeddings as fused Triton kernels too (``packer.model.fuse``); otherwise they run eagerly.
        device: where a base built on the meta device will live once materialised (``packer.model.shard_load``): the
            pack's ``device`` until then; None: where its parameters are.
    """

    def __init__(self, model: nn.Module, *, impl: Impl = "auto", fused_base_ops: bool = True,
                 device: torch.device | None = None) -> None:
        if impl not in IMPLS:
            raise ConfigError(f"impl: must be one of {', '.join(IMPLS)} (got {impl!r})")
        self.model = model
        self._home = device
        model.requires_grad_(False)
        model.eval()  # the base's own dropout stays off: packed == alone needs no shared RNG
        fuse = fused_base_ops and resolve_impl(impl, self.device) == "triton"
        swapped = fuse_base_ops(model, "triton" if fuse else "torch")  # "torch": an earlier pack's go eager again
        self.fused: list[str] = swapped if fuse else []
        """Paths of the base's modules on the fused Triton kernels (empty when they run eagerly)."""
        self.state = PackState(impl=impl)
        self.layers: dict[str, PackedLoRALinear] = {}
        self._targets: dict[tuple[str, ...], list[str]] = {}
        """A slot's targets -> the paths they resolve to."""
        self.specs: dict[int, AdapterSpec] = {}
        self.slot_paths: dict[int, list[str]] = {}
        self._checkpointed: list[nn.Module] = []
        """Decoder layers whose forward is checkpointed (empty: activation checkpointing off)."""
        self.store: SlotStore | None = None
        """Where every slot's adapter, gradients and AdamW moments live (``packer.model.store``); set only by
        ``ensure_store`` (the training loop's, or ``add_slot``'s for a pack built outside it) and ``drop_store``."""

    @property
    def checkpointing(self) -> bool:
        """Whether the decoder layers are recomputed in the backward (``set_activation_checkpointing``)."""
        return bool(self._checkpointed)

    @property
    def device(self) -> torch.device:
        first = next(self.model.parameters())
        return self._home if first.is_meta and self._home is not None else first.device

    def add_slot(self, slot: int, spec: AdapterSpec) -> list[nn.Parameter]:
        """Start a fresh adapter in ``slot``; returns its parameters (A then B per layer, module order), views of the
        slot's rows of the store (made, or remade larger, where the slot's id or rank does not fit: ``ensure_store``).

        The initialisation depends only on ``spec.seed`` (a generator of its own, on the pack's device),
        so a slot started mid-run gets exactly the weights it would get in a fresh run on that device.

        Raises:
            ConfigError: unknown target, or a rank larger than a targeted layer.
        """
        if slot in self.specs:
            raise ValueError(f"slot {slot} is occupied")
        key = tuple(spec.targets)
        if key not in self._targets:  # a walk of the model's modules: once per target set, not per slot
            self._targets[key] = resolve_targets(self.model, key)
        paths = list(self._targets[key])
        if any(p not in self.layers for p in paths):
            inject(self.model, paths, self.state, self.layers)  # (the store wraps every projection up front)
        for path in paths:
            layer = self.layers[path]
            if spec.rank > min(layer.in_features, layer.out_features):
                raise ConfigError(f"rank: {spec.rank} is larger than layer {path} "
                                  f"({layer.in_features} -> {layer.out_features})")
        params = self._create_weights(slot, spec, paths)
        self.specs[slot] = spec
        self.slot_paths[slot] = paths
        self.state.scales[slot] = spec.scale
        return params

    def _create_weights(self, slot: int, spec: AdapterSpec, paths: list[str]) -> list[nn.Parameter]:
        """The slot's variants' init (``packer.variants``: A by ``spec.init`` from the slot's own generator and B
        zero, or a principal init's A0, B0 and frozen removal rows) into the slot's rows of the store, every other row
        of the slot zeroed first (``packer.model.store``); then their per-slot buffers' start (a DoRA slot's
        magnitudes at the base weight's column norms). The generator lives on the pack's device: the same seed gives
        the same weights on the same kind of device (one CPU generator drawing a large pack's A weights took longer
        than a training step of them)."""
        store = self.store
        if store is None or slot >= store.capacity or spec.rows > store.rank_bucket:
            store = self.ensure_store(max(slot + 1, store.capacity if store is not None else 0), spec.rows)
        generator = torch.Generator(device=self.device).manual_seed(spec.seed)
        variants = spec.variants
        store.reset_slot(slot, variants)
        self.state.mag = store.mag  # made by the first DoRA slot
        params: list[nn.Parameter] = []
        for path in paths:
            a, bt, grad_a, grad_bt = store.slot_rows(slot, path, spec.rows)
            base = self.layers[path].base
            for v in variants:  # one variant initialises A and B^T (lora, principal); others start their buffers
                if v.init is not None:
                    v.init(a, bt, base, spec, path, generator)
            for v in variants:
                if v.start is not None:
                    v.start(store.states[v], slot, spec, path, base)
            params += self.layers[path].add_slot(slot, a, bt, grad_a, grad_bt, trained=spec.rank)
        return params

    def ensure_store(self, capacity: int, rank: int, max_rows: int | None = None) -> SlotStore:
        """The pack's slot store for ``capacity`` slots of rank up to ``rank``: the present one where it has exactly
        ``capacity`` slots and a rank bucket that holds ``rank``, ``max_rows`` and the live slots' ranks, else a new
        one whose bucket is the smallest that does (``rank_bucket_for``); the live slots move into it, weights and
        AdamW moments (and DoRA's magnitudes).

        Args:
            capacity: C, slots (slot ids 0 .. C - 1).
            rank: the most rows per slot and layer the store must hold (a slot's ``rows``: 2r for a principal init).
            max_rows: rows per slot and layer the bucket must hold as well (the most a later slot will need), or None.

        Raises:
            ValueError: a live slot's id is not below ``capacity``.
        """
        old = self.store
        need = rank_bucket_for(max([rank, max_rows or 0, *(s.rows for s in self.specs.values())]))
        if old is not None and old.capacity == capacity and old.rank_bucket >= need:
            return old
        if any(slot >= capacity for slot in self.specs):
            raise ValueError(f"live slots {sorted(self.specs)} do not fit a store of {capacity} slots")
        assert old is not None or not self.specs, "live slots without a store to move them from"
        store = SlotStore(self.model, self.state, self.layers, capacity, need, self.device)
        if resolve_impl(self.state.impl, self.device) == "triton":
            store.use_operands(getattr(self.model, "dtype", torch.float32))
        for slot, spec in self.specs.items():
            store.copy_slot_from(old, slot, spec.rows, self.slot_paths[slot])  # type: ignore[arg-type]
            for path in self.slot_paths[slot]:
                layer = self.layers[path]
                layer.remove_slot(slot)
                layer.add_slot(slot, *store.slot_rows(slot, path, spec.rows), trained=spec.rank)
        self.store, self.state.mag = store, store.mag
        return store

    def drop_store(self) -> None:
        """Let go of the store (its memory is freed once nothing views it): the training run that used it is over."""
        self.store, self.state.mag = None, None

    def remove_slot(self, slot: int) -> None:
        """Drop the slot's adapter; its parameters are freed once the caller lets go of them."""
        for path in self.slot_paths.pop(slot):
            self.layers[path].remove_slot(slot)
        del self.specs[slot]
        del self.state.scales[slot]

    def slot_weights(self, slot: int) -> dict[str, tuple[nn.Parameter, nn.Parameter]]:
        """Module path -> (A (r, D_in), B (D_out, r)) of the slot's adapter, in module order."""
        return {p: (self.layers[p].lora_A[str(slot)], self.layers[p].lora_B[str(slot)])
                for p in self.slot_paths[slot]}

    def slot_magnitudes(self, slot: int) -> dict[str, torch.Tensor]:
        """Module path -> the (D_out,) DoRA magnitude of a DoRA slot (views of the store's buffer); {} otherwise."""
        if self.store is None or self.store.mag is None or slot not in self.store.mag.slots:
            return {}
        return {p: self.store.mag.slot(slot, p) for p in self.slot_paths[slot]}

    def slot_moments(self, slot: int) -> dict[str, tuple[_Moments, _Moments]]:
        """Module path -> AdamW's (exp_avg, exp_avg_sq) of the slot's A (r, D_in) and of its B (D_out, r), in module
        order: what ``torch.optim.AdamW`` keeps in ``state[param]`` for those parameters, as views of the store's
        moments (the training step's optimizer state; ``on_end`` may read them, or a test check a slot's gradients:
        after its first step ``exp_avg`` is ``(1 - beta1)`` times the clipped gradient)."""
        assert self.store is not None, "no store: the slot's moments went with it"
        out = {}
        for p in self.slot_paths[slot]:
            m_a, v_a, m_bt, v_bt = self.store.slot_moments(slot, p, self.specs[slot].rank)
            out[p] = ((m_a, v_a), (m_bt.T, v_bt.T))
        return out

    def slot_parameters(self, slot: int) -> list[nn.Parameter]:
        return [t for pair in self.slot_weights(slot).values() for t in pair]

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, layout: PackLayout | None,
                position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Logits of a packed batch.

        Args:
            input_ids: (B, L) token ids, rows grouped by slot as ``layout`` says.
            attention_mask: (B, L) 1 for real tokens, 0 for padding.
            layout: which rows belong to which slot; None runs the base model alone.
            position_ids: (B, L) positions restarting at every example of a sample-packed row
                (``packer.data.packing``); None: 0..L-1 per row.

        Returns:
            (B, L, V) logits.
        """
        with self._using(layout):
            return self.model(input_ids=input_ids, **_mask_kwargs(attention_mask, position_ids),
                              use_cache=False).logits

    def forward_hidden(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                       layout: PackLayout | None, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Final hidden states of a packed batch (the decoder body without the output head).

        Args:
            input_ids: (B, L) token ids, rows grouped by slot as ``layout`` says.
            attention_mask: (B, L) 1 for real tokens, 0 for padding.
            layout: which rows belong to which slot; None runs the base model alone.

        Returns:
            (B, L, H) hidden states after the final norm; ``output_head()`` maps them to logits.

        Raises:
            ConfigError: the model has no separate decoder body (``base_model``).
        """
        body = getattr(self.model, "base_model", self.model)
        if body is self.model:
            raise ConfigError(f"{type(self.model).__name__} has no decoder body (base_model) to run without its head")
        with self._using(layout):
            return body(input_ids=input_ids, **_mask_kwargs(attention_mask, position_ids),
                        use_cache=False).last_hidden_state

    def output_head(self) -> nn.Module:
        """The output projection (``get_output_embeddings()``), checked to produce the logits unchanged.

        Raises:
            ConfigError: the model has no output head, or post-processes its logits (soft-capping, scaling).
        """
        return plain_output_head(self.model)

    def set_activation_checkpointing(self, enabled: bool) -> None:
        """Recompute each decoder layer's activations in the backward instead of keeping them.

        Uses transformers' non-reentrant checkpointing of every decoder layer. The base stays frozen
        and in eval mode (see the module docstring for the per-layer ``training`` flag).

        Raises:
            ConfigError: the model does not support activation checkpointing.
        """
        from transformers import PreTrainedModel
        from transformers.modeling_layers import GradientCheckpointingLayer

        model = self.model
        new_api = hasattr(model, "activation_checkpointing_enable")  # where both names exist, the old one warns
        if not enabled:
            if self._checkpointed and isinstance(model, PreTrainedModel):
                model.activation_checkpointing_disable() if new_api else model.gradient_checkpointing_disable()
                for layer in self._checkpointed:
                    layer.training = False
                self._checkpointed = []
            return
        if not (isinstance(model, PreTrainedModel) and model.supports_gradient_checkpointing):
            raise ConfigError(f"activation_checkpointing: {type(model).__name__} does not support it")
        # no RNG state to save and restore: the base runs in eval mode and LoRA dropout masks are counter-based,
        # so nothing in a layer draws from the global generators; and reading a CUDA generator's state is what a
        # CUDA graph capture cannot do (the step captures the recompute with the rest of the backward)
        kwargs = {"use_reentrant": False, "context_fn": self._checkpoint_contexts, "preserve_rng_state": False}
        if new_api:
            model.activation_checkpointing_enable(kwargs)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        model.disable_input_require_grads()  # the LoRA weights already require grad; no need for input grads
        self._checkpointed = [m for m in model.modules()
                              if isinstance(m, GradientCheckpointingLayer) and m.gradient_checkpointing]

    def _checkpoint_contexts(self) -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
        """``context_fn`` of ``torch.utils.checkpoint``: called in the forward; the recompute runs under the
        layout that was current then."""
        return contextlib.nullcontext(), self._using(self.state.layout)

    @contextlib.contextmanager
    def _using(self, layout: PackLayout | None) -> Iterator[None]:
        for layer in self._checkpointed:
            layer.training = True  # re-armed every pass: a model.eval() elsewhere would silently turn it off
        previous, self.state.layout = self.state.layout, layout
        try:
            yield
        finally:
            self.state.layout = previous


def _mask_kwargs(attention_mask: torch.Tensor, position_ids: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """The model's mask arguments. With ``position_ids`` the padding mask is left out: transformers then reads
    example boundaries from positions that restart (``masking_utils.find_packed_sequence_indices``) and builds a
    block-diagonal causal mask; right padding needs no mask in a causal model, no real token attends to it."""
    if position_ids is None:
        return {"attention_mask": attention_mask}
    return {"position_ids": position_ids}
