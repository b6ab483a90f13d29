"""Damaged input files, at random: study files, training and held-out rows, GGUF checkpoints and checkpoint
directories, for the invariant that every input file, however hostile, loads or ends in one ``UserError`` line
within a bound.

The seeded tests take a sample (tests/sweep/test_hostile_input.py, tests/packer/data/test_data.py,
tests/evaluators/test_generation.py, tests/packer/model/test_gguf.py, tests/packer/model/test_load.py); the command
runs as long as it is given and reports what breaks the invariant::

    python -m tests.damage study --seconds 300 --seed 1
    python -m tests.damage rows --seconds 300
    python -m tests.damage eval --seconds 300
    python -m tests.damage gguf --seconds 300 --bound 30
    python -m tests.damage model --seconds 300

A finding is any other exception (its type and the line that raised it, once per kind), a ``UserError`` over
several lines (but a foreign config's list of refusals), or a case over ``--bound`` seconds. Each finding's file is
kept in the work folder, whose path is printed; the command exits 1 when there is one, 0 when there is none.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import itertools
import json
import logging
import os
import random
import resource
import shutil
import signal
import struct
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
STUDIES = [*sorted((ROOT / "studies").glob("*.yaml")), ROOT / "tests/sweep/data/torchtune-1B-lora.yaml"]
"""The example studies and a torchtune config: the files the study cases damage."""

Case = tuple[Path, Callable[[], object]]
"""A damaged file and the reading of it."""

_ATOMS = [None, -1, 0, 2.5, 1e309, True, "", "x", "1e-4", "nan", [], {}, [1, 2], {"a": 1}, [[1]],
          {"low": 1, "high": 0}, {"min": 0, "max": 1}, {"values": [1, None]}, "all-linear", "a" * 300, "rows\x00.jsonl",
          "~no-such-user-here/x", "x.py:f", "a:b:c", "maximize a b", "x <= y", 2**63, {"_component_": "x.y"}, "1h30m",
          {"name": "custom", "options": {"function": "~no-such-user-here/m.py:f"}}, [None], ["q_proj", 3]]
_KEYS = ["rank", "lr", "alpha", "alpha_ratio", "targets", "dropout", "max_steps", "epochs", "method", "metric",
         "run_cap", "parameters", "search", "train", "data", "model", "budget", "pack", "pruning", "sampler",
         "objectives", "constraints", "evaluators", "trackers", "baseline", "lora_r", "learning_rate", "sequence_len",
         "base_model", "datasets", "adapter", "val_set_size", "lora_target_linear", "eval_every", "seed", "output",
         "name", "values", "low", "high", "log", "step", "trials", "path", "eval", "format", "options", "tokenizer",
         "checkpointer", "dataset", "lora_attn_modules", "optimizer"]
_ROW_ATOMS = [None, 0, -1, 1.5, True, "", "x", "\ud800", "a" * 5000, [], {}, [1], {"role": "user"}, {"content": 3},
              [{"role": "user", "content": "x"}], [{"role": "assistant", "content": None}],
              [{"role": "tool", "content": "x"}], {"a": {"b": {"c": 1}}}, "<s>", "</s>", "<pad>", "\x00", 10**40]
_ROW_KEYS = ["prompt", "completion", "text", "messages", "instruction", "input", "output", "conversations", "role",
             "content", "from", "value", "system"]
_BROKEN_LINES = ["{", "[1,", '"x"', "null", "\ufeff{}", "{} {}", "NaN"]


def damage(node: object, rng: random.Random, atoms: list = _ATOMS, keys: list[str] = _KEYS) -> object:
    """``node`` (parsed YAML or JSON) with one random change somewhere: a value replaced by one of ``atoms``, a key
    removed or one of ``keys`` added, a list item changed."""
    if isinstance(node, dict) and node:
        key, r = rng.choice(list(node)), rng.random()
        if r < 0.25:
            node[key] = copy.deepcopy(rng.choice(atoms))
        elif r < 0.35:
            del node[key]
        elif r < 0.5:
            node[rng.choice(keys)] = copy.deepcopy(rng.choice(atoms))
        else:
            node[key] = damage(node[key], rng, atoms, keys)
        return node
    if isinstance(node, list) and node:
        i = rng.randrange(len(node))
        node[i] = damage(node[i], rng, atoms, keys) if rng.random() < 0.6 else copy.deepcopy(rng.choice(atoms))
        return node
    return copy.deepcopy(rng.choice(atoms))


def _damaged_rows(rows: list[dict], rng: random.Random, most: int, atoms: list, keys: list[str]) -> list[object]:
    """1 to ``most`` copies of ``rows``' rows, 1 to 3 times one of them damaged (``damage``)."""
    batch: list[object] = [copy.deepcopy(rng.choice(rows)) for _ in range(rng.randint(1, most))]
    for _ in range(rng.randint(1, 3)):
        at = rng.randrange(len(batch))
        batch[at] = damage(batch[at], rng, atoms, keys)
    return batch


def study_cases(folder: Path, rng: random.Random, sources: list[Path] = STUDIES) -> Iterator[Case]:
    """Damaged copies of ``sources`` in ``folder`` (their data and model paths pointing into it), each read by
    ``load_study``, a third of them with a damaged ``key=value`` override. Run from ``folder``: an Axolotl split under
    a name the study refuses is written under ``runs/`` of the working directory."""
    from lora_sweep.sweep.config.loader import load_study

    shutil.copytree(ROOT / "studies" / "data", folder / "data", dirs_exist_ok=True)
    (folder / "model").mkdir(exist_ok=True)
    originals = [yaml.safe_load(p.read_text().replace("BASE_MODEL", str(folder / "model"))
                                .replace("DATA", "data/arith-train.jsonl")) for p in sources]
    for i in itertools.count():
        damaged = rng.choice(originals)
        for _ in range(rng.randint(1, 4)):
            damaged = damage(copy.deepcopy(damaged), rng)
        path = folder / f"damaged-{i}.yaml"
        path.write_text(yaml.safe_dump(damaged, sort_keys=False, allow_unicode=True))
        value = yaml.safe_dump(rng.choice(_ATOMS), default_flow_style=True).strip().removesuffix("...").strip()
        overrides = [f"{rng.choice(_KEYS)}.{rng.choice(_KEYS)}={value}"] if rng.random() < 0.3 else []
        yield path, lambda path=path, overrides=overrides: load_study(path, overrides)


def rows_cases(folder: Path, rng: random.Random) -> Iterator[Case]:
    """Damaged JSON-lines files of every row format (the example data and one row of each format), each read by
    ``load_examples`` with a random format, length bound and prompt masking, under a tokenizer with a chat template
    and one without."""
    from lora_sweep.packer.data.rows import FORMATS, load_examples
    from tests.helpers import CHAT_TEMPLATE, CONVERSATION, build_tokenizer

    tokenizers = [build_tokenizer(CHAT_TEMPLATE), build_tokenizer(None)]
    rows = [json.loads(line) for p in sorted((ROOT / "studies" / "data").glob("*.jsonl"))
            for line in p.read_text().splitlines()[:20] if line.strip()]
    rows += [{"messages": CONVERSATION}, {"text": "hello"}, {"instruction": "a", "input": "b", "output": "c"},
             {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]}]
    for i in itertools.count():
        batch = _damaged_rows(rows, rng, 4, _ROW_ATOMS, _ROW_KEYS)
        lines = [json.dumps(row, ensure_ascii=rng.random() < 0.5) for row in batch]
        if rng.random() < 0.1:
            lines.append(rng.choice(_BROKEN_LINES))
        path = folder / f"damaged-{i}.jsonl"
        path.write_text("\n".join(lines) + "\n", encoding="utf-8", errors="surrogatepass")
        options = {"fmt": rng.choice(["auto", *FORMATS]), "max_length": rng.choice([1, 2, 8, 64, 512]),
                   "train_on_prompt": rng.random() < 0.3}
        tok = rng.choice(tokenizers)
        yield path, lambda path=path, tok=tok, options=options: load_examples(path, tok, **options)


def eval_cases(folder: Path, rng: random.Random) -> Iterator[Case]:
    """Damaged held-out files, multiple-choice rows among them, each read as an evaluator reads its data:
    ``load_eval_data`` under a random format, then a generation evaluator's prompts and references."""
    from lora_sweep.evaluators._core import MC_FORMAT, load_eval_data
    from lora_sweep.evaluators.generation import build_prompts, references
    from tests.helpers import CHAT_TEMPLATE, CONVERSATION, build_tokenizer

    tokenizers = [build_tokenizer(CHAT_TEMPLATE), build_tokenizer(None)]
    rows = [{"messages": CONVERSATION}, {"prompt": "a", "completion": "b"}, {"instruction": "a", "input": "b",
            "output": "c"}, {"prompt": "2 + 2 =", "choices": ["4", "5"], "label": 0}, {"text": "hello"}]
    atoms, keys = [*_ROW_ATOMS, ["a"], 5, "0"], [*_ROW_KEYS, "choices", "label"]

    def read(path: Path, tok: object, fmt: str, max_length: int) -> None:
        data = load_eval_data(path, tok, fmt=fmt, max_length=max_length)
        if data.fmt != MC_FORMAT:
            build_prompts(data)
            references(data)

    for i in itertools.count():
        batch = _damaged_rows(rows, rng, 3, atoms, keys)
        path = folder / f"damaged-{i}.jsonl"
        path.write_text("".join(json.dumps(row) + "\n" for row in batch))
        how = (rng.choice(tokenizers), rng.choice(["auto", MC_FORMAT, "chat", "alpaca", "prompt_completion", "text"]),
               rng.choice([8, 512]))
        yield path, lambda path=path, how=how: read(path, *how)


def gguf_cases(folder: Path, rng: random.Random) -> Iterator[Case]:
    """Damaged copies of the tiny GGUF (tests/packer/model/_gguf.py): bytes flipped near the start (the header and
    metadata), 8-byte fields set huge, the file cut short; each converted by ``sweep model``'s conversion."""
    from lora_sweep.packer.model.gguf import convert
    from tests.packer.model._gguf import write_tiny_gguf

    good = write_tiny_gguf(folder / "tiny.gguf").read_bytes()
    for i in itertools.count():
        damaged = bytearray(good)
        if rng.random() < 0.2:
            damaged = damaged[:rng.randrange(8, len(good))]
        for _ in range(rng.randint(1, 6)):
            at = rng.randrange(0, min(6000, len(damaged) - 8))
            if rng.random() < 0.5:
                damaged[at] = rng.randrange(256)
            else:
                damaged[at:at + 8] = struct.pack("<Q", rng.choice([2**63 - 1, 2**40, 2**32 + 1, 0, 1 << 20]))
        path = folder / f"damaged-{i}.gguf"
        path.write_bytes(bytes(damaged))
        shutil.rmtree(folder / "out", ignore_errors=True)  # the last case's conversion
        yield path, lambda path=path: convert(path, folder / "out")


_CONFIG_ATOMS = [None, 0, -1, 1, 3, 65, 2**31, 10**5, 1e309, "x", True, [], {}, ["Nope"], "nope", "int3", "bfloat16",
                 {"type": "weird"}, {"rope_type": "linear"}, {"rope_type": "yarn", "factor": 0}]
_CONFIG_KEYS = ["num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                "head_dim", "vocab_size", "rope_scaling", "rope_parameters", "rope_theta", "max_position_embeddings",
                "tie_word_embeddings", "model_type", "architectures", "dtype", "rms_norm_eps", "hidden_act",
                "pad_token_id", "eos_token_id"]


def model_cases(folder: Path, rng: random.Random) -> Iterator[Case]:
    """Damaged copies of a tiny Llama checkpoint directory: values of its ``config.json`` changed (layer counts and
    widths set huge, zero or of the wrong type, an unknown rope or architecture), or, one case in five, bytes of its
    safetensors header flipped or the file cut short; each loaded by ``load_base`` on the CPU."""
    from lora_sweep.packer.model.load import load_base
    from lora_sweep.packer.tiny.models import build_tiny_model

    good = build_tiny_model("llama", folder / "tiny", seed=0)
    config = json.loads((good / "config.json").read_text())
    weights = (good / "model.safetensors").read_bytes()
    header = 8 + int.from_bytes(weights[:8], "little")
    for i in itertools.count():
        path = folder / f"damaged-{i}"
        shutil.copytree(good, path)
        if rng.random() < 0.2:
            damaged = bytearray(weights)
            if rng.random() < 0.3:
                damaged = damaged[:rng.randrange(1, len(weights))]
            else:
                for _ in range(rng.randint(1, 4)):
                    damaged[rng.randrange(0, header)] = rng.randrange(256)
            (path / "model.safetensors").write_bytes(bytes(damaged))
        else:
            damaged_config = copy.deepcopy(config)
            for _ in range(rng.randint(1, 3)):
                damaged_config = damage(damaged_config, rng, _CONFIG_ATOMS, _CONFIG_KEYS)
            (path / "config.json").write_text(json.dumps(damaged_config))
        shutil.rmtree(folder / f"damaged-{i - 1}", ignore_errors=True)  # the last case's copy
        yield path, lambda path=path: load_base(str(path))


class _Late(BaseException):
    """Raised by the alarm in a case past its bound (a BaseException: no ``except Exception`` in the code read
    swallows it)."""


def judge(run: Callable[[], object], bound: float) -> str | None:
    """None when ``run()`` returns or raises one ``UserError`` line within ``bound`` seconds; else what broke the
    invariant (the exception's type and the line that raised it, or the time). A foreign config's refusals, one line
    each under a count, are one error. The bound is an alarm: only the main thread can judge."""
    from lora_sweep.errors import UserError

    def late(*_: object) -> None:
        raise _Late

    previous = signal.signal(signal.SIGALRM, late)
    signal.setitimer(signal.ITIMER_REAL, bound)
    try:
        run()
    except UserError as err:
        if "\n" in str(err) and "cannot run here" not in str(err):
            return f"a UserError of {len(str(err).splitlines())} lines: {str(err).splitlines()[0][:120]}"
    except _Late:
        return f"over {bound:g} s"
    except Exception as err:  # noqa: BLE001  (any other is the finding)
        last = traceback.extract_tb(err.__traceback__)[-1]
        return f"{type(err).__name__} at {Path(last.filename).name}:{last.lineno}: {str(err)[:120]!r}"
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    return None


CASES = {"study": study_cases, "rows": rows_cases, "eval": eval_cases, "gguf": gguf_cases, "model": model_cases}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.damage", description=__doc__.split("\n\n")[0])
    parser.add_argument("kind", choices=sorted(CASES))
    parser.add_argument("--seconds", type=float, default=60.0, help="how long to damage and read (default 60)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--bound", type=float, default=5.0, help="seconds a case may take (default 5)")
    parser.add_argument("--memory-gb", type=float, default=12.0,
                        help="the address space the reading may take (0: no limit; a MemoryError is a finding)")
    args = parser.parse_args(argv)
    logging.disable(logging.CRITICAL)  # the readers' warnings, once per case, are not findings
    warnings.simplefilter("ignore")
    folder = Path(tempfile.mkdtemp(prefix=f"damage-{args.kind}-"))
    os.chdir(folder)
    cases = CASES[args.kind](folder, random.Random(args.seed))
    cases = itertools.chain([next(cases)], cases)  # the readers imported before the limit: their imports are not read
    if args.memory_gb > 0:
        limit = int(args.memory_gb * 2**30)
        resource.setrlimit(resource.RLIMIT_AS, (limit, resource.getrlimit(resource.RLIMIT_AS)[1]))
    kinds: dict[str, Path] = {}
    count, started = 0, time.monotonic()
    while time.monotonic() - started < args.seconds:
        path, run = next(cases)
        count += 1
        with open(os.devnull, "w") as quiet, contextlib.redirect_stderr(quiet):  # the readers' progress bars
            found = judge(run, args.bound)
        kind = found.split(": ")[0] if found else None
        if kind is not None and kind not in kinds:
            kinds[kind] = path.rename(path.with_name(f"finding-{len(kinds)}{path.suffix}"))
            print(f"finding {len(kinds)}: {found} ({kinds[kind]})", flush=True)
        elif path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()
    print(f"{args.kind}: {count:,} damaged files in {time.monotonic() - started:.0f} s (seed {args.seed}), "
          f"{len(kinds)} findings" + (f"; kept in {folder}" if kinds else ""))
    if not kinds:
        shutil.rmtree(folder, ignore_errors=True)
    return 1 if kinds else 0


if __name__ == "__main__":
    sys.exit(main())
