"""W3 of the GPU benchmark: the makespan of a fixed sweep, packed vs one-at-a-time PEFT vs PEFT processes.

A fixed, seeded sweep of ``N`` LoRA configurations (``benchmarks.makespan_sweep``; default 24: ranks
{8, 16, 32, 64} x micro-batch {1, 2} x 3 learning rates drawn log-uniform in [2e-5, 4e-4]; alpha = 2 r, all seven
projections, dropout 0) trains for ``S`` steps each on fixed random token ids, three ways, each timed end to end
(wall clock from the first load of the base to the last adapter saved; that is what a user pays):

- ``packed``: the base loaded once, every configuration a slot of one ``packer.step.train.train`` run
  (``--slots`` caps the slots; freed slots are backfilled), each adapter saved as it ends. Its line
  splits the makespan into load, first step (which compiles the Triton kernels when the machine's
  cache lacks them), later steps and saves. ``packed-warm`` runs it again at once: kernels compiled,
  as in every sweep after the first on a machine. PEFT lines give their ratio to both.
- ``peft-sequential``: what users run today, one trial after another in one process: load the base,
  ``peft.get_peft_model``, AdamW, ``S`` steps, ``save_pretrained``.
- ``peft-4proc``: ``--procs`` such processes sharing the GPU, each running its share of the
  configurations one after another; timed from launching the first process to the last exiting.

The base is a random init of a real architecture's shape (``benchmarks.shapes.SHAPES``; throughput
does not depend on weight values) saved with ``save_pretrained`` first, so every path pays
``from_pretrained`` from disk. Before the clocks, the process runs the base once (forward, backward,
an AdamW step): kernels every mode uses load then, not in the first mode's time.
``--sequential-sample K`` / ``--procs-sample K`` (or ``--sample K`` for both) time only K
configurations, evenly spaced, and estimate the others from the measured one of the same (rank,
micro-batch) cell, else of the same micro-batch; the line's ``makespan_basis`` says so. One JSON line
per mode, the packed one first, so a later timeout still leaves it.

Run: ``python -m lora_sweep.benchmarks.gpu_makespan`` (H200), ``python -m lora_sweep.benchmarks.gpu_makespan --tiny
--device cpu``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from lora_sweep.benchmarks.baseline import make_optimizer
from lora_sweep.benchmarks.makespan_sweep import SweepConfig, extrapolate, sample_indices, sweep_configs
from lora_sweep.benchmarks.shapes import PROJ, SHAPES, build_shape
from lora_sweep.benchmarks.timing import check_row, timed_steps
from lora_sweep.packer.data.rows import Example
from lora_sweep.packer.model.checkpoint import save_adapters
from lora_sweep.packer.model.load import DTYPES
from lora_sweep.packer.model.packed import PackedModel
from lora_sweep.packer.step.train import FixedBatch, SlotJob

__all__ = ["Setup", "MODES", "save_base", "run_packed", "run_sequential", "run_procs", "makespan", "main"]

MODES = ("packed", "packed-warm", "peft-sequential", "peft-4proc")
"""``packed`` runs first in the process: its first step compiles the Triton kernels unless the machine's
cache already holds them. ``packed-warm`` repeats it at once, with the kernels compiled (as every sweep
after the first on a machine runs)."""
TINY_HIDDEN = 128
"""Tiny-mode width: its k/v projections (2 KV heads x 32) are 64 wide, so rank 64 still fits."""


@dataclass(frozen=True)
class Setup:
    """What every mode shares: the saved base, the run length and where it runs."""

    model_dir: str
    vocab: int
    steps: int
    seq: int
    device: str
    dtype: str
    """A key of ``packer.model.load.DTYPES``."""


def save_base(shape: str, out_dir: Path, *, device: str, dtype: str, tiny: bool = False) -> tuple[Path, int]:
    """Random-init a model of ``shape`` (or a tiny Qwen2) and save it; returns (its directory, vocab size)."""
    from transformers import AutoConfig

    if tiny:
        from lora_sweep.packer.tiny.models import build_tiny_model

        build_tiny_model("qwen2", out_dir, seed=0, hidden_size=TINY_HIDDEN)
        return out_dir, AutoConfig.from_pretrained(out_dir).vocab_size
    model = build_shape(shape, device=device, dtype=DTYPES[dtype])
    model.save_pretrained(out_dir)
    vocab = model.config.vocab_size
    del model
    _free(device)
    return out_dir, vocab


def _load(setup: Setup) -> torch.nn.Module:
    """The base as a user's job loads it: from disk, SDPA attention, onto the device."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # a bar per load would bury the JSON lines
    model = AutoModelForCausalLM.from_pretrained(setup.model_dir, dtype=DTYPES[setup.dtype],
                                                 attn_implementation="sdpa")
    return model.to(setup.device)


def _free(device: str) -> None:
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _reset_peak(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()


def _peak_gib(device: str) -> dict[str, float]:
    return {"peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2)} if device.startswith("cuda") else {}


def _tokens(configs: Sequence[SweepConfig], setup: Setup) -> int:
    """Target tokens of the sweep: labels are the inputs, shifted by one inside the loss."""
    return sum(setup.steps * c.micro_batch * (setup.seq - 1) for c in configs)


def _line(mode: str, setup: Setup, configs: Sequence[SweepConfig], span: float, tokens: int, **extra: object) -> dict:
    return dict(workload="W3", mode=mode, configs=len(configs), steps=setup.steps, seq=setup.seq, device=setup.device,
                makespan_s=round(span, 3), tokens=tokens, tok_s=round(tokens / span, 1), **extra)


def _basis(n_measured: int, n: int) -> str:
    return "measured" if n_measured == n else f"extrapolated from {n_measured} of {n}"


def run_packed(setup: Setup, configs: Sequence[SweepConfig], out: Path, slots: int | None = None,
               mode: str = "packed") -> dict:
    """Train every configuration packed in one run; adapters saved to ``out/config-<index>``."""
    _reset_peak(setup.device)
    t0 = time.perf_counter()
    pm = PackedModel(_load(setup), impl="auto")
    loaded = time.perf_counter()
    queue = []
    for c in configs:
        rows = [Example(tuple(r), tuple(r)) for r in c.token_ids(setup.seq, setup.vocab).tolist()]
        queue.append(SlotJob(c.spec(setup.steps), FixedBatch(rows), key=c.index))
    saves: list[tuple[float, float]] = []  # (start, seconds) of each batch of saves

    def save(ends: list) -> None:
        t = time.perf_counter()
        save_adapters(pm, [(e.slot, out / f"config-{e.job.key}", None) for e in ends],
                      base_model_name_or_path=setup.model_dir)
        saves.append((t, time.perf_counter() - t))

    capacity = min(slots or len(configs), len(configs))
    timed = timed_steps(pm, lambda _slot: queue.pop(0) if queue else None, capacity, on_end=save, chunked_ce=True)
    span = time.perf_counter() - t0  # the last save copied its weights to the host: the device is done
    result = timed.result
    # Where the makespan went: the first step carries the kernels' compile (cold cache) and allocations
    phases: dict[str, float | None] = dict(load_s=round(loaded - t0, 2), save_s=round(sum(d for _, d in saves), 2))
    if timed.seconds:
        between = sum(d for t, d in saves if t < timed.at[-1])  # saves of slots that ended before the last step
        phases.update(first_step_s=round(timed.seconds[0], 2), later_steps_s=round(sum(timed.seconds[1:]) - between, 2))
    return _line(mode, setup, configs, span, result.tokens, slots=capacity, global_steps=result.steps,
                 **phases, **_peak_gib(setup.device))


def train_peft(setup: Setup, config: SweepConfig, out: Path) -> float:
    """One trial as users run it: load, wrap with PEFT, ``steps`` AdamW steps, save; returns its seconds."""
    from peft import LoraConfig, get_peft_model

    t0 = time.perf_counter()
    torch.manual_seed(config.index)  # PEFT draws A's init from the global generator
    lora = LoraConfig(r=config.rank, lora_alpha=2 * config.rank, target_modules=list(PROJ), lora_dropout=0.0)
    model = get_peft_model(_load(setup), lora)
    opt = make_optimizer([p for p in model.parameters() if p.requires_grad], config.spec(setup.steps))
    ids = config.token_ids(setup.seq, setup.vocab).to(setup.device)
    for _ in range(setup.steps):
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    model.save_pretrained(out / f"config-{config.index}")
    _sync(setup.device)
    del model, opt
    gc.collect()  # the next trial's load must not find this one's weights still held
    return time.perf_counter() - t0


def run_sequential(setup: Setup, configs: Sequence[SweepConfig], out: Path, sample: int = 0) -> dict:
    """One trial after another in this process (``sample`` > 0: only that many, the rest extrapolated)."""
    import peft  # noqa: F401  (once per process, before the clock: the packed mode's imports are not timed either)

    chosen = [configs[i] for i in sample_indices(len(configs), sample)]
    _reset_peak(setup.device)
    t0 = time.perf_counter()
    measured = {c.index: train_peft(setup, c, out) for c in chosen}
    wall = time.perf_counter() - t0
    seconds, how = extrapolate(configs, measured)
    span = wall if len(chosen) == len(configs) else sum(seconds.values())
    return _line("peft-sequential", setup, configs, span, _tokens(configs, setup),
                 makespan_basis=_basis(len(chosen), len(configs)), estimated_by=how, measured_s=round(wall, 3),
                 **_peak_gib(setup.device))


def _share_samples(shares: list[list[SweepConfig]], n: int, sample: int) -> list[list[SweepConfig]]:
    """The configurations each process really runs: all, or its part of ``sample`` (at least one)."""
    if sample <= 0 or sample >= n:
        return shares
    return [[s[i] for i in sample_indices(len(s), max(1, round(sample * len(s) / n)))] for s in shares]


def run_procs(setup: Setup, configs: Sequence[SweepConfig], out: Path, work: Path, procs: int = 4,
              sample: int = 0) -> dict:
    """``procs`` PEFT processes on one device, configurations dealt round-robin, each run sequentially.

    With ``sample``, each process runs only its part of the sample; every configuration's seconds
    (measured under the same contention) are extrapolated, and each process's finish is estimated as
    its start-up (launch to first trial) plus its whole share.
    """
    shares = [list(configs[p::procs]) for p in range(procs)]
    runs = _share_samples(shares, len(configs), sample)
    children = []
    launched, t0 = time.time(), time.perf_counter()
    for p, run in enumerate(runs):
        job = work / f"proc-{p}.json"
        job.write_text(json.dumps(dict(setup=asdict(setup), configs=[asdict(c) for c in run], out=str(out),
                                       threads=max(1, (os.cpu_count() or 1) // procs))))
        children.append(subprocess.Popen([sys.executable, "-m", "lora_sweep.benchmarks.gpu_makespan", "--child",
                                          str(job)], stdout=subprocess.DEVNULL))
    codes = [child.wait() for child in children]
    wall = time.perf_counter() - t0
    if any(codes):
        raise RuntimeError(f"peft-4proc ({procs} processes): child exit codes {codes} (their stderr is above)")
    reports = [json.loads((work / f"proc-{p}.result.json").read_text()) for p in range(len(runs))]
    measured = {int(i): s for r in reports for i, s in r["seconds"].items()}
    seconds, how = extrapolate(configs, measured)
    if len(measured) == len(configs):
        span = wall
    else:
        span = max(r["begin"] - launched + sum(seconds[c.index] for c in share) for r, share in zip(reports, shares,
                                                                                                   strict=True))
    peaks = [r["peak_gib"] for r in reports if "peak_gib" in r]
    return _line("peft-4proc", setup, configs, span, _tokens(configs, setup), procs=procs,
                 makespan_basis=_basis(len(measured), len(configs)), estimated_by=how, measured_s=round(wall, 3),
                 **({"peak_gib_sum": round(sum(peaks), 2)} if peaks else {}))


def _child(job_file: str) -> None:
    """A ``run_procs`` process: train its configurations one after another, write their seconds beside the job."""
    job = json.loads(Path(job_file).read_text())
    setup = Setup(**job["setup"])
    _start_up(setup, job["threads"])
    begin = time.time()  # launch -> begin: the start-up every user's process pays, once
    seconds = {c["index"]: train_peft(setup, SweepConfig(**c), Path(job["out"])) for c in job["configs"]}
    result = dict(begin=begin, seconds=seconds, **_peak_gib(setup.device))
    Path(job_file).with_suffix(".result.json").write_text(json.dumps(result))


def _start_up(setup: Setup, threads: int) -> None:
    """A process's one-time costs, paid before its first trial's clock: the imports (peft, the model's
    module), the CUDA context. Left in the first trial, a sampled run would extrapolate them to every
    configuration it does not run."""
    import peft  # noqa: F401
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    if setup.device == "cpu":
        torch.set_num_threads(threads)  # processes sharing the cores, as a user would set them
    MODEL_FOR_CAUSAL_LM_MAPPING[type(AutoConfig.from_pretrained(setup.model_dir))]  # imports the model's module
    _warm(setup.device)


def _warm_model(setup: Setup, config: SweepConfig) -> None:
    """One forward and backward of the base (HF's loss, W3's row length) and one step of the PEFT path's
    optimizer, before any clock runs. They load the kernels every mode shares (the model's layers,
    attention, the loss, AdamW) and start autograd's device thread: one-time costs of this process that
    the first mode (packed) would otherwise pay alone, and the PEFT modes, which run after it, never did.
    What only the packed path runs (its Triton kernels, chunked loss, per-slot optimizer) stays in its
    first step."""
    model = _load(setup)
    model.requires_grad_(False)  # a frozen base, as both paths train it: activation gradients only
    model.enable_input_require_grads()
    ids = config.token_ids(setup.seq, setup.vocab).to(setup.device)
    model(input_ids=ids, labels=ids).loss.backward()
    param = torch.nn.Parameter(torch.zeros(16, device=setup.device))
    param.grad = torch.ones_like(param)
    make_optimizer([param], config.spec(setup.steps)).step()
    _sync(setup.device)
    del model, param
    _free(setup.device)


def _warm(device: str) -> None:
    """Create a ``run_procs`` child's CUDA context and cuBLAS handle before its first trial (the main
    process warms up with ``_warm_model``, which does this and more)."""
    if device.startswith("cuda"):
        a = torch.ones(64, 64, device=device, dtype=torch.bfloat16)
        (a @ a).sum().item()


def makespan(shape: str = "qwen2.5-0.5b", *, n_configs: int = 24, steps: int = 20, seq: int = 512,
             slots: int | None = None, procs: int = 4, sequential_sample: int = 0, procs_sample: int = 0,
             device: str | None = None, tiny: bool = False, modes: Sequence[str] = MODES,
             workdir: str | Path | None = None, emit: Callable[[dict], None] | None = None) -> list[dict]:
    """Run W3: the sweep's makespan in each of ``modes``, packed first; returns the lines it emitted.

    Args:
        shape: a key of ``benchmarks.shapes.SHAPES`` (ignored with ``tiny``).
        n_configs: configurations in the sweep (W3 proper: >= 24).
        steps: optimizer steps per configuration.
        seq: tokens per row.
        slots: cap on the packed run's slots (default: one per configuration).
        procs: processes of the ``peft-4proc`` mode (the workload's name; its line's ``procs`` is the count).
        sequential_sample: configurations the sequential mode really trains (0: all).
        procs_sample: configurations the processes really train, over all of them (0: all).
        device: ``cuda`` or ``cpu`` (default: cuda when available); bf16 on CUDA, fp32 on the CPU.
        tiny: a tiny Qwen2 (``packer.tiny.models``) instead of ``shape``, for CPU tests.
        modes: which of ``MODES`` to run.
        workdir: where the base, the adapters (``adapters/<mode>/config-<i>``) and the process files go;
            default a temporary directory removed at the end.
        emit: receives each line as it is measured (default: printed as JSON, flushed).
    """
    if min(n_configs, steps, procs) < 1 or seq < 2:
        raise ValueError(f"need configs, steps, procs >= 1 and seq >= 2 (got {n_configs}, {steps}, {procs}, {seq})")
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = "bfloat16" if device.startswith("cuda") else "float32"
    emit = emit or (lambda line: print(json.dumps(line), flush=True))
    configs = sweep_configs(n_configs)
    with tempfile.TemporaryDirectory(prefix="w3-") as tmp:
        work = Path(workdir) if workdir is not None else Path(tmp)
        model_dir, vocab = save_base(shape, work / "base", device=device, dtype=dtype, tiny=tiny)
        setup = Setup(str(model_dir), vocab, steps, seq, device, dtype)
        _warm_model(setup, configs[0])
        # The base checkpoint written just above is the harness's input, not a mode's work: flush it now. Else the
        # packed mode's first adapter fsync pays for it (ext4's ordered journal writes every dirty data block with
        # the commit an fsync forces), while PEFT, which saves without fsync, never does.
        os.sync()
        runs: dict[str, Callable[[Path], dict]] = {
            "packed": lambda out: run_packed(setup, configs, out, slots),
            "packed-warm": lambda out: run_packed(setup, configs, out, slots, mode="packed-warm"),
            "peft-sequential": lambda out: run_sequential(setup, configs, out, sequential_sample),
            "peft-4proc": lambda out: run_procs(setup, configs, out, work, procs, procs_sample),
        }
        lines: list[dict] = []
        for mode in (m for m in MODES if m in modes):
            line = dict(shape="tiny-qwen2" if tiny else shape, **runs[mode](work / "adapters" / mode))
            if not mode.startswith("packed"):
                for ref in (r for r in lines if r["mode"].startswith("packed")):
                    key = "ratio_vs_" + ref["mode"].replace("-", "_")
                    line[key] = round(line["makespan_s"] / ref["makespan_s"], 2)
            lines.append(check_row(line, f"W3 {mode}"))
            emit(line)
            _free(device)  # this mode's model and cached blocks must not crowd the next one
    return lines


def _args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m lora_sweep.benchmarks.gpu_makespan", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="qwen2.5-0.5b", choices=sorted(SHAPES))
    p.add_argument("--tiny", action="store_true", help="a tiny random Qwen2 instead of --shape (CPU tests)")
    p.add_argument("--configs", type=int, default=24, help="configurations in the sweep (W3: >= 24)")
    p.add_argument("--steps", type=int, default=20, help="optimizer steps per configuration")
    p.add_argument("--seq", type=int, default=512, help="tokens per row")
    p.add_argument("--slots", type=int, default=None, help="cap on the packed run's slots (default: all)")
    p.add_argument("--procs", type=int, default=4, help="PEFT processes sharing the device")
    p.add_argument("--sample", type=int, default=0, help="default of both sample options below")
    p.add_argument("--sequential-sample", type=int, default=None, help="configs the sequential mode trains")
    p.add_argument("--procs-sample", type=int, default=None, help="configs the processes train, in all")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated subset of {','.join(MODES)}")
    p.add_argument("--workdir", default=None, help="keep the base and adapters here (default: a temp dir)")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    unknown = set(args.modes.split(",")) - set(MODES)
    if unknown:
        p.error(f"--modes: unknown {', '.join(sorted(unknown))}; choose from {', '.join(MODES)}")
    return args


def main(argv: list[str] | None = None) -> list[dict]:
    args = _args(argv)
    if args.child is not None:
        _child(args.child)
        return []
    seq_sample = args.sample if args.sequential_sample is None else args.sequential_sample
    procs_sample = args.sample if args.procs_sample is None else args.procs_sample
    return makespan(args.shape, n_configs=args.configs, steps=args.steps, seq=args.seq, slots=args.slots,
                    procs=args.procs, sequential_sample=seq_sample, procs_sample=procs_sample, device=args.device,
                    tiny=args.tiny, modes=args.modes.split(","), workdir=args.workdir)


if __name__ == "__main__":
    main()
