"""A study searching adapter variants (``dora``, ``init``, ``lr_ratio``) runs end to end: each trial trains its
variant, its adapter is a PEFT adapter of the unmodified base (rank 2r for a principal init, magnitudes for DoRA),
``sweep export --merge`` takes it, and the report and status carry the variants as dimensions."""

from __future__ import annotations

import subprocess
import sys

import pytest
from optuna.trial import TrialState
from transformers import AutoModelForCausalLM

from lora_sweep.errors import ConfigError
from lora_sweep.packer.model.checkpoint import read_adapter
from lora_sweep.store.api import ResultsStore
from lora_sweep.sweep.config.loader import load_study
from lora_sweep.sweep.study import run_study
from tests.conftest import write_study
from tests.helpers import foreign_config

ROOT = __import__("pathlib").Path(__file__).resolve().parents[2]


def _grid_study(tmp_path, model_dir, name: str, search: dict, trials: int, **train):  # noqa: ANN001, ANN202
    """Every combination of ``search`` trained 4 steps at rank 4 (a grid of ``trials``), scored by held-out loss;
    returns the loaded spec and the stored trials."""
    path = write_study(tmp_path, model_dir, name, search=search, sampler={"name": "grid"},
                       train={"max_steps": 4, "micro_batch": 2, "rank": 4, **train}, budget={"trials": trials},
                       pruning={"kind": "none"}, evaluators=[{"name": "heldout_loss"}],
                       objectives=[{"metric": "eval_loss", "direction": "minimize"}])
    spec = load_study(path)
    run_study(spec, log=lambda m: None)
    with ResultsStore(spec.out_dir / "results.db", create=False) as store:
        return spec, store.trials()


def test_a_study_over_dora_init_and_lr_ratio_runs_and_exports(tiny_dirs, tmp_path) -> None:
    spec, trials = _grid_study(tmp_path, tiny_dirs("llama"), "variants", {"dora": [False, True], "init": [
        "gaussian", "pissa"], "lr_ratio": [1, 8]}, 8)
    assert len(trials) == 8 and all(t.state == TrialState.COMPLETE.name for t in trials)
    assert {(t.params["dora"], t.params["init"], t.params["lr_ratio"]) for t in trials} == {
        (d, i, r) for d in (False, True) for i in ("gaussian", "pissa") for r in (1, 8)}
    for t in trials:
        cfg, tensors = read_adapter(spec.out_dir / t.adapter_path)
        rows = 2 * spec.train.rank if t.params["init"] == "pissa" else spec.train.rank
        assert cfg["r"] == rows and cfg["use_dora"] is t.params["dora"]
        assert all(v.shape[0] == rows or v.shape[1] == rows for k, v in tensors.items() if "lora_magnitude" not in k)

    pissa = next(t for t in trials if t.params["init"] == "pissa" and t.params["dora"])
    out = tmp_path / "merged"
    result = subprocess.run([sys.executable, "-m", "lora_sweep", "export", str(spec.out_dir), "--trial",
                             str(pissa.number), "--merge", "--out", str(out)], capture_output=True, text=True,
                            timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    assert AutoModelForCausalLM.from_pretrained(str(out)) is not None

    status = subprocess.run([sys.executable, "-m", "lora_sweep", "status", str(spec.out_dir)], capture_output=True,
                            text=True, timeout=300, cwd=ROOT)
    assert status.returncode == 0, status.stderr
    assert all(name in status.stdout for name in ("dora", "init", "lr_ratio")), status.stdout

    from lora_sweep.reports.html import build_report

    page = build_report(spec.out_dir)
    for sid in ("parallel",):  # the figure names every variant dimension (importances need 20 complete trials)
        section = page[page.index(f'<section id="{sid}">'):]
        section = section[:section.index("</section>")]
        for name in ("dora", "init", "lr_ratio"):
            assert f'"{name}"' in section, (sid, name)  # as names, not "initial"


def test_the_axolotl_config_with_peft_use_dora_runs_and_its_adapter_loads_in_peft_with_use_dora(tiny_dirs,
                                                                                                  tmp_path) -> None:
    """Axolotl's lora-1b example with ``peft_use_dora: true`` (and its own ``lora_dropout: 0.05``: DoRA with dropout,
    PEFT's term on the dropped input): the study runs with no other key, and a trial's adapter is a PEFT DoRA adapter
    PEFT loads."""
    from peft import PeftModel

    path = foreign_config(tmp_path, tiny_dirs("llama"), "axolotl-lora-1b.yml", peft_use_dora=True)
    spec = load_study(path)
    assert spec.train.dora is True and spec.train.dropout == 0.05
    run_study(spec, log=lambda m: None)
    with ResultsStore(spec.out_dir / "results.db", create=False) as store:
        trials = store.trials()
    assert trials and all(t.state == TrialState.COMPLETE.name for t in trials)
    adapter = spec.out_dir / trials[0].adapter_path
    cfg, tensors = read_adapter(adapter)
    assert cfg["use_dora"] is True and any(k.endswith(".lora_magnitude_vector") for k in tensors)
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(tiny_dirs("llama"))), str(adapter))
    assert model.peft_config["default"].use_dora


def test_a_study_searching_lorafa_trains_both_and_saves_plain_peft_adapters(tiny_dirs, tmp_path) -> None:
    """``lorafa`` is a searchable name (``sweep/config/settings.py``): each trial trains, and a LoRA-FA trial's
    adapter is a plain PEFT LoRA (PEFT has no LoRA-FA config field)."""
    spec, trials = _grid_study(tmp_path, tiny_dirs("llama"), "lorafa", {"lorafa": [False, True]}, 2, eps=1e-6)
    assert sorted(t.params["lorafa"] for t in trials) == [False, True]
    assert all(t.state == TrialState.COMPLETE.name for t in trials)
    for t in trials:
        cfg, tensors = read_adapter(spec.out_dir / t.adapter_path)
        assert cfg["r"] == 4 and cfg["use_dora"] is False and len(tensors) > 0


def test_a_search_that_can_propose_lorafa_with_dora_is_refused_at_load(tiny_dirs, tmp_path) -> None:
    """The packer refuses LoRA-FA with DoRA (``packer.variants.lorafa``): the study file is refused before any trial
    trains, naming the combination, instead of stopping mid-run when the sampler first proposes it."""
    path = write_study(tmp_path, tiny_dirs("llama"), "clash", search={"dora": [False, True], "lorafa": [False, True]})
    with pytest.raises(ConfigError, match=r"search: can propose dora: True, lorafa: True, which is refused "
                                          r"\(lorafa: does not combine with dora"):
        load_study(path)
