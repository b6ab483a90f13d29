"""Per-slot cross-entropy: ``slot_losses`` from full logits (evaluation's per-adapter path), and chunked, without them.

The plain path computes ``(B, L, V)`` logits, then an fp32 copy for the cross-entropy; with a large
vocabulary (152k for Qwen2) that is the biggest activation of a step, and autograd keeps the fp32
log-softmax of every token for the backward. Here only the target tokens (those with a label: prompt
tokens and padding have none) get logits, a chunk of ``chunk_tokens`` at a time. The head is frozen,
so each chunk's gradient with respect to its hidden states is computed in the forward, while its
logits exist (Liger's fused linear cross-entropy, in plain PyTorch): ``(softmax - onehot) @ W`` is
kept, ``(T, H)`` like the hidden states it replaces, and the backward only scales its rows by the
upstream gradient. The logits are computed once, not again in the backward as a checkpointed chunk
would; logits memory is one ``chunk_tokens x V`` fp32 tensor, worked on in place, and its input-dtype
copy for the gradient matmul, instead of several ``B x L x V`` ones. A head that trains (never the
case in a pack) takes the checkpointed path.

Models that post-process logits after the head (Gemma-2's ``final_logit_softcapping``, Cohere's
``logit_scale``, Granite's ``logits_scaling``) are refused by ``check_plain_head``: their head output is
not their logits, so they train on the plain path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from lora_sweep.errors import ConfigError
from lora_sweep.kernels.ops import PackLayout
from lora_sweep.packer.data.batch import IGNORE_INDEX, row_slots

__all__ = ["DEFAULT_CHUNK_TOKENS", "slot_losses", "chunked_slot_losses", "check_plain_head", "output_head",
           "plain_output_head"]

DEFAULT_CHUNK_TOKENS = 4096
"""Tokens per chunk: 4096 x 152k x 4 B = 2.5 GB of fp32 logits at a time for a Qwen2-sized vocabulary."""



def slot_losses(logits: torch.Tensor, labels: torch.Tensor, layout: PackLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-slot mean next-token cross-entropy over target tokens.

    Args:
        logits: (B, L, V).
        labels: (B, L) unshifted labels, ``IGNORE_INDEX`` where no loss is taken.
        layout: row segments of the batch.

    Returns:
        (N,) float32 mean losses (0 for a slot without target tokens) and (N,) target-token counts.
    """
    b, seq, vocab = logits.shape
    shift_labels = labels[:, 1:]  # (B, L-1)
    ce = F.cross_entropy(logits[:, :-1].reshape(-1, vocab).float(), shift_labels.reshape(-1),
                         ignore_index=IGNORE_INDEX, reduction="none").view(b, seq - 1)
    seg = row_slots(layout, logits.device)
    n = len(layout.slots)
    sums = torch.zeros(n, dtype=torch.float32, device=logits.device).index_add(0, seg, ce.sum(dim=1))
    counts = torch.zeros(n, dtype=torch.float32, device=logits.device).index_add(
        0, seg, (shift_labels != IGNORE_INDEX).sum(1).float())
    return sums / counts.clamp(min=1.0), counts


# Config attributes that, when set, mean the logits are not the head's output (transformers' names).
_LOGIT_POSTPROCESSING = {"final_logit_softcapping": None, "logit_scale": 1.0, "logits_scaling": 1.0}


def check_plain_head(config: object) -> None:
    """Refuse models whose logits are not ``head(hidden)``.

    Args:
        config: the model's ``config`` (its text config is read where it has one).

    Raises:
        ConfigError: the config sets a known logit post-processing (soft-capping or scaling).
    """
    get_text = getattr(config, "get_text_config", None)
    text = get_text() if callable(get_text) else config
    for name, neutral in _LOGIT_POSTPROCESSING.items():
        value = getattr(text, name, neutral)
        if value is not None and value != neutral:
            raise ConfigError(f"chunked_ce: the model post-processes its logits ({name}={value}); "
                              "train it with chunked_ce off")


def output_head(model: nn.Module) -> nn.Module | None:
    """The model's output projection (transformers' ``get_output_embeddings()``), None where it has none.

    The one lookup of the head: the passes that must leave it alone (LoRA targets, NF4) and the ones that only read
    its size call this; the loss paths that compute logits from it call ``plain_output_head``.
    """
    get = getattr(model, "get_output_embeddings", None)
    return get() if callable(get) else None


def plain_output_head(model: nn.Module) -> nn.Module:
    """``output_head(model)``, checked to produce the logits unchanged (``check_plain_head``): what
    ``chunked_slot_losses`` may take the loss through.

    Raises:
        ConfigError: the model has no output head, or post-processes its logits (soft-capping, scaling).
    """
    head = output_head(model)
    if head is None:
        raise ConfigError(f"chunked_ce: {type(model).__name__} has no output head (get_output_embeddings)")
    check_plain_head(getattr(model, "config", None))
    return head


def _chunk_nll(head: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """x: (C, H) hidden states, y: (C,) targets -> (C,) fp32 negative log-likelihoods."""
    logits = head(x).float()  # (C, V), upcast as the plain path does
    return F.cross_entropy(logits, y, reduction="none")


class _FusedLinearCE(torch.autograd.Function):
    """Per-token NLL of ``F.linear(x, weight, bias)`` with its input gradient computed in the forward.

    forward(x (T, H), weight (V, H), bias (V,) | None, y (T,), chunk) -> (T,) fp32 NLL. The gradient of
    token t's NLL is ``(softmax_t - onehot(y_t)) @ W``: kept (T, H) in x's dtype; the backward multiplies
    row t by the upstream gradient of NLL_t (in fp32, then rounds once). ``weight`` and ``bias`` get none.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, y: torch.Tensor,
                chunk: int) -> torch.Tensor:
        nll = x.new_empty(len(y), dtype=torch.float32)
        grad = torch.empty_like(x) if ctx.needs_input_grad[0] else None
        probs: torch.Tensor | None = None
        for i in range(0, len(y), chunk):
            yc = y[i:i + chunk]
            logits = F.linear(x[i:i + chunk], weight, bias).float()  # (C, V), upcast as the plain path does
            target = logits.gather(1, yc[:, None]).squeeze(1)  # (C,)
            top = logits.amax(dim=-1)  # (C,)
            # exp(logits - max) in place: torch.logsumexp would allocate another (C, V) fp32 temporary
            probs = logits.sub_(top[:, None]).exp_()
            total = probs.sum(dim=-1)  # (C,)
            nll[i:i + chunk] = top + total.log() - target
            if grad is not None:
                probs.div_(total[:, None])  # softmax
                probs[torch.arange(len(yc), device=y.device), yc] -= 1.0
                torch.mm(probs.to(x.dtype), weight, out=grad[i:i + chunk])  # (C, H)
            logits = probs = None  # freed before the next chunk's are made: one chunk's logits at a time, not two
        ctx.save_for_backward(grad)
        return nll

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> tuple[torch.Tensor | None, None, None, None, None]:
        (grad,) = ctx.saved_tensors
        if grad is None:
            return None, None, None, None, None
        return (grad.float() * g[:, None]).to(grad.dtype), None, None, None, None


def _token_nll(head: nn.Module, x: torch.Tensor, y: torch.Tensor, chunk_tokens: int) -> torch.Tensor:
    """(T,) fp32 NLL of targets ``y`` (T,) under ``head`` applied to ``x`` (T, H), a chunk at a time."""
    weight, bias = getattr(head, "weight", None), getattr(head, "bias", None)
    frozen = isinstance(head, nn.Linear) and not weight.requires_grad and (bias is None or not bias.requires_grad)
    if frozen and len(y) > 0:
        return _FusedLinearCE.apply(x, weight, bias, y, chunk_tokens)
    pieces = [checkpoint(_chunk_nll, head, x[i:i + chunk_tokens], y[i:i + chunk_tokens], use_reentrant=False)
              for i in range(0, len(y), chunk_tokens)]
    # No target token at all: an empty tensor that is still in the graph, so backward() works as on the plain path.
    return torch.cat(pieces) if pieces else x.float().sum(dim=-1)


def chunked_slot_losses(hidden: torch.Tensor, head: nn.Module, labels: torch.Tensor, layout: PackLayout, *,
                        chunk_tokens: int = DEFAULT_CHUNK_TOKENS) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-slot mean next-token cross-entropy over target tokens, from the final hidden states.

    Equal to ``slot_losses(head(hidden), labels, layout)`` up to float summation order.

    Args:
        hidden: (B, L, H) final hidden states (after the last norm).
        head: the output projection, ``model.get_output_embeddings()``; must not be LoRA-adapted.
        labels: (B, L) unshifted labels, ``IGNORE_INDEX`` where no loss is taken.
        layout: row segments of the batch.
        chunk_tokens: target tokens per chunk.

    Returns:
        (N,) float32 mean losses (0 for a slot without target tokens) and (N,) target-token counts.
    """
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1 (got {chunk_tokens})")
    n = len(layout.slots)
    shift_labels = labels[:, 1:]  # (B, L-1): position t predicts token t+1
    rows, pos = (shift_labels != IGNORE_INDEX).nonzero(as_tuple=True)  # (T,) each
    x = hidden[:, :-1][rows, pos]  # (T, H): target positions only
    y = shift_labels[rows, pos]  # (T,)
    row_slot = row_slots(layout, hidden.device)  # (B,)
    nll = _token_nll(head, x, y, chunk_tokens)  # (T,)
    seg = row_slot[rows]  # (T,)
    sums = torch.zeros(n, device=hidden.device).index_add(0, seg, nll)
    counts = torch.bincount(seg, minlength=n).float()  # (N,)
    return sums / counts.clamp(min=1.0), counts
