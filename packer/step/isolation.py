"""Sample packing's one assumption, checked on the model in hand: a packed row's examples do not see each other.

``packer.data.packing`` puts several examples in one row with positions restarting at each, and relies on
transformers to read the boundaries from those positions and build a block-diagonal causal mask
(``masking_utils.find_packed_sequence_indices``). Whether a family's modeling code hands its positions to the
mask depends on the transformers release: in 5.23 Falcon's does not (eager and SDPA), and each example of a
packed row then attends to the examples before it. Nothing fails: the loss is plausible
and wrong. ``VERIFIED_FAMILIES`` names the families tested with the transformers CI installs; this check asks
the installed one, once per model, before a slot trains on packed rows.

The check: three rows of two examples each, the same second example after the first example A, then B, then
A again. With the mask block-diagonal, the second example's logits are the same in the first two rows: the rows
differ only where the mask hides them. Where it attends across, they differ by the other example's influence
(0.36 of the logits' scale on Falcon's tiny model). Rows 1 and 3 hold the same tokens: what they differ by is
what the row's place in the batch changes (kernels may tile rows differently; 0 on the CPU), the noise floor
the first difference is judged against.
"""

from __future__ import annotations

import weakref

import torch
from torch import nn

from lora_sweep.errors import ConfigError
from lora_sweep.packer.data.batch import collate
from lora_sweep.packer.data.packing import check_family, pack_rows
from lora_sweep.packer.data.rows import Example
from lora_sweep.packer.model.packed import PackedModel

__all__ = ["check_sample_packing", "cross_example_change"]

TOKENS = 8
"""Tokens of each example of the probe rows."""
TOLERANCE = 1e-3
"""A change of the second example's logits, relative to their largest magnitude, that counts as none."""
NOISE_FACTOR = 4.0
"""How far past the noise floor (the same row at another place in the batch) a change may go."""

_checked: weakref.WeakKeyDictionary[nn.Module, tuple[float, float]] = weakref.WeakKeyDictionary()


def cross_example_change(pm: PackedModel) -> tuple[float, float]:
    """How much a packed row's second example's logits change with the first example's tokens, and how much
    they change with the row's place in the batch alone: each the largest absolute change over the largest
    absolute logit (0 and 0: isolated, on exact kernels). The base alone (no slot's adapter), without
    gradients, on the model's device."""
    vocab = pm.model.get_input_embeddings().num_embeddings
    gen = torch.Generator().manual_seed(0)
    first_a, first_b, second = (torch.randint(vocab, (TOKENS,), generator=gen).tolist() for _ in range(3))
    rows = [pack_rows([_example(first), _example(second)], 2 * TOKENS) for first in (first_a, first_b, first_a)]
    assert all(len(r) == 1 and r[0].n_examples == 2 for r in rows)
    batch = collate([0, 1, 2], rows, pad_id=0, dropout=[0.0] * 3, seeds=[0] * 3, device=pm.device)
    with torch.no_grad():
        logits = pm.forward(batch.input_ids, batch.attention_mask, None, batch.position_ids)[:, TOKENS:].float()
    scale = logits.abs().max().clamp(min=1e-30)
    return ((logits[0] - logits[1]).abs().max() / scale).item(), ((logits[0] - logits[2]).abs().max() / scale).item()


def check_sample_packing(pm: PackedModel) -> None:
    """Refuse sample packing on this model: its family is not verified (``packer.data.packing.check_family``), or the
    installed transformers lets a packed row's examples attend to each other (checked once per model): the second
    example's logits change with the first's tokens by more than ``TOLERANCE`` and more than ``NOISE_FACTOR``
    times the noise floor.

    Raises:
        ConfigError: either.
    """
    check_family(getattr(pm.model, "config", None))
    if pm.model not in _checked:
        _checked[pm.model] = cross_example_change(pm)
    change, noise = _checked[pm.model]
    if change > max(TOLERANCE, NOISE_FACTOR * noise):
        import transformers

        config = pm.model.config
        family = getattr(config, "model_type", type(pm.model).__name__)
        attn = getattr(config, "_attn_implementation", "")
        raise ConfigError(f"sample_packing: with transformers {transformers.__version__}, {family} ({attn} attention) "
                          f"lets a packed row's examples attend to each other (the logits change by {change:.2g} of "
                          f"their scale); set sample_packing: false or install another transformers")


def _example(ids: list[int]) -> Example:
    return Example(input_ids=tuple(ids), labels=tuple(ids))
