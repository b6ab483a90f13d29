"""lm-eval tasks on local jsonl run offline on a slot view and agree with the project's own scorers."""

from __future__ import annotations

import sys

import pytest
import torch
import yaml

from lora_sweep.errors import ConfigError, UserError
from lora_sweep.evaluators.choice import multiple_choice
from lora_sweep.evaluators.generation import generation
from lora_sweep.evaluators.lm_eval import INSTALL_HINT, LM_EVAL, run_lm_eval
from lora_sweep.evaluators.registry import EvalData, load_eval_data
from lora_sweep.evaluators.slot_view import SlotView
from tests.conftest import need_module
from tests.evaluators.conftest import YESNO, YESNO_MC, load_pack
from tests.evaluators.contract import EvaluatorContract

need_module("lm_eval", "eval")


def _write_tasks(folder) -> tuple[str, str]:
    mc = {"task": "yesno_mc", "dataset_path": "json", "dataset_kwargs": {"data_files": {"test": str(YESNO_MC)}},
          "test_split": "test", "output_type": "multiple_choice", "doc_to_text": "prompt", "doc_to_choice": "choices",
          "doc_to_target": "label", "metadata": {"version": 1.0},
          "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True},
                          {"metric": "acc_norm", "aggregation": "mean", "higher_is_better": True}]}
    gen = {"task": "yesno_gen", "dataset_path": "json", "dataset_kwargs": {"data_files": {"test": str(YESNO)}},
           "test_split": "test", "output_type": "generate_until", "doc_to_text": "prompt",
           "doc_to_target": "completion", "metadata": {"version": 1.0},
           "generation_kwargs": {"until": ["\n"], "max_gen_toks": 6, "do_sample": False},
           "metric_list": [{"metric": "exact_match", "aggregation": "mean", "higher_is_better": True}]}
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for cfg in (mc, gen):
        path = folder / f"{cfg['task']}.yaml"
        path.write_text(yaml.safe_dump(cfg))
        paths.append(str(path))
    return paths[0], paths[1]


def test_lm_eval_tasks_match_native_scorers(trained, tmp_path) -> None:
    pm, tok = load_pack(trained("llama"), slots=(0, 1))
    mc_task, gen_task = _write_tasks(tmp_path / "tasks")
    before = pm.forward(torch.tensor([[1, 5, 6]]), torch.ones(1, 3, dtype=torch.long), None)
    data = EvalData([], "prompt_completion", tok, work_dir=tmp_path / "study")
    result = run_lm_eval(pm, [0, 1], data, tasks=[mc_task, gen_task], batch_size=8)
    mc = multiple_choice(pm, [0, 1], load_eval_data(YESNO_MC, tok))
    gen = generation(pm, [0, 1], load_eval_data(YESNO, tok), stop=["\n"], max_new_tokens=6)
    for slot in (0, 1):
        metrics, per_item = result.metrics[slot], result.per_item[slot]
        assert metrics["yesno_mc.acc"] == pytest.approx(mc.metrics[slot]["mc_acc"])
        assert metrics["yesno_mc.acc_norm"] == pytest.approx(mc.metrics[slot]["mc_acc_norm"])
        assert per_item["yesno_mc.acc"] == mc.per_item[slot]["mc_acc"]
        assert metrics["yesno_gen.exact_match"] == pytest.approx(gen.metrics[slot]["exact_match"])
        assert per_item["yesno_gen.exact_match"] == gen.per_item[slot]["exact_match"]
        lm_texts = [s["response"][0] if isinstance(s["response"], list) else s["response"]
                    for s in result.samples[slot] if s["task"] == "yesno_gen"]
        assert lm_texts == [s["generation"] for s in gen.samples[slot]]
    assert result.metrics[0]["yesno_gen.exact_match"] == 0.5, "the always-yes adapter is right on the yes items"
    assert result.metrics[0] != result.metrics[1]
    # offline, cached under the study's folder; the shared base is untouched (HFLM called eval/tie_weights)
    assert (tmp_path / "study" / "hf_home" / "datasets").is_dir()
    assert not pm.model.training
    torch.testing.assert_close(pm.forward(torch.tensor([[1, 5, 6]]), torch.ones(1, 3, dtype=torch.long), None),
                               before)


def test_mc_loglikelihoods_equal_lm_eval(trained, tmp_path) -> None:
    from lm_eval.models.huggingface import HFLM

    from lora_sweep.evaluators.choice import choice_logprobs

    pm, tok = load_pack(trained("llama"), slots=(1,))
    rows = load_eval_data(YESNO_MC, tok).rows[:4]
    lm = HFLM(pretrained=SlotView(pm, 1), tokenizer=tok, batch_size=4, backend="causal")
    requests = [(r["prompt"], " " + c) for r in rows for c in r["choices"]]
    theirs = [ll for ll, _ in lm.loglikelihood([_Request(args) for args in requests], disable_tqdm=True)]
    ours = [ll for item in choice_logprobs(pm, [1], [r["prompt"] for r in rows], [r["choices"] for r in rows],
                                           tok)[1] for ll in item]
    assert ours == pytest.approx(theirs, abs=1e-4)


class _Request:
    def __init__(self, args: tuple[str, str]) -> None:
        self.args = args


def test_missing_task_file_and_unknown_task(trained, tmp_path) -> None:
    pm, tok = load_pack(trained("llama"), slots=(0,))
    data = EvalData([], "prompt_completion", tok, work_dir=tmp_path)
    with pytest.raises(ConfigError, match=r"^lm_eval\.options\.tasks: task file not found: .*nope\.yaml$"):
        run_lm_eval(pm, [0], data, tasks=[str(tmp_path / "nope.yaml")])
    mc_task, _ = _write_tasks(tmp_path)
    with pytest.raises(ConfigError, match=r"unknown task 'hellaswag' \(tasks under include_path: yesno_gen, yesno_mc"):
        run_lm_eval(pm, [0], data, tasks=["hellaswag"], include_path=str(tmp_path))
    bad = tmp_path / "bad.yaml"
    bad.write_text(open(mc_task).read().replace(str(YESNO_MC), "data/mc.jsonl"))
    with pytest.raises(ConfigError, match=r"data file not found: data/mc\.jsonl .*write absolute paths\)$"):
        run_lm_eval(pm, [0], data, tasks=[str(bad)])


def test_missing_lm_eval_gives_install_hint(trained, tmp_path, monkeypatch) -> None:
    pm, tok = load_pack(trained("llama"), slots=(0,))
    mc_task, _ = _write_tasks(tmp_path)
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # import lm_eval raises ImportError
    with pytest.raises(UserError, match=r"pip install 'lora-sweep\[eval\]'") as err:
        run_lm_eval(pm, [0], EvalData([], "prompt_completion", tok, work_dir=tmp_path), tasks=[mc_task])
    assert str(err.value).startswith(INSTALL_HINT) and "\n" not in str(err.value)


class TestLmEvalContract(EvaluatorContract):
    @pytest.fixture
    def evaluator(self):  # noqa: ANN201
        return LM_EVAL

    @pytest.fixture
    def options(self, tmp_path) -> dict:  # noqa: ANN001
        return {"tasks": list(_write_tasks(tmp_path / "tasks")), "limit": 3}

    @pytest.fixture
    def data_file(self):  # noqa: ANN201
        return YESNO

    @pytest.fixture
    def bad_option(self) -> tuple:
        return ("limit", 0)
