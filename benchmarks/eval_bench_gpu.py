"""GPU benchmark: a sweep's evaluations of a 16-slot SmolLM2-135M-shaped pack, batched on its fixed shapes.

It builds a random-init model of SmolLM2-135M's shape (``benchmarks.shapes.SMOLLM2``, bf16), a pack of ``--slots``
slots with random non-zero adapters of mixed ranks, and random-token held-out items (``--items``, 16..48 tokens, the
demo's ``max_length``) and prompts (12..40 tokens). It then runs, as a sweep does, one evaluation per group of
trials that finish together (``--groups``: held-out loss and greedy generation of ``--new-tokens`` tokens, both
batched as ``evaluators.heldout_loss`` / ``evaluators.generation`` run them on CUDA) and one held-out-loss evaluation
per group reaching a rung (``--rung-groups``), each group a different set of slots. The whole sequence runs twice:
cold (the first in the process: kernel compile, graph capture) and warm. Each pass prints its seconds (the finished
trials' evaluations, the rungs'), the forwards it ran and the graphs the pack holds: one per shape, whatever the slot
sets, so the warm pass captures nothing.

Run (CUDA): ``python -m lora_sweep.benchmarks.eval_bench_gpu`` (the hidden study's size: 48 finished trials of a
16-slot pack, 80 items, 12 new tokens). ``--device cpu --layers 2`` runs it eagerly as a smoke test.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from typing import Any

import torch

from lora_sweep.benchmarks.shapes import PROJ, SMOLLM2
from lora_sweep.benchmarks.timing import check_row
from lora_sweep.evaluators.generation import generate_ids
from lora_sweep.packer.data.batch import IGNORE_INDEX
from lora_sweep.packer.data.rows import Example
from lora_sweep.packer.model.packed import PackedModel
from lora_sweep.packer.plan import AdapterSpec
from lora_sweep.packer.step import eval_graph

__all__ = ["build_pack", "random_items", "run_pass"]

GROUPS = (16, 8, 8, 4, 4, 2, 2, 1, 1, 1, 1)
"""Sizes of the groups of trials finishing together: 48 trials (the hidden study's count)."""
RUNG_GROUPS = (16, 16, 16)
"""Sizes of the groups reaching a rung: every trial scored once on the held-out loss."""
RANKS = (2, 4, 8, 16)


def build_pack(slots: int, device: str, layers: int | None) -> PackedModel:
    """A PackedModel of SmolLM2's shape (``layers`` decoder layers if given) with ``slots`` live slots, each with random
    non-zero A and B (rank cycling through ``RANKS``; every other slot adapts the attention projections only)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    kw = dict(SMOLLM2, **({"num_hidden_layers": layers} if layers else {}))
    cfg = AutoConfig.for_model(kw.pop("model_type"), **kw)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16 if device == "cuda" else torch.float32)
    pm = PackedModel(model)
    pm.ensure_store(slots, rank=max(RANKS))
    gen = torch.Generator().manual_seed(1)
    for slot in range(slots):
        rank = RANKS[slot % len(RANKS)]
        targets = PROJ if slot % 2 == 0 else PROJ[:4]
        pm.add_slot(slot, AdapterSpec(rank=rank, alpha=2.0 * rank, targets=targets, seed=slot))
        with torch.no_grad():
            for a, b in pm.slot_weights(slot).values():
                a.copy_(torch.randn(a.shape, generator=gen) / a.shape[1] ** 0.5)
                b.copy_(torch.randn(b.shape, generator=gen) * 0.02)
    return pm


def random_items(n: int, vocab: int, seed: int = 0) -> tuple[list[Example], list[list[int]]]:
    """``n`` held-out examples (16..48 tokens, the loss on the last third) and ``n`` prompts (12..40 tokens)."""
    gen = torch.Generator().manual_seed(seed)
    examples, prompts = [], []
    for _ in range(n):
        length = int(torch.randint(16, 49, (1,), generator=gen))
        ids = torch.randint(3, vocab, (length,), generator=gen).tolist()
        cut = 2 * length // 3
        examples.append(Example(tuple(ids), tuple([IGNORE_INDEX] * cut + ids[cut:])))
        plen = int(torch.randint(12, 41, (1,), generator=gen))
        prompts.append(torch.randint(3, vocab, (plen,), generator=gen).tolist())
    return examples, prompts


def _slot_sets(sizes: tuple[int, ...], slots: int) -> list[list[int]]:
    """One slot set per group, each starting where the last ended (so consecutive sets differ)."""
    sets, start = [], 0
    for size in sizes:
        sets.append(sorted((start + k) % slots for k in range(min(size, slots))))
        start += size
    return sets


def _forwards() -> tuple[list[int], Callable[[], None]]:
    """Count the forwards of every batched evaluation (the lengths of ``eval_graph.plan``); returns the counts and the
    call that restores ``plan``."""
    counts: list[int] = []
    real = eval_graph.plan

    def counted(*args: Any, **kwargs: Any) -> list:
        out = real(*args, **kwargs)
        counts.append(len(out))
        return out

    eval_graph.plan = counted  # type: ignore[assignment]
    return counts, lambda: setattr(eval_graph, "plan", real)


def run_pass(pm: PackedModel, examples: list[Example], prompts: list[list[int]], groups: tuple[int, ...],
             rung_groups: tuple[int, ...], new_tokens: int, batch_size: int) -> dict:
    """One pass of the sweep's evaluations; returns its seconds (ends: held-out + generation; rungs), the forwards and
    the graphs (made, captured) after it."""
    seq = eval_graph.bucket(max(len(e.input_ids) for e in examples))
    width = eval_graph.bucket(max(len(p) for p in prompts))
    slots = pm.store.capacity if pm.store is not None else 0
    assert eval_graph.heldout_fits(pm, batch_size, seq) and eval_graph.generation_fits(pm, width, new_tokens)
    counts, restore = _forwards()
    split = {"heldout_s": 0.0, "generation_s": 0.0, "rung_s": 0.0}

    def timed(key: str, fn: Callable[[], object]) -> None:
        _sync(pm)
        t0 = time.perf_counter()
        fn()
        _sync(pm)
        split[key] += time.perf_counter() - t0

    try:
        for group in _slot_sets(rung_groups, slots):
            timed("rung_s", lambda g=group: eval_graph.row_losses(pm, g, examples, batch_size, seq, 0))
        for group in _slot_sets(groups, slots):
            timed("heldout_s", lambda g=group: eval_graph.row_losses(pm, g, examples, batch_size, seq, 0))
            timed("generation_s", lambda g=group: generate_ids(pm, g, prompts, eos_id=None, pad_id=0,
                                                               max_new_tokens=new_tokens, batch_size=batch_size,
                                                               batched=True))
    finally:
        restore()
    made, captured = eval_graph.graphs(pm)
    return {**split, "ends_s": split["heldout_s"] + split["generation_s"], "forwards": sum(counts),
            "graphs": made, "captured": captured}


def _sync(pm: PackedModel) -> None:
    if pm.device.type == "cuda":
        torch.cuda.synchronize()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--slots", type=int, default=16)
    parser.add_argument("--items", type=int, default=80)
    parser.add_argument("--new-tokens", type=int, default=12)
    parser.add_argument("--batch-size", type=int, default=8, help="rows per segment (the evaluators' batch_size)")
    parser.add_argument("--groups", default=",".join(map(str, GROUPS)), help="sizes of the groups finishing together")
    parser.add_argument("--rung-groups", default=",".join(map(str, RUNG_GROUPS)), help="'' for none")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--layers", type=int, default=None, help="decoder layers (default: SmolLM2's 30)")
    args = parser.parse_args()
    groups = tuple(int(g) for g in args.groups.split(",") if g)
    rung_groups = tuple(int(g) for g in args.rung_groups.split(",") if g)
    pm = build_pack(args.slots, args.device, args.layers)
    examples, prompts = random_items(args.items, SMOLLM2["vocab_size"])
    print(f"{args.slots} slots, {sum(groups)} finished trials in {len(groups)} groups, {args.items} items, "
          f"{args.new_tokens} new tokens, batch_size {args.batch_size}, {args.device}"
          f"{' ' + torch.cuda.get_device_name() if args.device == 'cuda' else ''}")
    print(f"{'pass':6}{'ends s':>8}{'held-out s':>12}{'generation s':>14}{'rungs s':>9}{'forwards':>10}"
          f"{'graphs':>8}{'captured':>10}")
    for name in ("cold", "warm"):
        row = run_pass(pm, examples, prompts, groups, rung_groups, args.new_tokens, args.batch_size)
        check_row({"wall_s": row["ends_s"]}, f"eval_bench_gpu {name}")
        print(f"{name:6}{row['ends_s']:8.2f}{row['heldout_s']:12.2f}{row['generation_s']:14.2f}{row['rung_s']:9.2f}"
              f"{row['forwards']:10d}{row['graphs']:8d}{row['captured']:10d}")
        print(json.dumps({"pass": name, **{k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}}))


if __name__ == "__main__":
    main()
