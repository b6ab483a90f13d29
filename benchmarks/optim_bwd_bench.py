"""What ``optimizer_in_backward`` would save on the CPU: ``python -m lora_sweep.benchmarks.optim_bwd_bench``.

The option is mapped onto the one training step, which keeps its preallocated fp32 gradient buffer
(``packer.model.store.SlotStore.grad``: C slots x the rank bucket's rows of every adapted projection) and steps after
the
backward. The memory a step in the backward would save is at most that buffer. A random-init model of
SmolLM2-135M's shape (fp32, ``--layers`` decoder layers) trains a pack of ``--slots`` rank-``--rank`` adapters on all
seven projections for ``--steps`` steps; the peak is what tensors hold, counted exactly by the planner's CPU probe
(``packer.probe.peak_memory``: a dispatch mode adding up every storage), and the gradient buffer is read from the
pack's store. Printed: both, the buffer's share of the peak over the base, and the adapters' own fp32 gradient
bytes (the buffer without the rank bucket's padding rows).
"""

from __future__ import annotations

import argparse
import json
import platform

import torch

from lora_sweep.benchmarks.shapes import PROJ, SMOLLM2
from lora_sweep.packer.data.rows import Example
from lora_sweep.packer.model.packed import PackedModel
from lora_sweep.packer.plan import AdapterSpec
from lora_sweep.packer.probe import model_bytes, peak_memory
from lora_sweep.packer.step.train import FixedBatch, SlotJob, train


def _model(layers: int) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    kw = dict(SMOLLM2, num_hidden_layers=layers)
    cfg = AutoConfig.for_model(kw.pop("model_type"), **kw)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)


def measure(pm: PackedModel, *, slots: int, rank: int, micro: int, seq: int, steps: int) -> dict:
    """Peak tensor bytes of one run of the pack, its store's gradient buffer and the adapters' parameters."""
    gen = torch.Generator().manual_seed(0)
    vocab = pm.model.config.vocab_size
    jobs = []
    for i in range(slots):
        ids = torch.randint(3, vocab, (micro, seq), generator=gen).tolist()
        spec = AdapterSpec(rank=rank, alpha=2 * rank, targets=PROJ, micro_batch=micro, max_steps=steps, seed=i,
                           lr=1e-4, max_grad_norm=None)
        jobs.append(SlotJob(spec, FixedBatch([Example(tuple(r), tuple(r)) for r in ids]), key=i))
    seen = {"grad_bytes": 0, "params": 0}

    def on_step(reports: list) -> None:  # noqa: ANN001
        store = pm.store
        seen["grad_bytes"] = store.grad.numel() * store.grad.element_size()
        seen["params"] = sum(p.numel() for r in reports for p in pm.slot_parameters(r.slot))

    peak = peak_memory(lambda: train(pm, slots, lambda s: jobs.pop(0) if jobs else None, pad_id=0, on_step=on_step,
                                     readback_every=1), pm)
    return {"peak_mib": round(peak / 2**20, 1), "grad_buffer_mib": round(seen["grad_bytes"] / 2**20, 1),
            "adapter_params": seen["params"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--slots", type=int, default=4)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--micro", type=int, default=1)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--steps", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(2)
    pm = PackedModel(_model(args.layers), impl="torch")
    measure(pm, slots=args.slots, rank=args.rank, micro=args.micro, seq=args.seq, steps=1)  # warm-up
    row = measure(pm, slots=args.slots, rank=args.rank, micro=args.micro, seq=args.seq, steps=args.steps)
    base = model_bytes(pm) / 2**20
    over = row["peak_mib"] - base
    print(json.dumps({"torch": torch.__version__, "python": platform.python_version(), "args": vars(args),
                      "base_mib": round(base, 1), **row}))
    print(f"peak {row['peak_mib']} MiB ({round(over, 1)} over the base); gradient buffer {row['grad_buffer_mib']} MiB "
          f"({100 * row['grad_buffer_mib'] / over:.1f}% of the peak over the base): at most what optimizer_in_backward "
          f"would save; the adapters' own fp32 gradients: {round(row['adapter_params'] * 4 / 2**20, 1)} MiB")


if __name__ == "__main__":
    main()
