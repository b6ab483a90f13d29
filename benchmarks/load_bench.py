"""Where a base model's load goes: its parts one by one, then the whole load as it was against ``load_base``.

The parts, each ended by a device synchronisation: importing transformers' model and tokenizer classes, starting the
device's context, reading the config and building the module on the meta device (no memory, no initialisation;
the two import the model family's own modules, on first use),
reading the safetensors files onto the device (memory-mapped; the first read of a file not in the page cache is
the disk's), casting them to the dtype there, loading the tokenizer. Then, alternately ``--repeat`` times: the old
load (``from_pretrained`` onto the CPU in the dtype, then ``.to(device)``) and ``packer.model.load.load_base``
(straight onto the device, the tokenizer on a thread beside it), whose own split is printed. For the disk's rate,
drop the page cache first (``sync; echo 3 > /proc/sys/vm/drop_caches``, as root): the parts read the files first.

Run: ``python -m lora_sweep.benchmarks.load_bench MODEL_DIR [--dtype bfloat16] [--device cuda] [--repeat 3]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from lora_sweep.benchmarks.timing import check_row

__all__ = ["parts", "compare", "main"]


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def _time(device: str, fn: Callable[[], Any]) -> tuple[float, Any]:
    """``fn()``'s seconds up to a device synchronisation, and its result."""
    t0 = time.perf_counter()
    out = fn()
    _sync(device)
    return time.perf_counter() - t0, out


def parts(model_dir: Path, dtype: torch.dtype, device: str) -> dict[str, float]:
    """Seconds of each part of a load, one after another (the module docstring lists them); ``weights_gb``: the
    bytes read, in GB."""
    from safetensors.torch import load_file

    out: dict[str, float] = {}
    out["import_s"], _ = _time(device, lambda: __import__("transformers").AutoModelForCausalLM.__name__
                               + __import__("transformers").AutoTokenizer.__name__)
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    out["context_s"], _ = _time(device, lambda: torch.empty(1, device=device))
    out["config_s"], config = _time(device, lambda: AutoConfig.from_pretrained(model_dir))

    def build() -> torch.nn.Module:
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(config, dtype=dtype)

    out["build_s"], _ = _time(device, build)
    files = sorted(model_dir.glob("*.safetensors"))
    out["weights_s"], weights = _time(device, lambda: {k: v for f in files for k, v in
                                                       load_file(f, device=device).items()})
    out["weights_gb"] = sum(t.numel() * t.element_size() for t in weights.values()) / 1e9
    out["convert_s"], _ = _time(device, lambda: {k: v.to(dtype) for k, v in weights.items()})
    out["tokenizer_s"], _ = _time(device, lambda: AutoTokenizer.from_pretrained(model_dir))
    return out


def compare(model_dir: Path, dtype: str, device: str, repeat: int) -> dict[str, Any]:
    """Median seconds of the old load and of ``load_base`` (alternating, ``repeat`` each) and ``load_base``'s split
    (the medians of its parts)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from lora_sweep.packer.model.load import DTYPES, load_base

    def old() -> None:
        AutoModelForCausalLM.from_pretrained(model_dir, dtype=DTYPES[dtype]).to(device)
        AutoTokenizer.from_pretrained(model_dir)

    olds, news, splits = [], [], []
    for _ in range(repeat):
        olds.append(_time(device, old)[0])
        split: dict[str, float] = {}
        news.append(_time(device, lambda split=split: load_base(str(model_dir), dtype=dtype, device=device,
                                                                 split=split))[0])
        splits.append(split)
    return dict(old_load_s=statistics.median(olds), load_base_s=statistics.median(news),
                **{f"load_base_{k}_s": statistics.median(s[k] for s in splits) for k in splits[0]})


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(prog="python -m lora_sweep.benchmarks.load_bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model_dir", type=Path, help="a checkpoint directory (safetensors, config, tokenizer)")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--repeat", type=int, default=3, help="loads of each way, alternating (medians printed)")
    args = p.parse_args(argv)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    row = dict(model=str(args.model_dir), dtype=args.dtype, device=args.device,
               **parts(args.model_dir, getattr(torch, args.dtype), args.device),
               **compare(args.model_dir, args.dtype, args.device, args.repeat))
    row = {k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}
    check_row(row, "load_bench")
    print(json.dumps(row))
    width = max(map(len, row))
    for key, value in row.items():
        print(f"{key:<{width}}  {value}")
    return row


if __name__ == "__main__":
    main()
