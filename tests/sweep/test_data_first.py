"""A bad data row is reported before the base model loads (``sweep run`` and ``sweep plan``)."""

from __future__ import annotations

import pytest

from lora_sweep.errors import DataError
from lora_sweep.sweep.config.loader import load_study
from lora_sweep.sweep.study import run_study
from tests.conftest import write_study


@pytest.mark.parametrize("which", ["train", "eval"])
def test_a_bad_row_fails_before_the_model_loads(tiny_dirs, tmp_path, monkeypatch, which: str) -> None:
    import lora_sweep.packer.model.load as load

    def no_load(*a, **k):  # noqa: ANN002, ANN003, ANN202
        raise AssertionError("the model was loaded before the data was checked")

    monkeypatch.setattr(load, "load_base", no_load)  # what open_base calls, for `sweep run` and `sweep plan` alike
    bad = tmp_path / f"bad-{which}.jsonl"
    bad.write_text('{"prompt": "1+1=", "completion": "2"}\n{"prompt": "2+2=", "completion": 4}\n')
    path = write_study(tmp_path, tiny_dirs("llama"), name="bad-data")
    spec = load_study(path, [f"data.{which}={bad}"])
    with pytest.raises(DataError, match=rf"bad-{which}.jsonl:2: "):
        run_study(spec, log=lambda m: None)
    from click.testing import CliRunner

    from lora_sweep.cli import cli

    planned = CliRunner().invoke(cli, ["plan", str(path), f"data.{which}={bad}"])
    assert isinstance(planned.exception, DataError) and f"bad-{which}.jsonl:2: " in str(planned.exception)
