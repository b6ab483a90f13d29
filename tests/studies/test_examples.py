"""Every study file under studies/ (recursively) loads and validates.

Run: python -m pytest tests/studies -q
"""

from __future__ import annotations

from pathlib import Path

import pytest

from sweep.spec import load_study

STUDIES = Path(__file__).resolve().parents[2] / "studies"
FILES = sorted(STUDIES.rglob("*.yaml"))


def test_there_are_example_studies() -> None:
    assert len(FILES) > 0


@pytest.mark.parametrize("path", FILES, ids=[str(p.relative_to(STUDIES)) for p in FILES])
def test_example_study_validates(path: Path) -> None:
    # check_paths=False: local models (models/tiny-llama) are built by `python -m packer.tiny`; data files are checked.
    spec = load_study(path, check_paths=False)
    assert spec.search.params and spec.data.train.is_file()
    assert spec.data.eval is None or spec.data.eval.is_file()


def test_demo_is_the_readme_demo() -> None:
    spec = load_study(STUDIES / "demo.yaml", check_paths=False)
    assert [(o.metric, o.direction) for o in spec.objectives] == [
        ("eval_loss", "minimize"),
        ("adapter_params", "minimize"),
    ]
    assert spec.search.param("rank").choices == (2, 4, 8, 16, 32)
    assert {"alpha_ratio", "lr", "dropout", "targets"} <= {p.name for p in spec.search.params}
    assert spec.budget.trials is not None and spec.budget.trials >= 24
    assert spec.packing.max_slots == 8 and spec.pruning.kind == "cohort_sha"
    assert [e.name for e in spec.evaluators] == ["heldout_loss", "generation"]
    assert spec.model.path == str((STUDIES.parent / "models" / "tiny-llama").resolve())
