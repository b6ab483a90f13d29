"""Plain-PyTorch packed LoRA: the CPU path and the oracle the Triton kernels are tested against.

Math, for token t of slot g with A_g: (r_g, D_in), B_g: (D_out, r_g), scale s_g, dropout p_g:

    y_t = base(x_t) + s_g * B_g A_g drop_g(x_t)

where drop_g multiplies by a Bernoulli(1 - p_g) mask / (1 - p_g). The base sees the undropped x; only
the LoRA path sees the mask (the rule PEFT follows). Gradients come from autograd.

Shapes: B rows, L positions, T = B * L tokens, N slots, R = sum of ranks, D_in / D_out features.
Packed weights: ``a_cat`` (R, D_in) stacks every slot's A rows; ``bt_cat`` (R, D_out) stacks B_g^T
with the same row order (slots in ``PackLayout.slots`` order, rank-0 slots contributing no rows).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

from lora_sweep.kernels.meta import LayerRanks, PackLayout, dropout_seed

__all__ = ["lora_loop", "lora_masked_dense", "dora_loop", "dora_norm", "dropout_keep_mask", "rms_norm", "silu_mul",
           "rope", "linear_ce"]


def dropout_keep_mask(layout: PackLayout, g: int, layer_id: int, d_in: int, seq_len: int,
                      device: torch.device) -> torch.Tensor:
    """Keep-mask already divided by (1 - p) for segment g, padded to ``seq_len`` with ones.

    Returns:
        (n_rows[g], seq_len, d_in) float32 tensor.
    """
    n, own, p = layout.n_rows[g], layout.own_len[g], layout.dropout[g]
    gen = torch.Generator(device=device)
    gen.manual_seed(dropout_seed(layout.seed[g], 0, layer_id))
    keep = torch.rand((n, own, d_in), generator=gen, device=device) >= p  # (n, own, D_in)
    mask = keep.to(torch.float32) / (1.0 - p)
    if seq_len > own:  # padding positions: no loss and never attended to, any value works
        mask = torch.cat([mask, mask.new_ones((n, seq_len - own, d_in))], dim=1)
    return mask


def lora_loop(x: torch.Tensor, base_out: torch.Tensor, a_cat: torch.Tensor, bt_cat: torch.Tensor,
              layout: PackLayout, ranks: LayerRanks) -> torch.Tensor:
    """Per-slot Python loop; the obviously correct version.

    Args:
        x: (B, L, D_in) layer input.
        base_out: (B, L, D_out) frozen base layer output.
        a_cat: (R, D_in) packed A.
        bt_cat: (R, D_out) packed B^T.
        layout: row segments of the batch.
        ranks: this layer's ranks and scales.

    Returns:
        (B, L, D_out) base_out plus every slot's LoRA term on its own rows.
    """
    pieces, off = [], 0
    for g, (r0, n) in enumerate(zip(layout.row_start, layout.n_rows, strict=True)):
        r, s = ranks.rank[g], ranks.scale[g]
        rows = x[r0:r0 + n]  # (n, L, D_in)
        if r == 0 or n == 0:
            pieces.append(base_out.new_zeros((n, *base_out.shape[1:])))
            off += r
            continue
        rows = rows.to(a_cat.dtype)
        if layout.dropout[g] > 0:
            rows = rows * dropout_keep_mask(layout, g, ranks.layer_id, x.shape[-1], x.shape[1], x.device)
        h = rows @ a_cat[off:off + r].T  # (n, L, r)
        pieces.append(((h @ bt_cat[off:off + r]) * s).to(base_out.dtype))  # (n, L, D_out)
        off += r
    return base_out + torch.cat(pieces, dim=0)


def lora_masked_dense(x: torch.Tensor, base_out: torch.Tensor, a_cat: torch.Tensor, bt_cat: torch.Tensor,
                      layout: PackLayout, ranks: LayerRanks) -> torch.Tensor:
    """All slots in three GEMM-sized ops: ``H = drop(x) A_cat^T``, masked to each token's own slot
    columns and scaled there, then ``y = base + H Bt_cat``.

    Exact (masked entries are multiplied by 0) at N times the tiny LoRA FLOPs, and a constant
    number of kernel launches whatever N is, which is what makes it the fast CPU path.
    Same arguments and result as ``lora_loop``.
    """
    b, seq, d_in = x.shape
    xin = x.to(a_cat.dtype)
    if any(p > 0 for p in layout.dropout):
        masks = [dropout_keep_mask(layout, g, ranks.layer_id, d_in, seq, x.device) if layout.dropout[g] > 0
                 else xin.new_ones((n, seq, d_in)) for g, n in enumerate(layout.n_rows)]
        xin = xin * torch.cat(masks, dim=0)
    col_scale = _row_column_scale(layout.row_start, layout.n_rows, ranks.rank, ranks.scale, x.device,
                                  a_cat.dtype)  # (B, 1, R)
    h = (xin @ a_cat.T) * col_scale  # (B, L, R)
    return base_out + (h @ bt_cat).to(base_out.dtype)


def dora_norm(weight: torch.Tensor, a: torch.Tensor, bt: torch.Tensor, scale: float) -> torch.Tensor:
    """DoRA's row norm ``||W + s B A||`` over D_in without forming the (D_out, D_in) sum: the square expands to
    ``||W_i||^2 + 2 s B_i . (W A^T)_i + s^2 B_i (A A^T) B_i^T``, O(D_out D_in r) like a LoRA pass of D_out tokens.

    Args:
        weight: (D_out, D_in) frozen base weight.
        a: (r, D_in) A; bt: (r, D_out) B^T.
        scale: s.

    Returns:
        (D_out,) in ``a``'s dtype, detached (DoRA's section 4.3: the norm is a constant of the step).
    """
    with torch.no_grad():
        w = weight.to(a.dtype)
        b = bt.T  # (D_out, r)
        sq = w.square().sum(dim=1) + 2 * scale * (b * (w @ a.T)).sum(dim=1) + scale ** 2 * ((b @ (a @ a.T)) * b).sum(1)
        return sq.clamp(min=0).sqrt()


def dora_loop(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, a_cat: torch.Tensor,
              bt_cat: torch.Tensor, magnitude: Sequence[torch.Tensor | None], layout: PackLayout,
              ranks: LayerRanks) -> torch.Tensor:
    """A frozen linear layer plus every slot's DoRA term, slot by slot (PEFT's ``DoraLinearLayer.forward``).

    For token t of slot g, with d = the slot's dropout (identity at p = 0), m_g its magnitude and
    n_g = ``||W + s_g B_g A_g||`` per output row (computed directly here, detached):

        y_t = W x_t + b + (m_g / n_g - 1) * W d(x_t) + (m_g / n_g) * s_g B_g A_g d(x_t)

    (at p = 0: ``b + (m_g / n_g) (W + s_g B_g A_g) x_t``). A slot of rank 0 adds nothing; a slot without a
    magnitude is a plain LoRA slot (``lora_loop``'s term).

    Args:
        x: (B, L, D_in) layer input.
        weight: (D_out, D_in) base weight; bias: (D_out,) or None.
        a_cat, bt_cat, layout, ranks: as ``lora_loop``.
        magnitude: per slot in ``layout.slots`` order, its (D_out,) magnitude, or None for a plain LoRA slot.

    Returns:
        (B, L, D_out); differentiable in x, a_cat, bt_cat and magnitude.
    """
    base_out = torch.nn.functional.linear(x, weight, bias)
    pieces, off = [], 0
    for g, (r0, n) in enumerate(zip(layout.row_start, layout.n_rows, strict=True)):
        r, s = ranks.rank[g], ranks.scale[g]
        if r == 0 or n == 0:
            pieces.append(base_out.new_zeros((n, *base_out.shape[1:])))
            off += r
            continue
        a, bt = a_cat[off:off + r], bt_cat[off:off + r]
        w = weight.to(a.dtype)
        rows = x[r0:r0 + n].to(a.dtype)  # (n, L, D_in)
        if layout.dropout[g] > 0:
            rows = rows * dropout_keep_mask(layout, g, ranks.layer_id, x.shape[-1], x.shape[1], x.device)
        lora = (rows @ a.T) @ bt * s  # (n, L, D_out)
        m = magnitude[g]
        if m is None:
            pieces.append(lora.to(base_out.dtype))
        else:
            norm = torch.linalg.norm(w + s * (bt.T @ a).detach(), dim=1).detach()  # (D_out,)
            ratio = m / norm  # (D_out,)
            pieces.append(((ratio - 1) * torch.nn.functional.linear(rows, w) + ratio * lora).to(base_out.dtype))
        off += r
    return base_out + torch.cat(pieces, dim=0)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' ``LlamaRMSNorm.forward``, the oracle of ``kernels.ops.rms_norm``: x (..., D), weight (D,)
    -> (..., D) in ``promote(weight, x)`` dtype. The mean square in fp32, the normalised value rounded to x's
    dtype before the weight multiplies it."""
    xf = x.to(torch.float32)
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up``, the gated MLP's middle as transformers' Llama / Qwen2 MLP computes it."""
    return torch.nn.functional.silu(gate) * up


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    """(..., d) -> (..., d): ``cat(-x[..., d/2:], x[..., :d/2])``, transformers' ``rotate_half``."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' ``apply_rotary_pos_emb`` (Llama / Qwen2 / Mistral / Qwen3, ``unsqueeze_dim=1``), the oracle of
    ``kernels.ops.rope``: q (B, H, L, d), k (B, Hk, L, d), cos / sin (B or 1, L, d) -> rotated q and k."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def linear_ce(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor,
                     capacity: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-slot mean cross-entropy of ``F.linear(hidden, weight, bias)``, the oracle of
    ``kernels.ops.linear_ce``: fp32 logits and torch's ``F.cross_entropy``, autograd for the gradients.

    Args:
        hidden: (T, H) hidden states; slot g owns rows ``g * T / C`` to ``(g + 1) * T / C``.
        weight: (V, H) output head; bias: (V,) or None.
        targets: (T,) int64 next tokens, -100 (torch's ``ignore_index``) where a row has no loss.
        capacity: C, slots; T is a multiple of it.

    Returns:
        (C,) fp32 mean losses (0 for a slot without targets) and (C,) fp32 target counts.
    """
    logits = torch.nn.functional.linear(hidden, weight, bias).float()  # (T, V)
    nll = torch.nn.functional.cross_entropy(logits, targets, reduction="none")  # (T,), 0 where ignored
    counts = (targets != -100).view(capacity, -1).sum(dim=1).float()
    return nll.view(capacity, -1).sum(dim=1) / counts.clamp(min=1.0), counts


@functools.lru_cache(maxsize=64)
def _row_column_scale(row_start: tuple[int, ...], n_rows: tuple[int, ...], rank: tuple[int, ...],
                      scale: tuple[float, ...], device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """(B, 1, R) matrix: s_g on row-block g x rank-columns of g, 0 elsewhere.

    Cached: every layer with the same ranks shares it, and it only changes when the pack does.
    Read-only for its users (autograd saves it; nothing writes to it).
    """
    m = torch.zeros((sum(n_rows), 1, sum(rank)), dtype=dtype)
    off = 0
    for r0, n, r, s in zip(row_start, n_rows, rank, scale, strict=True):
        m[r0:r0 + n, :, off:off + r] = s
        off += r
    return m.to(device)
