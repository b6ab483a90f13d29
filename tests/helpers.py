"""Helpers several test modules share (a test module imports none from another): the packed-vs-PEFT oracle of the
packer's invariant, the probe's growth measure, the evaluations on a training pack, the workers' and the foreign
configs' study files, a tiny byte-level tokenizer (``build_tokenizer``), and the patches that make a test see one
cause.

tests/conftest.py keeps the fixtures and pytest hooks, the skips for want of an extra (``missing``, ``need_module``)
and the tiny rows and study file the whole suite builds on (``random_examples``, ``write_study``, ``Recorder``).
"""

from __future__ import annotations

import os
import sys
from dataclasses import replace
from pathlib import Path

import optuna
import pytest
import torch
import transformers.masking_utils
import yaml
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

from lora_sweep.packer.data.rows import Example, SlotStream, read_jsonl, tokenize_rows
from lora_sweep.packer.model.load import load_base
from lora_sweep.packer.model.packed import PackedModel
from lora_sweep.packer.plan import AdapterSpec, adapter_param_count
from lora_sweep.packer.probe import peak_memory
from lora_sweep.packer.step import eval_graph
from lora_sweep.packer.step.train import FixedBatch, SlotEnd, SlotJob, train
from lora_sweep.packer.tiny.data import arithmetic_rows, write_jsonl
from lora_sweep.store.storage import open_storage
from lora_sweep.sweep.config.spec import Param, SearchSpace
from lora_sweep.testing.variant import (  # noqa: F401  (the oracle, re-exported for the packer's parity tests)
    IDS,
    PAD,
    STEPS,
    PeftRun,
    adamw_steps,
    assert_peft_and_merge_reproduce,
    assert_trained_as_peft,
    default_dtype,
    initial_a,
    run_packed,
    run_peft,
    slot_jobs,
    train_and_save,
)
from tests.conftest import missing, need_module, write_study
from tests.evaluators.conftest import YESNO

FOREIGN_CONFIGS = Path(__file__).parent / "sweep" / "data"
"""Axolotl and torchtune configs (published LoRA examples) with BASE_MODEL, DATA, EVAL and OUTPUT to fill in."""

# --------------------------------------------------------------- the packer's invariant: packed == PEFT alone
# (the oracle is the variant contract's, ``lora_sweep.testing.variant``)


LLAMA_SPECS = [
    AdapterSpec(rank=2, alpha=4, lr=3e-3, micro_batch=1, targets=("q_proj", "v_proj"), max_steps=STEPS, seed=1),
    AdapterSpec(rank=4, alpha=16, lr=1e-2, micro_batch=2, targets=("all-linear",), max_steps=STEPS + 2, seed=2,
                rslora=True, weight_decay=0.1, warmup_steps=3, schedule="cosine"),
    AdapterSpec(rank=8, alpha=8, lr=5e-3, micro_batch=3, targets=("o_proj", "down_proj"), max_steps=STEPS, seed=3,
                max_grad_norm=0.05, schedule="linear", warmup_steps=2),
    AdapterSpec(rank=16, alpha=32, lr=2e-3, micro_batch=2, targets=("gate_proj", "up_proj", "k_proj"),
                max_steps=STEPS + 1, seed=4, max_grad_norm=None, betas=(0.8, 0.95)),
]


GPT2_SPECS = [
    AdapterSpec(rank=2, alpha=4, lr=3e-3, micro_batch=1, targets=("c_attn",), max_steps=STEPS, seed=1),
    AdapterSpec(rank=4, alpha=16, lr=1e-2, micro_batch=2, targets=("all-linear",), max_steps=STEPS, seed=2,
                schedule="cosine", warmup_steps=4),
    AdapterSpec(rank=8, alpha=8, lr=5e-3, micro_batch=3, targets=("c_proj",), max_steps=STEPS, seed=3,
                max_grad_norm=0.05, rslora=True),
    AdapterSpec(rank=16, alpha=32, lr=2e-3, micro_batch=2, targets=("c_fc", "c_attn"), max_steps=STEPS, seed=4,
                weight_decay=0.05),
]


# --------------------------------------------------------------- planning and evaluation on a pack

def step_growth(pm: PackedModel, mm, ranks: tuple[int, ...], micro: int, seq: int, vocab: int, dora: bool = False,
                dropout: float = 0.0, **options) -> tuple[float, float]:
    """(predicted, measured) bytes a pack's step adds on top of the base part, for slots of ``ranks`` (DoRA slots
    with ``dora``, with LoRA dropout ``dropout``)."""
    gen = torch.Generator().manual_seed(1)
    jobs = []
    for i, r in enumerate(ranks):
        ids = torch.randint(3, vocab, (micro, seq), generator=gen).tolist()
        spec = AdapterSpec(rank=r, targets=("all-linear",), micro_batch=micro, max_steps=2, seed=i, dora=dora,
                           dropout=dropout)
        jobs.append(SlotJob(spec, FixedBatch([Example(tuple(x), tuple(x)) for x in ids])))
    shapes = [(layer.in_features, layer.out_features) for layer in pm.layers.values()]
    params = sum(adapter_param_count(shapes, r) for r in ranks)
    predicted = mm.predict(len(ranks) * micro * seq, params, sum(ranks))
    measured = peak_memory(lambda: train(pm, len(ranks), lambda s: jobs.pop(0) if jobs else None, pad_id=0,
                                         **options), pm)
    print(f"growth predicted {(predicted - mm.base_bytes) / 1e6:.1f} MB, measured "
          f"{(measured - mm.base_bytes) / 1e6:.1f} MB; adapters {params / 1e6:.2f} M parameters")
    return predicted - mm.base_bytes, measured - mm.base_bytes


def pack_evaluations(model_dir, check, attn: str = "sdpa", device: str = "cpu", impl: str = "torch",
                            **train_kw):  # noqa: ANN001, ANN003, ANN201
    """Train 3 jobs (mixed ranks, targets, lengths) in 4 slots; ``check(pm, slots, tok)`` runs in every
    ``on_end`` (the ending slots and every other live slot are still in the pack)."""
    model, tok = load_base(str(model_dir), attn_implementation=attn, device=device)
    pm = PackedModel(model, impl=impl)
    _, rows = read_jsonl(YESNO)
    examples = tokenize_rows(rows, "prompt_completion", tok)
    base = AdapterSpec(rank=8, alpha=16, lr=3e-2, targets=("all-linear",), micro_batch=4, max_steps=6)
    specs = [replace(base, max_steps=4, seed=1), replace(base, rank=4, targets=("q_proj", "v_proj"), seed=2),
             replace(base, rank=16, alpha=8, targets=("gate_proj", "up_proj", "down_proj"), seed=3)]
    queue = [SlotJob(s, SlotStream(examples, s.micro_batch, seed=i), key=i) for i, s in enumerate(specs)]
    calls = []

    def on_end(ends: list[SlotEnd]) -> None:
        assert eval_graph.available(pm)
        calls.append(sorted(pm.specs))
        check(pm, sorted(e.slot for e in ends), tok)
        check(pm, sorted(pm.specs), tok)

    train(pm, 4, lambda slot: queue.pop(0) if queue else None, pad_id=tok.pad_token_id, on_end=on_end,
          readback_every=2, **train_kw)
    assert len(calls) == 2 and pm.store is None


# --------------------------------------------------------------- study files: workers, Axolotl and torchtune

_SERVERS = {"postgresql": ("LORA_SWEEP_TEST_PG", "PostgreSQL on 127.0.0.1:55432", "psycopg2", "postgres"),
            "mysql": ("LORA_SWEEP_TEST_MYSQL", "MariaDB on 127.0.0.1:53306", "pymysql", "mysql")}


def server_url(kind: str) -> str:
    """The test server's URL (``postgresql`` or ``mysql``), its driver's extra installed; else the test is skipped
    (``tests.conftest.missing``)."""
    env, server, module, extra = _SERVERS[kind]
    need_module(module, extra)
    if not os.environ.get(env):
        missing(f"a {kind} server ({env} is unset)", f"export {env} (.ci/run starts {server})")
    return os.environ[env]


def worker_study(tmp_path: Path, model_dir: Path, name: str, **changes) -> Path:
    """The shared small study, as a multi-worker job: 9 trials of 20 steps, 2 slots, no pruning."""
    return write_study(tmp_path, model_dir, name, **{
        "train": {"max_steps": 20, "micro_batch": 4},
        "objectives": [{"metric": "eval_loss", "direction": "minimize"}],
        "budget": {"trials": 9},
        "pruning": {"kind": "none"},
        "pack": {"max_slots": 2},
        "evaluators": [{"name": "heldout_loss"}],
        "artifacts": str(tmp_path / "shared-adapters" / name),
        **changes,
    })


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "lora_sweep", *args]


# One thread per worker, as conftest gives the test process: workers sharing 2 cores with a pool of
# threads each spin against one another and a 10-step trial takes a minute instead of a second.
WORKER_ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def stored_trials(url: str, name: str) -> list[optuna.trial.FrozenTrial]:
    return optuna.load_study(study_name=name, storage=open_storage(url)).get_trials()


def foreign_config(tmp_path: Path, model_dir: Path, name: str, **changes) -> Path:  # noqa: ANN003
    """A copy of ``FOREIGN_CONFIGS/<name>`` with BASE_MODEL, DATA, EVAL and OUTPUT filled in and ``changes`` applied."""
    train, held_out = tmp_path / "alpaca-train.jsonl", tmp_path / "alpaca-eval.jsonl"
    rows = arithmetic_rows(60, seed=3, fmt="alpaca")
    write_jsonl(train, rows[:48])
    write_jsonl(held_out, rows[48:])
    text = (FOREIGN_CONFIGS / name).read_text()
    for word, value in (("BASE_MODEL", model_dir), ("DATA", train), ("EVAL", held_out),
                        ("OUTPUT", tmp_path / f"out-{name}")):
        text = text.replace(word, str(value))
    path = tmp_path / name
    path.write_text(text)
    if changes:
        doc = yaml.safe_load(text)
        for key, value in changes.items():
            doc[key] = value
        path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


# --------------------------------------------------------------- patches that make a test see one cause

def positions_ignored(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make transformers build a plain causal mask over packed rows, as a family whose modeling code does not
    pass its positions to the mask does (Falcon in transformers 5.23): each example sees the ones before it."""
    monkeypatch.setattr(transformers.masking_utils, "find_packed_sequence_indices", lambda position_ids: None)


def refuse_model_loads(monkeypatch) -> None:  # noqa: ANN001
    """From here on, loading the model or its tokenizer fails the test: what a cached plan must not do."""
    import lora_sweep.packer.model.load as load  # where the packer's object reads them, when a method is called

    def refused(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        raise AssertionError("a cached plan loads neither the model nor its tokenizer")

    monkeypatch.setattr(load, "load_base", refused)
    monkeypatch.setattr(load, "load_tokenizer", refused)


def scored_pack(model_dir: Path, dora: bool = False, impl: str = "torch") -> tuple[PackedModel, object]:
    """(pack, tokenizer): four slots of different ranks, targets and scales with non-zero B (slot 2 DoRA with
    ``dora``), for the batched evaluation's tests (tests/packer/step/test_eval_graph*.py)."""
    model, tok = load_base(str(model_dir))
    pm = PackedModel(model, impl=impl)  # type: ignore[arg-type]
    gen = torch.Generator().manual_seed(0)
    targets = (("all-linear",), ("q_proj", "v_proj"), ("gate_proj", "up_proj", "down_proj"), ("all-linear",))
    for slot, (rank, tg) in enumerate(zip((8, 4, 16, 2), targets, strict=True)):
        pm.add_slot(slot, AdapterSpec(rank=rank, alpha=3.0 * rank, targets=tg, seed=slot, dora=dora and slot == 2))
        with torch.no_grad():
            for _, b in pm.slot_weights(slot).values():
                b.copy_(torch.randn(b.shape, generator=gen) * 0.3)
    return pm, tok


def scored_alone(pm: PackedModel, slot: int, data, prompts, gen_kw) -> tuple:  # noqa: ANN001
    """Slot ``slot`` scored by itself on the per-adapter path: (per-item losses, generated ids)."""
    from lora_sweep.evaluators.generation import generate_ids
    from lora_sweep.evaluators.heldout_loss import heldout_loss

    loss = heldout_loss(pm, [slot], data, batch_size=5, batched=False).per_item[slot]["eval_loss"]
    return loss, generate_ids(pm, [slot], prompts, batched=False, **gen_kw)[slot]


# --------------------------------------------------------------- a search space (the space's and the sampler's tests)

SETS = {"attn": ("q_proj", "v_proj"), "all": ("all-linear",)}
"""Target sets ``SPACE``'s ``targets`` names."""
SPACE = SearchSpace(
    (
        Param("rank", "categorical", choices=(2, 4, 8, 16, 32)),
        Param("alpha_ratio", "categorical", choices=(0.5, 1.0, 2.0, 4.0)),
        Param("lr", "float", low=1e-4, high=3e-2, log=True),
        Param("dropout", "categorical", choices=(0.0, 0.05)),
        Param("warmup_steps", "int", low=0, high=20, step=5),
        Param("targets", "categorical", choices=("attn", "all")),
    ),
    target_sets=SETS,
)
"""Every kind of parameter a study file searches: categorical, float on a log scale, int with a step, target sets."""


CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ '\\n' }}{{ m['content'] }}"
    "{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{{ '\\n' }}{% endif %}"
)
CORPUS = [
    "Below is an instruction that describes a task, paired with an input that provides further context.",
    "Write a response that appropriately completes the request. ### Instruction: ### Input: ### Response:",
    "System: User: Assistant: What is the capital of France? Paris. Say hello. Hello world! 2 + 2 = 4",
]
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Capital of France?"},
    {"role": "assistant", "content": "Paris."},
    {"role": "user", "content": "Say hello."},
    {"role": "assistant", "content": "Hello world!"},
]


def build_tokenizer(chat_template: str | None) -> PreTrainedTokenizerFast:
    """A byte-level BPE (vocab ~300) trained on CORPUS; BOS is added by the post-processor, as Llama does."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=["<pad>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    hf.chat_template = chat_template
    return hf
