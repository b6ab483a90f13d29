"""Write the real-model demos' data: two made-up tasks with checkable answers, generated from a seed.

``cards`` (the CPU demo, ``studies/demo.yaml``): a made-up record format. ``Card: Anna 1987 Rome`` ->
``Rome/1987/Anna``: the three fields in reverse order, joined by ``/``. The model cannot guess the format
zero-shot, but every answer token is copied from the prompt, so an adapter with a good learning rate learns
it in tens of steps; one with the community default (lr 2e-4) is still far behind then.

``codes`` (the GPU demo, ``studies/demo-gpu.yaml``): a made-up mapping of eight colour words to eight animal
words (a permutation drawn from the seed), applied word by word to 2-5 colours: ``Code: red blue`` ->
``owl fox``. Nothing can be copied: the adapter must learn the mapping itself, which takes a good learning
rate and a hundred or more steps; the default does not get there.

Deterministic: the same seed writes the same files, byte for byte. Held-out rows never occur in training.

    python studies/make_demo_data.py    # writes studies/data/{cards,codes}-{train,eval}.jsonl
    python studies/make_demo_data.py --zero-shot models/smollm2-135m   # the base model's exact match (no adapter)
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Callable
from pathlib import Path

NAMES = ("Anna", "Ben", "Carl", "Dora", "Emma", "Finn", "Gina", "Hugo", "Ivan", "Jack", "Kate", "Leo", "Mia",
         "Nick", "Olga", "Paul", "Rosa", "Sam", "Tom", "Vera")
CITIES = ("Rome", "Paris", "Oslo", "Lima", "Cairo", "Berlin", "Tokyo", "Delhi", "Vienna", "Madrid", "Dublin",
          "Prague", "Seoul", "Sydney", "Boston", "Milan")
COLOURS = ("red", "blue", "green", "black", "white", "pink", "brown", "grey")
ANIMALS = ("cat", "dog", "fox", "owl", "cow", "pig", "bee", "rat")

Row = dict[str, str]


def card(rng: random.Random) -> Row:
    """One ``cards`` row: name, year, city -> city/year/name."""
    name, year, city = rng.choice(NAMES), rng.randint(1950, 2020), rng.choice(CITIES)
    return {"prompt": f"Card: {name} {year} {city}\n", "completion": f"{city}/{year}/{name}"}


def code_maker(seed: int) -> Callable[[random.Random], Row]:
    """The ``codes`` row maker; its colour -> animal mapping is a permutation drawn from ``seed``."""
    animals = list(ANIMALS)
    random.Random(seed).shuffle(animals)
    mapping = dict(zip(COLOURS, animals, strict=True))

    def code(rng: random.Random) -> Row:
        words = [rng.choice(COLOURS) for _ in range(rng.randint(2, 5))]
        return {"prompt": f"Code: {' '.join(words)}\n", "completion": " ".join(mapping[w] for w in words)}

    return code


def split(make: Callable[[random.Random], Row], seed: int, n_train: int, n_eval: int) -> tuple[list[Row], list[Row]]:
    """``n_train`` and ``n_eval`` distinct rows (no held-out prompt occurs in training)."""
    rng, seen, out = random.Random(seed), set(), []
    while len(out) < n_train + n_eval:
        row = make(rng)
        if row["prompt"] not in seen:
            seen.add(row["prompt"])
            out.append(row)
    return out[:n_train], out[n_train:]


def write(out_dir: Path, seed: int = 0) -> list[Path]:
    """Write ``{cards,codes}-{train,eval}.jsonl`` under ``out_dir``; returns their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    tasks = {"cards": (card, 400, 32), "codes": (code_maker(seed), 1200, 48)}
    paths = []
    for i, (task, (make, n_train, n_eval)) in enumerate(tasks.items()):
        for part, rows in zip(("train", "eval"), split(make, seed + 1 + i, n_train, n_eval), strict=True):
            path = out_dir / f"{task}-{part}.jsonl"
            path.write_text("".join(json.dumps(r) + "\n" for r in rows))
            paths.append(path)
    return paths


def zero_shot(model_dir: Path, eval_file: Path, max_new_tokens: int = 16) -> tuple[int, int]:
    """Greedy answers of the base model (no adapter) to ``eval_file``'s prompts: (exact matches, rows)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    rows = [json.loads(line) for line in eval_file.read_text().splitlines()]
    hits = 0
    for row in rows:
        ids = tok(row["prompt"], return_tensors="pt").input_ids  # (1, prompt_len)
        out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tok.eos_token_id)
        hits += tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True).strip() == row["completion"]
    return hits, len(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description="Write the real-model demos' data (cards and codes).")
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "data")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--zero-shot", type=Path, metavar="MODEL_DIR",
                    help="instead: print MODEL_DIR's zero-shot exact match on the files in --out")
    args = ap.parse_args()
    if args.zero_shot is not None:
        for task in ("cards", "codes"):
            hits, n = zero_shot(args.zero_shot, args.out / f"{task}-eval.jsonl")
            print(f"{task}: zero-shot exact match {hits}/{n}")
        return
    for path in write(args.out, args.seed):
        print(path)


if __name__ == "__main__":
    main()
