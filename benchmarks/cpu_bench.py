"""CPU benchmark: 8 adapters trained packed vs one after another (our engine with one slot, and PEFT).

A command, not a timed test: ``sweep bench --cpu``. It builds a tiny model (random init, fixed seed)
in a temporary directory, loads it back through ``from_pretrained`` and trains the same adapters on
the same batches three ways, after one warm-up run of each path. Every adapter sees its own data
stream, so the three ways do identical work per adapter.
"""

from __future__ import annotations

import platform
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from lora_sweep.benchmarks.baseline import make_optimizer, make_scheduler
from lora_sweep.benchmarks.timing import check_row, counted_params, gemm_tflops, step_flops
from lora_sweep.packer.data.batch import collate
from lora_sweep.packer.data.rows import Example, SlotStream, tokenize_rows
from lora_sweep.packer.model.load import load_base
from lora_sweep.packer.model.packed import PackedModel
from lora_sweep.packer.plan import AdapterSpec
from lora_sweep.packer.step.train import SlotJob, train
from lora_sweep.packer.tiny.data import arithmetic_rows
from lora_sweep.packer.tiny.models import build_tiny_model

__all__ = ["CpuBenchResult", "cpu_bench", "bench_specs", "environment"]


@dataclass(frozen=True)
class CpuBenchResult:
    """Wall-clock seconds of each way of training the same adapters."""

    adapters: int
    steps: int
    micro_batch: int
    repeats: int
    packed_s: float
    sequential_engine_s: float
    sequential_peft_s: float | None
    tokens: int
    environment: str

    def rows(self) -> list[dict]:
        """One row a way of training: its wall seconds and trained tokens/s."""
        ways = [("packed (1 run, N slots)", self.packed_s), ("sequential, engine 1 slot", self.sequential_engine_s)]
        if self.sequential_peft_s is not None:
            ways.append(("sequential, PEFT", self.sequential_peft_s))
        return [{"mode": name, "wall_s": secs, "tok_s": self.tokens / secs} for name, secs in ways]

    def table(self) -> str:
        lines = [f"{self.adapters} adapters x {self.steps} steps, micro-batch {self.micro_batch}, "
                 f"{self.tokens} trained tokens, median of {self.repeats} runs; {self.environment}",
                 f"{'mode':<28}{'wall s':>9}{'tokens/s':>11}{'packed speed-up':>17}"]
        for row in self.rows():
            lines.append(f"{row['mode']:<28}{row['wall_s']:>9.2f}{row['tok_s']:>11.0f}"
                         f"{row['wall_s'] / self.packed_s:>16.2f}x")
        return "\n".join(lines)


def bench_specs(n: int, steps: int, micro_batch: int = 1) -> list[AdapterSpec]:
    """A small sweep: ranks 4..32, several learning rates and target sets."""
    ranks, lrs = (4, 8, 16, 32), (1e-3, 3e-3, 1e-2)
    targets = (("q_proj", "v_proj"), ("all-linear",), ("q_proj", "k_proj", "v_proj", "o_proj"))
    return [AdapterSpec(rank=ranks[i % 4], alpha=2.0 * ranks[i % 4], lr=lrs[i % 3], targets=targets[i % 3],
                        micro_batch=micro_batch, max_steps=steps, seed=i) for i in range(n)]


def _streams(examples: list[Example], specs: list[AdapterSpec]) -> list[SlotStream]:
    return [SlotStream(examples, s.micro_batch, seed=s.seed) for s in specs]


def _engine(model_dir: Path, specs: list[AdapterSpec], examples: list[Example], capacity: int, pad: int) -> float:
    model, _ = load_base(str(model_dir))
    pm = PackedModel(model)
    queue = [SlotJob(s, st, key=i) for i, (s, st) in enumerate(zip(specs, _streams(examples, specs), strict=True))]
    t0 = time.perf_counter()
    train(pm, capacity, lambda slot: queue.pop(0) if queue else None, pad_id=pad)
    return time.perf_counter() - t0


def _peft(model_dir: Path, specs: list[AdapterSpec], examples: list[Example], pad: int) -> float:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    elapsed = 0.0
    for spec, stream in zip(specs, _streams(examples, specs), strict=True):
        base = AutoModelForCausalLM.from_pretrained(str(model_dir))
        targets = "all-linear" if "all-linear" in spec.targets else list(spec.targets)
        model = get_peft_model(base, LoraConfig(r=spec.rank, lora_alpha=spec.alpha, target_modules=targets))
        params = [p for p in model.parameters() if p.requires_grad]
        opt = make_optimizer(params, spec)
        sched = make_scheduler(opt, spec)
        t0 = time.perf_counter()
        for _ in range(spec.max_steps):
            b = collate([0], [stream.next_batch()], pad, dropout=[0.0], seeds=[0])
            model(input_ids=b.input_ids, attention_mask=b.attention_mask, labels=b.labels).loss.backward()
            torch.nn.utils.clip_grad_norm_(params, spec.max_grad_norm)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
        elapsed += time.perf_counter() - t0
    return elapsed


def _median(run: Callable[[], float], repeats: int) -> float:
    return statistics.median(run() for _ in range(repeats))


def cpu_bench(adapters: int = 8, steps: int = 30, *, micro_batch: int = 1, with_peft: bool = True,
              repeats: int = 3, progress: Callable[[str], None] = print) -> CpuBenchResult:
    """Train ``adapters`` adapters for ``steps`` steps packed and sequentially (median of ``repeats`` runs
    of each way, fresh adapters every run); returns the timings, each way's row checked (``timing.check_row``,
    against the CPU's fp32 GEMM rate)."""
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_tiny_model("llama", Path(tmp) / "tiny-llama", seed=0)
        model, tokenizer = load_base(str(model_dir))
        per_token = step_flops(model.config, counted_params(model), 1, 1)
        examples = tokenize_rows(arithmetic_rows(512, seed=0, fmt="prompt_completion"), "prompt_completion",
                                 tokenizer, max_length=64)
        pad = tokenizer.pad_token_id
        specs = bench_specs(adapters, steps, micro_batch)
        warm = bench_specs(2, 3)
        _engine(model_dir, warm, examples, 2, pad)  # warm-up: first-call allocations and kernel selection
        progress("packed ...")
        packed = _median(lambda: _engine(model_dir, specs, examples, adapters, pad), repeats)
        progress("sequential (engine, 1 slot) ...")
        seq_engine = _median(lambda: _engine(model_dir, specs, examples, 1, pad), repeats)
        seq_peft = None
        if with_peft:
            progress("sequential (PEFT) ...")
            _peft(model_dir, warm[:1], examples, pad)
            seq_peft = _median(lambda: _peft(model_dir, specs, examples, pad), repeats)
        tokens = _trained_tokens(examples, specs)
    result = CpuBenchResult(adapters, steps, micro_batch, repeats, packed, seq_engine, seq_peft, tokens, environment())
    for row in result.rows():
        check_row(row, f"cpu_bench {row['mode']}", flops_per_token=per_token, tflops=gemm_tflops("cpu"))
    return result


def environment() -> str:
    """CPU model, thread count and library versions, for BENCHMARKS.md."""
    import transformers

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    try:
        import peft

        peft_version = f", peft {peft.__version__}"
    except ImportError:
        peft_version = ""
    return (f"{cpu}, {torch.get_num_threads()} threads; torch {torch.__version__}, "
            f"transformers {transformers.__version__}{peft_version}")


def _trained_tokens(examples: list[Example], specs: list[AdapterSpec]) -> int:
    """Target tokens all adapters train on (same streams as the runs above)."""
    total = 0
    for stream, spec in zip(_streams(examples, specs), specs, strict=True):
        for _ in range(spec.max_steps):
            total += sum(sum(1 for t in ex.labels[1:] if t != -100) for ex in stream.next_batch())
    return total
