"""Study files -> StudySpec: aliases, the W&B block, overrides and located one-line errors.

Run: python -m pytest tests/sweep/test_spec.py -q
"""

from __future__ import annotations

import ast
import math
import re
from dataclasses import fields
from pathlib import Path

import pytest

from lora_sweep.errors import ConfigError
from lora_sweep.packer.plan import AdapterSpec
from lora_sweep.sweep.config.loader import load_study
from lora_sweep.sweep.config.spec import Param, SearchSpace, TrainSpec

BASE = """\
name: t
model: org/tiny-model
data:
  train: train.jsonl
  eval: eval.jsonl
search:
  rank: [4, 8]
  lr: {low: 1e-4, high: 1e-2, log: true}
train:
  max_steps: 40
budget:
  trials: 4
"""


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    for name in ("train.jsonl", "eval.jsonl"):
        (tmp_path / name).write_text('{"instruction": "a", "output": "b"}\n')
    return tmp_path


def write(folder: Path, text: str, name: str = "study.yaml") -> Path:
    path = folder / name
    path.write_text(text)
    return path


def error_of(path: Path, overrides: tuple[str, ...] = (), **kw: bool) -> str:
    with pytest.raises(ConfigError) as e:
        load_study(path, overrides, **kw)
    msg = str(e.value)
    assert "\n" not in msg
    return msg


def test_minimal_file_and_defaults(folder: Path) -> None:
    s = load_study(write(folder, BASE))
    assert s.name == "t" and s.model.path == "org/tiny-model"
    assert s.data.train == folder / "train.jsonl" and s.data.eval == folder / "eval.jsonl"
    assert [p.name for p in s.search.params] == ["rank", "lr"]
    assert s.search.param("lr") == Param("lr", "float", low=1e-4, high=1e-2, log=True)
    assert s.search.param("rank").choices == (4, 8)
    assert s.train.max_steps == 40 and s.train.lr == AdapterSpec().lr
    assert s.objectives[0].metric == "eval_loss" and s.directions == ["minimize"]
    assert s.sampler.name == "tpe" and s.pruning.kind == "none" and s.pack.max_slots == "auto"
    assert s.pack.shard == "none"
    assert [e.name for e in s.evaluators] == ["heldout_loss"]
    assert s.out_dir == Path("runs/t") and s.source == folder / "study.yaml"


def test_train_spec_mirrors_adapter_spec() -> None:
    adapter = {f.name for f in fields(AdapterSpec)} - {"seed", "extra"}
    per_trial = {"alpha_ratio", "epochs", "max_steps_per_epoch", "warmup_ratio", "eval_every"}
    loop = {"optimizer_in_backward"}  # an option of the packed training loop, not of one adapter
    assert {f.name for f in fields(TrainSpec)} == adapter | per_trial | loop
    assert TrainSpec().adapter_values() == {k: getattr(AdapterSpec(), k) for k in adapter}
    assert TrainSpec(rank=8, alpha_ratio=2).adapter_values()["alpha"] == 16.0


def test_axolotl_torchtune_peft_aliases(folder: Path) -> None:
    text = """\
base_model: org/base
data: {train: train.jsonl, eval: eval.jsonl, type: alpaca}
sequence_len: 256
train_on_inputs: true
micro_batch_size: 2
learning_rate: 3e-4
lora_target_modules: [q_proj, v_proj]
peft_use_rslora: true
lr_scheduler: cosine
train:
  lora_dropout: 0.1
  warmup: 3
search:
  lora_r: [8, 16]
  lora_alpha: [16, 32]
budget: {n_trials: 3, timeout: 90m, max_tokens: 5M}
"""
    s = load_study(write(folder, text))
    assert s.model.path == "org/base"
    assert s.data.max_length == 256 and s.data.train_on_prompt is True and s.data.format == "alpaca"
    t = s.train
    assert (t.micro_batch, t.lr, t.targets, t.rslora, t.schedule) == (2, 3e-4, ("q_proj", "v_proj"), True, "cosine")
    assert (t.dropout, t.warmup_steps) == (0.1, 3)
    assert [p.name for p in s.search.params] == ["rank", "alpha"]
    assert s.search.param("alpha").choices == (16.0, 32.0)
    assert (s.budget.trials, s.budget.wall_time, s.budget.tokens) == (3, 5400.0, 5_000_000)


def test_lora_target_linear_means_all_linear(folder: Path) -> None:
    s = load_study(write(folder, BASE + "lora_target_linear: true\n"))
    assert s.train.targets == ("all-linear",)


def test_wandb_parameters_block(folder: Path) -> None:
    text = """\
method: random
metric: {name: exact_match, goal: maximize}
evaluators: [heldout_loss, generation]
run_cap: 10
model: org/tiny-model
data: {train: train.jsonl, eval: eval.jsonl}
parameters:
  learning_rate: {distribution: log_uniform_values, min: 1e-5, max: 1e-3}
  lora_r: {values: [4, 8]}
  lora_dropout: {value: 0.1}
  lora_alpha: {distribution: log_uniform, min: 0, max: 2}
  warmup_steps: {distribution: int_uniform, min: 0, max: 10}
  weight_decay: {distribution: q_uniform, min: 0, max: 0.1, q: 0.05}
  micro_batch_size: {min: 1, max: 4}
  lora_target_modules: {values: [[q_proj, v_proj], all-linear]}
"""
    s = load_study(write(folder, text))
    assert s.sampler.name == "random" and s.budget.trials == 10
    assert (s.objectives[0].metric, s.objectives[0].direction) == ("exact_match", "maximize")
    sp = s.search
    assert sp.param("lr") == Param("lr", "float", low=1e-5, high=1e-3, log=True)
    assert sp.param("rank").choices == (4, 8)
    alpha = sp.param("alpha")
    assert alpha.log and alpha.low == pytest.approx(1.0) and alpha.high == pytest.approx(math.e**2)
    assert sp.param("warmup_steps") == Param("warmup_steps", "int", low=0, high=10)
    assert sp.param("weight_decay") == Param("weight_decay", "float", low=0.0, high=0.1, step=0.05)
    assert sp.param("micro_batch") == Param("micro_batch", "int", low=1, high=4)
    assert sp.param("targets").choices == ("q_proj+v_proj", "all-linear")
    assert sp.target_sets["q_proj+v_proj"] == ("q_proj", "v_proj")
    assert s.train.dropout == 0.1  # W&B `value:` is a fixed value


def test_overrides(folder: Path) -> None:
    text = BASE + "objectives:\n  - {metric: exact_match, direction: maximize}\nevaluators: [generation]\n"
    path = write(folder, text)
    s = load_study(
        path,
        [
            "train.max_steps=50",  # existing key
            "train.warmup=5",  # an alias (of warmup_steps) not yet in the file
            "budget.wall_time=2h",  # nested key not in the file
            "search.rank=[8, 16, 32]",  # a flow list
            "objectives.0.direction=minimize",  # a list index
            "pruning={kind: cohort_sha, rungs: [10, 20]}",
            "sampler.name=random",  # a section not in the file
        ],
    )
    assert s.train.max_steps == 50 and s.train.warmup_steps == 5 and s.budget.wall_time == 7200.0
    assert s.search.param("rank").choices == (8, 16, 32) and s.objectives[0].direction == "minimize"
    assert s.pruning.rungs == (10, 20) and s.sampler.name == "random"


def test_searched_choices_take_null_where_the_setting_does(folder: Path) -> None:
    """A list of values is read with the setting's own type: ``max_grad_norm`` is ``float | None``, ``rank`` an int."""
    s = load_study(write(folder, BASE), ["search.max_grad_norm=[null, 1]"])
    assert s.search.param("max_grad_norm").choices == (None, 1.0)
    assert error_of(write(folder, BASE), ("search.rank=[null, 8]",)).endswith(
        "search.rank.0: must be an integer (got None)")


def test_override_replaces_an_aliased_key(folder: Path) -> None:
    path = write(folder, BASE.replace("  max_steps: 40\n", "  max_steps: 40\n  lora_dropout: 0.1\n"))
    assert load_study(path, ["train.dropout=0.2"]).train.dropout == 0.2


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("train.max_steps=abc", "override 'train.max_steps=abc': train.max_steps: must be an integer (got 'abc')"),
        ("train.weight_decay=-1", "override 'train.weight_decay=-1': train.weight_decay: must be >= 0"),
        ("search.rank.low=1", "override 'search.rank.low=1': search.rank is not a mapping"),
        ("budget.trials.x=1", "override 'budget.trials.x=1': budget.trials is not a mapping"),
        ("train.max_steps", "override 'train.max_steps': expected dotted.key=value"),
        ("trian.max_steps=3", "unknown key 'trian' at top level (did you mean 'train'?)"),
    ],
)
def test_override_errors(folder: Path, override: str, expected: str) -> None:
    path = write(folder, BASE)
    msg = error_of(path, (override,))
    assert str(path) in msg and expected in msg


# Each case: a study text with `#<` on the offending line, and a piece of the expected message.
BAD = {
    "negative rank": (
        BASE.replace("  rank: [4, 8]\n", "  rank:\n    low: -4 #<\n    high: 8\n"),
        "search.rank.low: must be 1..256 (got -4)",
    ),
    "rank above 256": (BASE.replace("rank: [4, 8]", "rank: [4, 300] #<"), "search.rank: must be 1..256 (got 300)"),
    "unknown key": (
        BASE.replace("  lr: {", "  learnig_rate: {").replace("log: true}", "log: true} #<"),
        "unknown key 'learnig_rate' in search (did you mean 'learning_rate'?)",
    ),
    "unknown top-level key": (BASE + "budjet: {trials: 3} #<\n", "unknown key 'budjet' at top level"),
    "wrong type": (BASE.replace("max_steps: 40", "max_steps: many #<"), "train.max_steps: must be an integer"),
    "fused ops not a bool": (
        BASE + "pack: {fused_base_ops: maybe} #<\n", "pack.fused_base_ops: must be true or false"),
    "cuda graphs mode unknown": (
        BASE + "pack: {cuda_graphs: always} #<\n", "pack.cuda_graphs: must be auto, on or off"),
    "shard mode unknown": (BASE + "pack: {shard: ddp} #<\n", "pack.shard: must be none or fsdp"),
    "shard mode unknown, the section under its other name": (
        BASE + "packing: {shard: ddp} #<\n", "packing.shard: must be none or fsdp"),
    "sharded pack on a CUDA graph": (
        BASE + "pack: {shard: fsdp, cuda_graphs: 'on'} #<\n", "pack.shard: fsdp runs the eager step"),
    "sharded pack planned by calibration": (
        BASE + "pack: {shard: fsdp} #<\n", "pack.shard: fsdp needs pack.max_slots set"),
    "empty search space": (
        BASE.replace("  rank: [4, 8]\n  lr: {low: 1e-4, high: 1e-2, log: true}\n", "  rank: 8\n").replace(
            "search:", "search: #<"
        ),
        "search: no parameter to search",
    ),
    "missing data file": (BASE.replace("train: train.jsonl", "train: nope.jsonl #<"), "data.train: file not found"),
    "missing local model": (
        BASE.replace("model: org/tiny-model", "model:\n  path: ./models/nothing-here #<"),
        "model.path: local model directory not found",
    ),
    "bad hub id": (BASE.replace("model: org/tiny-model", "model: not a hub id #<"), "model: is neither a hub id"),
    "duplicate key": (BASE + "name: again #<\n", "name: duplicate key"),
    "invalid yaml": (BASE + "oops: a: b #<\n", "invalid YAML: mapping values are not allowed here"),
    "searched and fixed": (BASE.replace("max_steps: 40", "max_steps: 40\n  lora_r: 8 #<"), "train.lora_r: is fixed"),
    "alpha and alpha_ratio": (
        BASE.replace("max_steps: 40", "max_steps: 40\n  alpha_ratio: 2 #<").replace("rank:", "alpha: [8, 16]\n  rank:"),
        "train.alpha_ratio: set either alpha or alpha_ratio",
    ),
    "low above high": (BASE.replace("high: 1e-2", "high: 1e-5").replace("log: true}", "log: true} #<"), "must be >"),
    "grid over a range": (BASE.replace("log: true}", "log: true} #<") + "sampler: grid\n", "search.lr: grid sampler"),
    "bad direction": (BASE + "objectives:\n  - {metric: exact_match, direction: up} #<\n", "objectives.0.direction"),
    "bad constraint": (BASE + "constraints:\n  - mem < 3 #<\n", "constraints.0: must read 'metric <= value'"),
    "rung past max_steps": (
        BASE + "pruning:\n  kind: cohort_sha\n  rungs: [10, 40] #<\n",
        "pruning.rungs: must be < train.max_steps (40) (got 40)",
    ),
    "unsupported distribution": (
        BASE.replace("  lr: {low: 1e-4, high: 1e-2, log: true}", "  lr:\n    distribution: normal #<\n    min: 0"),
        "search.lr.distribution: 'normal' is not supported",
    ),
    "unknown evaluator": (BASE + "evaluators:\n  - name: bleu #<\n", "evaluators.0.name: must be one of"),
    "no budget": (BASE.replace("budget:\n  trials: 4\n", "budget: {} #<\n"), "budget: set at least one of"),
    "bad duration": (BASE.replace("trials: 4", "wall_time: soon #<"), "budget.wall_time: must be seconds"),
    "eval data needed": (BASE.replace("  eval: eval.jsonl\n", "").replace("data:", "data: #<"), "data.eval: is needed"),
    "range on a flag": (BASE.replace("rank: [4, 8]", "rslora: {low: 0, high: 1} #<"), "search.rslora: takes a list"),
    "target sets not a list": (
        BASE.replace("rank: [4, 8]", "targets: {values: 3} #<"),
        "search.targets.values: must be a list (got 3)",
    ),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_files_give_one_located_line(folder: Path, case: str) -> None:
    text, expected = BAD[case]
    line = next(i for i, s in enumerate(text.splitlines(), 1) if "#<" in s)
    path = write(folder, text, "x.yaml")
    msg = error_of(path)
    assert msg.startswith(f"{path}:{line}: "), msg
    assert expected in msg, msg


def test_missing_study_file(tmp_path: Path) -> None:
    msg = error_of(tmp_path / "missing.yaml")
    assert "missing.yaml" in msg and "no such study file" in msg


def test_model_path_check_can_be_skipped(folder: Path) -> None:
    path = write(folder, BASE.replace("model: org/tiny-model", "model: ../models/later"))
    assert "not found" in error_of(path)
    s = load_study(path, check_paths=False)
    assert s.model.path == str((folder.parent / "models/later").resolve())


def test_existing_local_model_dir(folder: Path) -> None:
    (folder / "models" / "tiny").mkdir(parents=True)
    s = load_study(write(folder, BASE.replace("model: org/tiny-model", "model: models/tiny")))
    assert s.model.path == str(folder / "models" / "tiny")


def test_string_forms_of_objectives_constraints_sampler_pruning(folder: Path) -> None:
    text = BASE + (
        "objectives: [maximise exact_match, min adapter_params]\n"
        "constraints: ['peak_memory_mb <= 20', {metric: eval_loss, op: '>=', value: 0}]\n"
        "sampler: {name: nsga2, population_size: 8}\n"
        "pruning: none\npack: 4\nevaluators: [heldout_loss, {name: generation, options: {max_new_tokens: 4}}]\n"
    )
    s = load_study(write(folder, text))
    assert [(o.metric, o.direction) for o in s.objectives] == [
        ("exact_match", "maximize"),
        ("adapter_params", "minimize"),
    ]
    c = s.constraints[0]
    assert (c.metric, c.op, c.value) == ("peak_memory_mb", "<=", 20.0) and c.violation(25.0) == 5.0
    assert s.constraints[1].violation(1.0) == -1.0
    assert s.sampler.population_size == 8 and s.pruning.kind == "none" and s.pack.max_slots == 4
    assert dict(s.evaluators[1].options) == {"max_new_tokens": 4}
    assert s.prune_metric() == ("eval_loss", "minimize")


def test_a_fields_metadata_says_how_the_file_spells_it(folder: Path) -> None:
    """Every section and list entry is read by one reader from its fields: a duration or a count where the field
    declares an ``amount`` rule, a direction's other spellings where it declares ``spellings``."""
    text = BASE.replace("trials: 4", "trials: 4\n  wall_time: 1h30m\n  tokens: 1.5B") + (
        "objectives: [{metric: eval_loss, direction: min}, maximise exact_match]\n"
        "pruning: {kind: cohort_sha, rungs: [10], proxy: perplexity, proxy_direction: minimise}\n"
        "evaluators: [{name: heldout_loss, timeout: 2m}, {name: generation, timeout: 90}]\n")
    s = load_study(write(folder, text))
    assert (s.budget.wall_time, s.budget.tokens, s.budget.trials) == (5400.0, 1_500_000_000, 4)
    assert [o.direction for o in s.objectives] == ["minimize", "maximize"]
    assert s.pruning.proxy_direction == "minimize" and s.prune_metric() == ("perplexity", "minimize")
    assert [e.timeout for e in s.evaluators] == [120.0, 90]
    with pytest.raises(ConfigError, match=r"study.yaml:\d+: pruning.proxy_direction: must be minimize or maximize"):
        load_study(write(folder, text.replace("minimise}", "down}")))


@pytest.mark.parametrize(("override", "rule"), [
    ("model.path=' padded'", "model.path: must be a hub id or path"),
    ("model.device=gpu", "model.device: must be auto, cpu, cuda or cuda:N (got 'gpu')"),
    ("model.quantize=int8", "model.quantize: must be nf4 or null (got 'int8')"),
    ("data.format=csv", "data.format: must be one of auto, "),
    ("data.max_length=0", "data.max_length: must be >= 1 (got 0)"),
    ("pack.chunked_ce=0", "pack.chunked_ce: must be true, false or a number of tokens >= 1 (got 0)"),
    ("evaluators=[{name: heldout_loss, options: {batch_size: [{1: 2}]}}]",
     "evaluators.0.options: must be a mapping of names to plain values"),
    ("evaluators=[{name: heldout_loss, timeout: -1}]", "evaluators.0.timeout: must be a number of seconds > 0"),
    ("name='a b'", "name: must be letters, digits, '.', '_' or '-' (got 'a b')"),
    ("seed=-1", "seed: must be an int >= 0 (got -1)"),
    ("storage=results.db", "storage: must be an RDB URL such as sqlite:///study.db or a journal file path ending in"),
    ("objectives=[{metric: 'a b', direction: minimize}]", "objectives.0.metric: must be a metric name"),
    ("constraints=[{metric: eval_loss, op: '<=', value: .nan}]", "constraints.0.value: must be a number (got nan)"),
])
def test_a_fields_own_rule_is_one_located_line(folder: Path, override: str, rule: str) -> None:
    """Each field states its check beside its type (``rule``); a value it refuses is one line naming the override
    and the dotted key."""
    with pytest.raises(ConfigError) as e:
        load_study(write(folder, BASE.replace("model: org/tiny-model", "model: {path: org/tiny-model}")), [override])
    assert str(e.value).startswith(f"{folder / 'study.yaml'}: override '{override}': {rule}"), str(e.value)
    assert "\n" not in str(e.value)


def test_prune_metric(folder: Path) -> None:
    single = BASE + "objectives: [maximize exact_match]\npruning: {kind: cohort_sha, rungs: [10]}\n"
    single += "evaluators: [generation]\n"
    assert load_study(write(folder, single)).prune_metric() == ("exact_match", "maximize")
    proxy = BASE + "objectives: [maximize exact_match, minimize adapter_params]\n"
    proxy += "pruning: {kind: cohort_sha, rungs: [10], proxy: exact_match}\nevaluators: [generation]\n"
    assert load_study(write(folder, proxy)).prune_metric() == ("exact_match", "maximize")


def test_the_defaults_come_from_the_evaluators_and_the_config_names_none(
        folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The default evaluator, objective and pruning proxy are declared once, by the evaluators (``DEFAULT``):
    no module of sweep/config spells an evaluator's name or the default's metrics in its code."""
    from lora_sweep.evaluators import registry
    from lora_sweep.sweep.config import spec

    assert registry.DEFAULT_METRIC == ("eval_loss", "minimize")
    assert [e.name for e in load_study(write(folder, BASE)).evaluators] == [registry.DEFAULT.name]
    several = BASE + "objectives: [minimize eval_loss, minimize adapter_params]\n"
    monkeypatch.setattr(registry, "DEFAULT_METRIC", ("perplexity", "minimize"))
    assert load_study(write(folder, several)).prune_metric() == ("perplexity", "minimize")
    named = {e.name for e in registry.EVALUATORS} | set(registry.DEFAULT.metrics(registry.DEFAULT.load()))
    for file in sorted(Path(spec.__file__).parent.glob("*.py")):
        spelled = [n.value for n in ast.walk(ast.parse(file.read_text()))
                   if isinstance(n, ast.Constant) and isinstance(n.value, str) and n.value in named]
        assert not spelled, f"{file.name} names {spelled}"


def test_search_space_rules() -> None:
    with pytest.raises(ConfigError, match="no parameter to search"):
        SearchSpace(params=())
    with pytest.raises(ConfigError, match="^alpha_ratio: cannot search both"):
        SearchSpace(
            (Param("alpha", "categorical", choices=(8.0,)), Param("alpha_ratio", "categorical", choices=(2.0,)))
        )
    with pytest.raises(ConfigError, match="^step: cannot be combined with log"):
        Param("lr", "float", low=1e-4, high=1e-2, log=True, step=1e-4)
    with pytest.raises(ConfigError, match=re.escape("targets: unknown target set (got 'attn')")):
        SearchSpace((Param("targets", "categorical", choices=("attn",)),))


def test_metric_names_are_checked_against_the_evaluators(folder: Path) -> None:
    with pytest.raises(ConfigError, match=r"study.yaml:\d+: objectives.0.metric: unknown metric 'exact_match'"):
        load_study(write(folder, BASE + "objectives: [maximize exact_match]\n"))  # no generation evaluator
    with pytest.raises(ConfigError, match=r"constraints.0.metric: unknown metric 'peak_mem_gb'"):
        load_study(write(folder, BASE + "constraints: ['peak_mem_gb <= 20']\n"))
    with pytest.raises(ConfigError, match=r"study.yaml:\d+: evaluators.0.name: must be one of heldout_loss"):
        load_study(write(folder, BASE + "evaluators: [bleu]\n"))


def test_sharded_pack_key(folder: Path) -> None:
    s = load_study(write(folder, BASE + "pack: {shard: fsdp, max_slots: 4}\n"))
    assert s.pack.shard == "fsdp" and s.pack.cuda_graphs == "auto"


def test_packing_is_the_pack_section_under_another_name(folder: Path) -> None:
    """``packing:`` and its dotted overrides set the ``pack`` section, its own aliases (``slots``) included;
    an error names the key as written, and both names at once are one section written twice."""
    alias = write(folder, BASE + "packing: {slots: 3, chunked_ce: true}\n")
    s = load_study(alias)
    assert (s.pack.max_slots, s.pack.chunked_ce) == (3, True)
    assert load_study(alias, ("pack.slots=5",)).pack.max_slots == 5  # replaces the file's value, not a second one
    own = write(folder, BASE + "pack: {max_slots: 3}\n", "own.yaml")
    assert load_study(own, ("packing.max_slots=6",)).pack.max_slots == 6
    assert load_study(write(folder, BASE, "bare.yaml"), ("packing.kernels=torch",)).pack.kernels == "torch"
    assert error_of(own, ("packing.max_slots=0",)).endswith(
        "override 'packing.max_slots=0': pack.max_slots: must be auto or an int in 1..256 (got 0)")
    bad = write(folder, BASE + "packing: {max_slots: 0}\n", "bad.yaml")
    assert error_of(bad).endswith("packing.max_slots: must be auto or an int in 1..256 (got 0)")
    both = error_of(write(folder, BASE + "pack: 2\npacking: {kernels: torch}\n", "both.yaml"))
    assert both.endswith("packing: sets pack again (already set by 'pack')")
