"""A study searching adapter variants (``init``, ``lr_ratio``) runs end to end: each trial trains its variant, its
adapter is a plain PEFT LoRA of the base (rank 2r for a principal init), ``sweep export --merge`` takes it, and the
report and status carry the variants as dimensions."""

from __future__ import annotations

import subprocess
import sys

from optuna.trial import TrialState
from transformers import AutoModelForCausalLM

from lora_sweep.packer.model.checkpoint import read_adapter
from lora_sweep.sweep.config.loader import load_study
from lora_sweep.sweep.store import ResultsStore
from lora_sweep.sweep.study import run_study
from tests.conftest import write_study

ROOT = __import__("pathlib").Path(__file__).resolve().parents[2]


def test_a_study_over_init_and_lr_ratio_runs_and_exports(tiny_dirs, tmp_path) -> None:
    model_dir = tiny_dirs("llama")
    path = write_study(tmp_path, model_dir, "variants", search={"rank": [2, 4], "init": ["gaussian", "pissa"],
                                                                 "lr_ratio": [1, 8]},
                       sampler={"name": "grid"}, train={"max_steps": 4, "micro_batch": 2}, budget={"trials": 8},
                       pruning={"kind": "none"}, evaluators=[{"name": "heldout_loss"}],
                       objectives=[{"metric": "eval_loss", "direction": "minimize"}])
    spec = load_study(path)
    run_study(spec, log=lambda m: None)
    with ResultsStore(spec.out_dir / "results.db", create=False) as store:
        trials = store.trials()
    assert len(trials) == 8 and all(t.state == TrialState.COMPLETE.name for t in trials)
    assert {(t.params["init"], t.params["lr_ratio"]) for t in trials} == {(i, r) for i in ("gaussian", "pissa")
                                                                         for r in (1, 8)}
    for t in trials:
        cfg, tensors = read_adapter(spec.out_dir / t.adapter_path)
        rows = 2 * t.params["rank"] if t.params["init"] == "pissa" else t.params["rank"]
        assert cfg["r"] == rows and all(v.shape[0] == rows or v.shape[1] == rows for v in tensors.values())

    pissa = next(t for t in trials if t.params["init"] == "pissa")
    out = tmp_path / "merged"
    result = subprocess.run([sys.executable, "-m", "lora_sweep", "export", str(spec.out_dir), "--trial",
                             str(pissa.number), "--merge", "--out", str(out)], capture_output=True, text=True,
                            timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    assert AutoModelForCausalLM.from_pretrained(str(out)) is not None

    status = subprocess.run([sys.executable, "-m", "lora_sweep", "status", str(spec.out_dir)], capture_output=True,
                            text=True, timeout=300, cwd=ROOT)
    assert status.returncode == 0, status.stderr
    assert "init" in status.stdout and "lr_ratio" in status.stdout, status.stdout

    from lora_sweep.reports.html import build_report

    page = build_report(spec.out_dir)
    for sid in ("importances", "parallel"):  # both figures name both variant dimensions
        section = page[page.index(f'<section id="{sid}">'):]
        section = section[:section.index("</section>")]
        assert '"init"' in section and '"lr_ratio"' in section, sid  # as names, not "initial"
