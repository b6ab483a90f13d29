"""Every study file under studies/ (recursively) loads, validates against its real data, and plans.

Run: python -m pytest tests/studies -q
"""

from __future__ import annotations

from pathlib import Path

import pytest

from lora_sweep.packer.data.rows import read_jsonl
from lora_sweep.sweep.config.loader import load_study
from lora_sweep.sweep.config.spec import StudySpec

STUDIES = Path(__file__).resolve().parents[2] / "studies"
FILES = sorted(STUDIES.rglob("*.yaml"))
IDS = [str(p.relative_to(STUDIES)) for p in FILES]


def _spec(path: Path) -> StudySpec:
    # check_paths=False: local models (models/tiny-llama) are built by `python -m lora_sweep.packer.tiny.models`; data
    # files
    # are checked.
    return load_study(path, check_paths=False)


def test_there_are_example_studies() -> None:
    assert len(FILES) > 0


@pytest.mark.parametrize("path", FILES, ids=IDS)
def test_example_study_validates(path: Path) -> None:
    spec = _spec(path)
    assert spec.search.params and spec.data.train.is_file()
    assert spec.data.eval is None or spec.data.eval.is_file()


@pytest.mark.parametrize("path", FILES, ids=IDS)
def test_example_study_data_has_its_declared_format(path: Path) -> None:
    """Every row of the train and eval files has the fields of ``data.format`` (no model needed)."""
    spec = _spec(path)
    for data in (spec.data.train, spec.data.eval):
        if data is not None:
            fmt, rows = read_jsonl(data, spec.data.format)  # raises DataError naming file:line
            assert rows and (spec.data.format == "auto" or fmt == spec.data.format)


@pytest.mark.parametrize("path", FILES, ids=IDS)
def test_example_study_plans(path: Path) -> None:
    """``sweep plan`` on the file as a user runs it: the model loads, the data tokenizes, the targets exist."""
    from click.testing import CliRunner

    from lora_sweep.cli import cli

    spec = _spec(path)
    model = Path(spec.model.path)
    if not model.exists():
        pytest.skip(f"model {spec.model.path} is not present here (a hub id is never downloaded in tests; a local "
                    f"model is built by the command in the study file's header)")
    if spec.model.device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            pytest.skip(f"model.device is {spec.model.device} and no CUDA device is visible")
    if spec.model.quantize == "nf4":
        from tests.conftest import need_module

        need_module("torchao", "qlora")  # the NF4 base (packer.model.quant); skipped whatever else exists
    result = CliRunner().invoke(cli, ["plan", str(path)])
    assert result.exit_code == 0, result.output
    assert "slots per pack" in result.output


def test_tiny_demo_is_the_fast_random_model_demo() -> None:
    spec = load_study(STUDIES / "tiny-demo.yaml", check_paths=False)
    assert [(o.metric, o.direction) for o in spec.objectives] == [
        ("eval_loss", "minimize"),
        ("adapter_params", "minimize"),
    ]
    assert spec.search.param("rank").choices == (2, 4, 8, 16, 32)
    assert {"alpha_ratio", "lr", "dropout", "targets"} <= {p.name for p in spec.search.params}
    assert spec.budget.trials is not None and spec.budget.trials >= 24
    assert spec.pack.max_slots == 8 and spec.pruning.kind == "cohort_sha"
    assert [e.name for e in spec.evaluators] == ["heldout_loss", "generation"]
    assert spec.model.path == str((STUDIES.parent / "models" / "tiny-llama").resolve())


def test_demo_is_the_readme_real_model_demo() -> None:
    spec = load_study(STUDIES / "demo.yaml", check_paths=False)
    assert spec.model.path == str((STUDIES.parent / "models" / "smollm2-135m").resolve())
    assert [(o.metric, o.direction) for o in spec.objectives] == [("eval_loss", "minimize"),
                                                                   ("adapter_params", "minimize")]
    assert spec.data.train.name == "cards-train.jsonl" and spec.pruning.kind == "cohort_sha" and spec.pruning.rungs
    assert [e.name for e in spec.evaluators] == ["heldout_loss", "generation"]
    # the community default (r=16, alpha=32, lr=2e-4) lies in the space, so it is enqueued first
    assert 16 in spec.search.param("rank").choices and spec.search.param("lr").low <= 2e-4


def test_gpu_demo_is_the_cuda_variant() -> None:
    spec = load_study(STUDIES / "demo-gpu.yaml", check_paths=False)
    assert spec.model.path == str((STUDIES.parent / "models" / "smollm2-135m").resolve())
    assert spec.model.device == "cuda" and spec.data.train.name == "codes-train.jsonl"
    cpu = load_study(STUDIES / "demo.yaml", check_paths=False)
    assert spec.budget.trials is not None and cpu.budget.trials is not None and spec.budget.trials > cpu.budget.trials
    assert spec.train.max_steps > cpu.train.max_steps


def test_demo_data_is_what_the_generator_writes(tmp_path: Path) -> None:
    import importlib.util

    gen = importlib.util.spec_from_file_location("make_demo_data", STUDIES / "make_demo_data.py")
    assert gen is not None and gen.loader is not None
    module = importlib.util.module_from_spec(gen)
    gen.loader.exec_module(module)
    for path in module.write(tmp_path, seed=0):
        assert path.read_bytes() == (STUDIES / "data" / path.name).read_bytes(), path.name
