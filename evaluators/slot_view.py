"""One slot of a packed model seen as a plain causal LM: the model lm-eval's ``HFLM`` is given (``evaluators.lm_eval``).

Its own module because it is an ``nn.Module``: ``evaluators.lm_eval`` (which the registry, and so a study file's
check, imports) loads torch only when it runs.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from lora_sweep.evaluators._core import slot_layout

if TYPE_CHECKING:
    from lora_sweep.packer.api import PackedModel

__all__ = ["SlotView"]


class SlotView(nn.Module):
    """One slot of a packed model seen as a plain causal LM: every row of every call uses that slot.

    The base model is not a submodule, so ``eval()``/``train()``/``to()`` on the view (HFLM calls ``eval()``)
    leave the shared base alone; ``tie_weights()`` is a no-op (the base's weights are not the view's to tie).

    Args:
        model: the packed model.
        slot: the slot every row is routed to.
    """

    def __init__(self, model: PackedModel, slot: int) -> None:
        super().__init__()
        self._packed = [model]  # a list keeps the shared model out of nn.Module's registry
        self.slot = slot
        self.config = model.model.config
        self.generation_config = getattr(model.model, "generation_config", None)

    @property
    def device(self) -> torch.device:
        return self._packed[0].device

    @property
    def name_or_path(self) -> str:
        return str(getattr(self.config, "_name_or_path", ""))

    def tie_weights(self, *args: Any, **kwargs: Any) -> None:
        """No-op: the base model's weights are shared with every other slot."""

    def forward(self, input_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                **kwargs: Any) -> Any:
        """The base model's forward with every row on ``slot``; input_ids: (B, L)."""
        with self._routing():
            return self._packed[0].model(input_ids=input_ids, attention_mask=attention_mask, **kwargs)

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        """The base model's ``generate`` with every row of every step on ``slot``."""
        generate: Any = self._packed[0].model.generate  # transformers' GenerationMixin
        with self._routing():
            return generate(*args, **kwargs)

    @contextmanager
    def _routing(self) -> Iterator[None]:
        pm = self._packed[0]
        handle = pm.model.register_forward_pre_hook(self._set_layout, with_kwargs=True)
        try:
            yield
        finally:
            handle.remove()
            pm.state.layout = None

    def _set_layout(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        x = kwargs.get("input_ids")
        x = (args[0] if args else kwargs.get("inputs_embeds")) if x is None else x
        assert x is not None, "the base model was called without input_ids or inputs_embeds"
        self._packed[0].state.layout = slot_layout([self.slot], x.shape[0], x.shape[1])
