"""Accumulation, sample packing and epochs through a study: steps from the data, tokens as planned."""

from __future__ import annotations

import logging
import sqlite3

import pytest
import yaml
from optuna.trial import TrialState

from lora_sweep.errors import ConfigError
from lora_sweep.packer.data.rows import load_examples
from lora_sweep.packer.data.stream import epoch_steps
from lora_sweep.packer.model.load import load_base
from lora_sweep.packer.step.shapes import MAX_BUCKETS, length_buckets
from lora_sweep.store.attrs import PLANNED_TOKENS, TOKENS
from lora_sweep.sweep._trial_data import step_lengths
from lora_sweep.sweep.config.loader import load_study
from lora_sweep.sweep.config.space import adapter_spec
from lora_sweep.sweep.study import run_study
from tests.conftest import DEMO_DATA, optuna_study, write_study


def _small_data(tmp_path, n: int = 48, split: str = "train"):  # noqa: ANN001, ANN202
    path = tmp_path / f"{split}-small.jsonl"
    lines = (DEMO_DATA / f"arith-{split}.jsonl").read_text().splitlines()[:n]
    path.write_text("\n".join(lines) + "\n")
    return path


def _study(tmp_path, model_dir, **train):  # noqa: ANN001, ANN202
    data = {"train": str(_small_data(tmp_path)), "eval": str(_small_data(tmp_path, 16, "eval")),
            "format": "prompt_completion", "max_length": 48}
    return write_study(tmp_path, model_dir, name="epochs", data=data,
                       search={"gradient_accumulation_steps": [1, 2], "sample_packing": [False, True],
                               "rank": [2, 4]},
                       train={"micro_batch": 4, **train}, budget={"trials": 4},
                       pruning={"kind": "cohort_sha", "rungs": [2], "reduction_factor": 2},
                       evaluators=[{"name": "heldout_loss"}],
                       objectives=[{"metric": "eval_loss", "direction": "minimize"}])


def test_epochs_give_each_trial_its_steps_and_tokens_match_the_plan(tiny_dirs, tmp_path) -> None:
    spec = load_study(_study(tmp_path, tiny_dirs("llama"), epochs=1))
    assert spec.train.epochs == 1 and {p.name for p in spec.search.params} >= {"gradient_accumulation_steps"}
    run_study(spec, log=lambda m: None)
    model, tok = load_base(str(tiny_dirs("llama")))
    examples = load_examples(spec.data.train, tok, fmt="prompt_completion", max_length=48)
    trials = optuna_study(spec.out_dir, "epochs").get_trials()
    assert len(trials) == 4 and all(t.state in (TrialState.COMPLETE, TrialState.PRUNED) for t in trials)
    with sqlite3.connect(spec.out_dir / "results.db") as db:
        done = dict(db.execute("select number, steps_done from trials").fetchall())
        assert db.execute("select count(*) from prune_decisions").fetchone()[0] >= 2  # rung 2 in optimizer steps
    counts = set()
    for t in trials:
        adapter = adapter_spec(t.params, spec.train, spec.seed, space=spec.search)
        steps = epoch_steps(examples, adapter, 1, 48, spec.seed)
        counts.add(steps)
        if t.state == TrialState.COMPLETE:
            assert done[t.number] == steps
            assert t.user_attrs[TOKENS] == t.user_attrs[PLANNED_TOKENS]  # the budget's count is exact
    assert len(counts) > 1, "micro-batch, accumulation and packing must give trials different step counts"
    # 48 examples of ~20 tokens: micro 4 x accumulation 2 is 6 steps; packed rows of 48 tokens hold more
    assert epoch_steps(examples, adapter_spec({"gradient_accumulation_steps": 2}, spec.train, 0, space=spec.search),
                       1, 48, 0) == 6


def test_max_steps_overrides_epochs(tiny_dirs, tmp_path, caplog) -> None:
    with caplog.at_level(logging.WARNING):
        spec = load_study(_study(tmp_path, tiny_dirs("llama"), epochs=2, max_steps=3))
    assert spec.train.epochs is None and spec.train.max_steps == 3
    assert "max_steps overrides epochs" in caplog.text


def test_accumulation_is_a_fixed_or_searched_setting(tiny_dirs, tmp_path) -> None:
    path = write_study(tmp_path, tiny_dirs("llama"), name="acc", train={"gradient_accumulation_steps": 3,
                                                                         "num_epochs": 0.5})
    spec = load_study(path)
    assert spec.train.gradient_accumulation_steps == 3 and spec.train.epochs == 0.5
    with pytest.raises(ConfigError, match="gradient_accumulation_steps: must be an int >= 1"):
        load_study(path, ["train.gradient_accumulation_steps=0"])


def test_sample_packing_on_an_unverified_family_is_one_error(tiny_dirs, tmp_path) -> None:
    path = _study(tmp_path, tiny_dirs("opt"))
    doc = yaml.safe_load(path.read_text())
    doc["search"] = {"sample_packing": [True], "rank": [2, 4]}
    path.write_text(yaml.safe_dump(doc))
    with pytest.raises(ConfigError, match="sample_packing: not verified for model family 'opt'"):
        run_study(load_study(path), log=lambda m: None)


def test_sample_packing_where_the_installed_transformers_mixes_examples_is_one_error(tiny_dirs, tmp_path,
                                                                                      monkeypatch) -> None:
    """A mask built without the packed positions (as Falcon's in transformers 5.23) lets a packed row's examples
    attend to each other: the study is refused with one error, as for a family packing is not verified for."""
    from tests.helpers import positions_ignored

    positions_ignored(monkeypatch)
    path = _study(tmp_path, tiny_dirs("llama"))
    doc = yaml.safe_load(path.read_text())
    doc["search"] = {"sample_packing": [False, True], "rank": [2, 4]}
    path.write_text(yaml.safe_dump(doc))
    with pytest.raises(ConfigError, match="sample_packing: with transformers .* lets a packed row's examples attend"):
        run_study(load_study(path), log=lambda m: None)


def test_warmup_ratio_and_steps_per_epoch_resolve_per_trial(tiny_dirs, tmp_path) -> None:
    from lora_sweep.sweep._trial_data import trial_adapter

    path = write_study(tmp_path, tiny_dirs("llama"), name="ratio",
                       train={"micro_batch": 4, "epochs": 2, "warmup_ratio": 0.25, "max_steps_per_epoch": 5})
    spec = load_study(path)
    model, tok = load_base(str(tiny_dirs("llama")))
    examples = load_examples(spec.data.train, tok, fmt="prompt_completion", max_length=48)
    adapter = trial_adapter(spec, adapter_spec({}, spec.train, 0, space=spec.search), [], examples)
    assert (adapter.max_steps, adapter.warmup_steps) == (10, 3)  # 2 epochs of min(500, 5) steps; ceil(0.25 * 10)
    searched = trial_adapter(spec, adapter_spec({"max_steps": 7}, spec.train, 0, space=spec.search), ["max_steps"],
                             examples)
    assert (searched.max_steps, searched.warmup_steps) == (7, 2)


def test_eval_every_records_a_heldout_curve_and_optuna_intermediates(tiny_dirs, tmp_path) -> None:
    from lora_sweep.store.api import ResultsStore

    path = write_study(tmp_path, tiny_dirs("llama"), name="curve", train={"max_steps": 6, "micro_batch": 4,
                                                                          "eval_steps": 2},
                       search={"rank": [2, 4]}, budget={"trials": 2}, pruning={"kind": "none"},
                       data={"train": str(_small_data(tmp_path)), "eval": str(_small_data(tmp_path, 16, "eval")),
                             "format": "prompt_completion", "max_length": 48},
                       evaluators=["heldout_loss"], objectives=[{"metric": "eval_loss", "direction": "minimize"}])
    spec = load_study(path)
    assert spec.train.eval_every == 2
    run_study(spec, log=lambda m: None)
    trials = optuna_study(spec.out_dir, "curve").get_trials()
    with ResultsStore(spec.out_dir / "results.db", create=False) as store:
        for t in trials:
            curve = {e.step: e.value for e in store.evals(trial=t.number, kind="curve")}
            assert sorted(curve) == [2, 4, 6] and t.intermediate_values == curve
            assert curve[6] == pytest.approx(t.values[0], rel=1e-5)  # the last point is the final eval_loss
    with pytest.raises(ConfigError, match="data.eval: is needed by train.eval_every"):
        load_study(path, ["data.eval=null", "evaluators=[]", "objectives=[minimize adapter_params]"])


def test_step_lengths_cover_the_data_and_a_packed_row(tiny_dirs, tmp_path) -> None:
    """A pack's step lengths: at most MAX_BUCKETS, the longest example held, and the sample-packed row's length
    (data.max_length) among them when the space can sample-pack; the smallest micro-batch the space draws sets how
    many rows a step's longest is taken over."""
    spec = load_study(_study(tmp_path, tiny_dirs("llama")))
    _, tokenizer = load_base(str(tiny_dirs("llama")))
    examples = load_examples(spec.data.train, tokenizer, fmt=spec.data.format, max_length=spec.data.max_length)
    lengths = step_lengths(spec, examples, capacity=2)
    assert 1 <= len(lengths) <= MAX_BUCKETS
    assert lengths[-1] >= max(len(e.input_ids) for e in examples)
    assert 48 in lengths  # sample_packing is searched: a packed row of max_length has its own length
    assert step_lengths(spec, examples, 2) == length_buckets([len(e.input_ids) for e in examples] + [48], 2 * 4)
