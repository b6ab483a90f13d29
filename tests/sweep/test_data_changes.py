"""A study's data: rows bounded by ``data.max_line_bytes`` before the model loads, and the files' digests recorded so
that a resume on changed data is refused naming the file, or accepted with ``--allow-data-change`` and recorded."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from lora_sweep.cli import cli
from lora_sweep.errors import DataError, UserError
from lora_sweep.store.api import ResultsStore, StudyDir
from lora_sweep.sweep.config.loader import load_study
from lora_sweep.sweep.study import run_study
from tests.conftest import DEMO_DATA, write_study


def _study(tmp_path: Path, model: Path, **changes: object) -> Path:
    for name in ("arith-train.jsonl", "arith-eval.jsonl"):
        shutil.copy(DEMO_DATA / name, tmp_path / name)
    fields = {"data": {"train": "arith-train.jsonl", "eval": "arith-eval.jsonl", "format": "prompt_completion",
                       "max_length": 48},
              "train": {"max_steps": 2, "micro_batch": 2}, "budget": {"trials": 2}, "pruning": {"kind": "none"},
              "pack": {"max_slots": 2}, "objectives": [{"metric": "eval_loss", "direction": "minimize"}],
              "evaluators": ["heldout_loss"], **changes}
    return write_study(tmp_path, model, name="data", **fields)


def test_a_row_over_data_max_line_bytes_is_refused_before_the_model_loads(tiny_dirs, tmp_path, monkeypatch) -> None:
    import lora_sweep.packer.model.load as load

    def no_load(*a: object, **k: object) -> None:
        raise AssertionError("the model was loaded before the rows were bounded")

    monkeypatch.setattr(load, "load_base", no_load)  # what open_base calls
    study = _study(tmp_path, tiny_dirs("llama"))
    with open(tmp_path / "arith-eval.jsonl", "a") as f:
        f.write('{"prompt": "' + "9" * 300 + '", "completion": "1"}\n')
    lines = len((tmp_path / "arith-eval.jsonl").read_text().splitlines())
    spec = load_study(study, ["data.max_line_bytes=200"])
    assert spec.data.line_bytes == 200 and load_study(study).data.line_bytes == 1 << 20
    with pytest.raises(DataError, match=rf"arith-eval\.jsonl:{lines}: a row longer than 200 bytes"):
        run_study(spec, log=lambda m: None)
    with pytest.raises(Exception, match=r"data\.max_line_bytes: must be a number of bytes >= 1"):
        load_study(study, ["data.max_line_bytes=0"])


def test_a_resume_on_changed_data_is_refused_or_allowed_and_recorded(tiny_dirs, tmp_path) -> None:
    study = _study(tmp_path, tiny_dirs("llama"))
    spec = load_study(study)
    assert run_study(spec, log=lambda m: None).complete == 2
    store = ResultsStore(StudyDir(spec.out_dir).results_db)
    digest = hashlib.sha256((tmp_path / "arith-eval.jsonl").read_bytes()).hexdigest()
    assert store.meta()["data_digests"]["eval"] == {"path": str(tmp_path / "arith-eval.jsonl"), "sha256": digest}
    rows = (tmp_path / "arith-eval.jsonl").read_text().splitlines()
    (tmp_path / "arith-eval.jsonl").write_text("\n".join(rows[: len(rows) // 2]) + "\n")  # the same path, other rows
    refused = CliRunner().invoke(cli, ["run", str(study), "budget.trials=4", "--quiet"])
    assert isinstance(refused.exception, UserError)
    assert str(refused.exception).startswith(f"run: data.eval: {tmp_path / 'arith-eval.jsonl'} changed since the "
                                             f"study started (sha256 {digest[:12]} -> ")
    assert "--allow-data-change" in str(refused.exception)
    assert len(ResultsStore(StudyDir(spec.out_dir).results_db).trials()) == 2  # refused before any trial
    allowed = CliRunner().invoke(cli, ["run", str(study), "budget.trials=4", "--quiet", "--allow-data-change"])
    assert allowed.exit_code == 0, allowed.output
    meta = ResultsStore(StudyDir(spec.out_dir).results_db).meta()
    [change] = meta["data_changes"]
    assert change["key"] == "data.eval" and change["from"] == digest and change["trials_before"] == 2
    assert meta["data_digests"]["eval"]["sha256"] == change["to"] != digest
    unchanged = CliRunner().invoke(cli, ["run", str(study), "budget.trials=5", "--quiet"])  # the new data pinned
    assert unchanged.exit_code == 0, unchanged.output
