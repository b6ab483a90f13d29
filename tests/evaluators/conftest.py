"""Adapters trained once per session on the tiny models, saved as PEFT directories, and packs to load them into."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from lora_sweep.packer.data.rows import SlotStream, read_jsonl, tokenize_rows
from lora_sweep.packer.model.checkpoint import save_adapter
from lora_sweep.packer.model.load import load_base
from lora_sweep.packer.model.packed import PackedModel
from lora_sweep.packer.plan import AdapterSpec
from lora_sweep.packer.step.train import SlotEnd, SlotJob, train
from lora_sweep.packer.tiny.data import arithmetic_rows

DATA = Path(__file__).parent / "data"
YESNO = DATA / "yesno.jsonl"
YESNO_MC = DATA / "yesno-mc.jsonl"
TARGETS = {"llama": ("all-linear",), "gpt2": ("all-linear",)}


@dataclass
class Trained:
    """Saved adapters of one family: slot i of ``load_pack`` holds ``specs[i]`` with ``adapters[i]``."""

    model_dir: Path
    specs: list[AdapterSpec]
    adapters: list[Path]


def _training_rows() -> list[list[dict]]:
    _, yesno = read_jsonl(YESNO)
    always_yes = [dict(r, completion=" yes") for r in yesno]
    arith = arithmetic_rows(200, seed=7, fmt="prompt_completion")
    return [always_yes, yesno, arith]  # slot 0 always says yes, slot 1 learns the labels, slot 2 arithmetic


@pytest.fixture(scope="session")
def trained(tiny_dirs, tmp_path_factory: pytest.TempPathFactory):
    """family -> ``Trained``: three adapters trained 30 steps at a high lr, so none is the base model."""
    cache: dict[str, Trained] = {}

    def get(family: str) -> Trained:
        if family in cache:
            return cache[family]
        model_dir = tiny_dirs(family)
        model, tok = load_base(str(model_dir))
        pm = PackedModel(model)
        specs = [AdapterSpec(rank=8, alpha=16, lr=2e-2, targets=TARGETS[family], micro_batch=8, max_steps=30,
                             seed=i) for i in range(3)]
        jobs = [SlotJob(spec, SlotStream(tokenize_rows(rows, "prompt_completion", tok), 8, seed=i), key=i)
                for i, (spec, rows) in enumerate(zip(specs, _training_rows(), strict=True))]
        out = tmp_path_factory.mktemp(f"adapters-{family}")
        saved: dict[int, Path] = {}

        def on_end(ends: list[SlotEnd]) -> None:
            for e in ends:
                saved[e.job.key] = save_adapter(pm, e.slot, out / f"trial-{e.job.key}",
                                                base_model_name_or_path=str(model_dir))

        queue = list(jobs)
        train(pm, 3, lambda s: queue.pop(0) if queue else None, pad_id=tok.pad_token_id, on_end=on_end)
        cache[family] = Trained(model_dir, specs, [saved[i] for i in range(3)])
        return cache[family]

    return get


def load_pack(t: Trained, slots: tuple[int, ...] = (0, 1, 2)):
    """(PackedModel with the trained adapters in ``slots``, tokenizer), freshly loaded."""
    from tests.conftest import load_adapter

    model, tok = load_base(str(t.model_dir))
    pm = PackedModel(model)
    for slot in slots:
        pm.add_slot(slot, t.specs[slot])
        load_adapter(pm, slot, t.adapters[slot])
    return pm, tok
