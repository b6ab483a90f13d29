"""The memory the optimizer step in the backward saves, on the CPU: ``python -m lora_sweep.benchmarks.optim_bwd_bench``.

A random-init model of SmolLM2-135M's shape (fp32, ``--layers`` decoder layers) trains a pack of ``--slots``
rank-``--rank`` adapters on all seven projections for ``--steps`` steps, once with the whole-gradient step and
once with ``optimizer_in_backward``, neither clipping. Peak memory is what tensors hold, counted exactly by the
planner's CPU probe (``packer.probe.peak_memory``: a dispatch mode adding up every storage); the adapters' gradient
buffers are the slots' flat gradients. Then the planner calibrates its memory model both ways (``packer.probe
.calibrate``) and the bytes per adapter parameter it measures are printed beside the 16 B / 12 B floors.
"""

from __future__ import annotations

import argparse
import json
import platform

import torch

from lora_sweep.benchmarks.shapes import PROJ, SMOLLM2
from lora_sweep.packer.data import Example
from lora_sweep.packer.model import PackedModel
from lora_sweep.packer.plan import AdapterSpec
from lora_sweep.packer.probe import calibrate, model_bytes, peak_memory
from lora_sweep.packer.train import FixedBatch, SlotJob, train


def _model(layers: int) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    kw = dict(SMOLLM2, num_hidden_layers=layers)
    cfg = AutoConfig.for_model(kw.pop("model_type"), **kw)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)


def measure(pm: PackedModel, *, slots: int, rank: int, micro: int, seq: int, steps: int, in_backward: bool) -> dict:
    """Peak tensor bytes of one run of the pack, and the largest adapter-gradient buffers it kept."""
    gen = torch.Generator().manual_seed(0)
    vocab = pm.model.config.vocab_size
    jobs = []
    for i in range(slots):
        ids = torch.randint(3, vocab, (micro, seq), generator=gen).tolist()
        spec = AdapterSpec(rank=rank, alpha=2 * rank, targets=PROJ, micro_batch=micro, max_steps=steps, seed=i,
                           lr=1e-4, max_grad_norm=None)
        jobs.append(SlotJob(spec, FixedBatch([Example(tuple(r), tuple(r)) for r in ids]), key=i))
    grad_bytes, params = [0], [0]

    def on_step(reports: list) -> None:  # noqa: ANN001
        held = sum(g.numel() * g.element_size() for _, g in pm.flat.values() if g is not None)
        grad_bytes[0] = max(grad_bytes[0], held)
        params[0] = sum(w.numel() for w, _ in pm.flat.values())

    peak = peak_memory(lambda: train(pm, slots, lambda s: jobs.pop(0) if jobs else None, pad_id=0, on_step=on_step,
                                     static_shapes=False, optimizer_in_backward=in_backward), pm)
    return {"peak_mib": round(peak / 2**20, 1), "grad_buffers_mib": round(grad_bytes[0] / 2**20, 1),
            "adapter_params": params[0]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--slots", type=int, default=4)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--micro", type=int, default=1)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--no-plan", action="store_true", help="skip the planner's calibrations")
    args = ap.parse_args()
    torch.set_num_threads(2)
    pm = PackedModel(_model(args.layers), impl="torch")
    rows = {}
    for in_backward in (False, True):
        measure(pm, slots=args.slots, rank=args.rank, micro=args.micro, seq=args.seq, steps=1,
                in_backward=in_backward)  # warm-up
        rows[in_backward] = measure(pm, slots=args.slots, rank=args.rank, micro=args.micro, seq=args.seq,
                                    steps=args.steps, in_backward=in_backward)
    plan = {}
    if not args.no_plan:
        for in_backward in (False, True):
            mm = calibrate(pm, args.seq, rows=(1, 3), optimizer_in_backward=in_backward)
            plan[in_backward] = round(mm.bytes_per_param, 2)
    base, off, on = model_bytes(pm) / 2**20, rows[False], rows[True]
    params = off["adapter_params"]
    print(json.dumps({"torch": torch.__version__, "python": platform.python_version(), "args": vars(args),
                      "adapter_params": params, "base_mib": round(base, 1), "off": off, "on": on,
                      "bytes_per_param": plan}))
    print("| option | peak MiB | over the base | adapter grad buffers MiB | planner B/param |\n|---|---|---|---|---|")
    for name, key in (("whole-gradient step", False), ("optimizer_in_backward", True)):
        r = rows[key]
        print(f"| {name} | {r['peak_mib']} | {round(r['peak_mib'] - base, 1)} | {r['grad_buffers_mib']} | "
              f"{plan.get(key, '-')} |")
    print(f"saved: {round(off['peak_mib'] - on['peak_mib'], 1)} MiB of {off['peak_mib']} "
          f"({100 * (off['peak_mib'] - on['peak_mib']) / off['peak_mib']:.1f}%); "
          f"adapter gradients in fp32: {round(params * 4 / 2**20, 1)} MiB")


if __name__ == "__main__":
    main()
