"""What a fixed-shape held-out evaluation holds on the GPU per logit: the measurement
``packer.step.eval_graph.heldout_fits`` budgets by.

A captured held-out forward (``packer.step.eval_graph.row_losses``) keeps its peak memory in its graph pool for the
pack's
life. Most of it is logits-sized: on the Triton path the fused loss head keeps the bf16 logits of each row group; the
torch path (``kernels: torch``, or no Triton) keeps the model's bf16 logits, an fp32 copy and cross-entropy's fp32
intermediates. This builds a pack of ``--slots`` slots on SmolLM2's shape (random init, bf16; vocab 49,152)
and, for each path and each (rows per slot, sequence length), runs the evaluation once (precompile, warm-up,
capture, replay) and prints the peak allocated above the pack's own memory, per logit (C x rows x L x vocab).

Run: ``python -m lora_sweep.benchmarks.eval_memory`` (CUDA only).
"""

from __future__ import annotations

import argparse
import json

import torch

from lora_sweep.benchmarks.shapes import SMOLLM2

__all__ = ["measure"]

SHAPES = ((4, 64), (8, 64), (8, 128), (16, 128))
"""(rows per slot, sequence length) of the held-out chunks measured."""


def _pack(impl: str, slots: int):  # type: ignore[no-untyped-def]
    """A PackedModel on SmolLM2's shape with a slot store of ``slots`` slots (rank bucket 16) and one slot live."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from lora_sweep.packer.model.packed import PackedModel
    from lora_sweep.packer.plan import AdapterSpec

    kw = dict(SMOLLM2)
    cfg = AutoConfig.for_model(kw.pop("model_type"), **kw)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    pm = PackedModel(model, impl=impl)  # type: ignore[arg-type]
    pm.ensure_store(slots, rank=8, bucket=16)  # the bf16 operand copy too, on the Triton path
    pm.add_slot(0, AdapterSpec(rank=8, alpha=16, targets=("all-linear",), seed=0))
    return pm


def measure(impl: str, slots: int, shapes: tuple[tuple[int, int], ...] = SHAPES) -> list[dict]:
    """Peak bytes above the pack's memory, per logit, of one held-out evaluation per shape (a fresh pack each)."""
    from lora_sweep.packer.data.rows import Example
    from lora_sweep.packer.step.eval_graph import row_losses

    rows_out = []
    for rows, seq in shapes:
        pm = _pack(impl, slots)
        gen = torch.Generator().manual_seed(rows * seq)
        ids = torch.randint(3, SMOLLM2["vocab_size"], (rows, seq), generator=gen).tolist()
        chunk = [Example(tuple(row), tuple(row)) for row in ids]
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        row_losses(pm, [0], chunk, rows, seq, pad_id=0)
        torch.cuda.synchronize()
        peak, kept = torch.cuda.max_memory_allocated() - base, torch.cuda.memory_allocated() - base
        logits = slots * rows * seq * SMOLLM2["vocab_size"]
        rows_out.append({"impl": impl, "slots": slots, "rows": rows, "seq_len": seq, "logits": logits,
                         "peak_bytes_per_logit": round(peak / logits, 2),
                         "kept_bytes_per_logit": round(kept / logits, 2)})
        del pm
        torch.cuda.empty_cache()
    return rows_out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--slots", type=int, default=16)
    parser.add_argument("--impl", nargs="+", default=["triton", "torch"], choices=["triton", "torch"])
    args = parser.parse_args()
    rows = [r for impl in args.impl for r in measure(impl, args.slots)]
    for r in rows:
        print(json.dumps(r))
    print(f"{'impl':7} {'rows':>4} {'seq':>4} {'logits':>12} {'peak B/logit':>13} {'kept B/logit':>13}")
    for r in rows:
        print(f"{r['impl']:7} {r['rows']:4d} {r['seq_len']:4d} {r['logits']:12,d} {r['peak_bytes_per_logit']:13.2f} "
              f"{r['kept_bytes_per_logit']:13.2f}")


if __name__ == "__main__":
    main()
