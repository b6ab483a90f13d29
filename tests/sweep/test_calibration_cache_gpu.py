"""On CUDA, as on the CPU: a second ``sweep plan`` reads the calibration and the base's shape from the cache and loads
no weights (the key names the GPU; the memory is the allocator's peak) (H200 only)."""

from __future__ import annotations

import re

import pytest
import torch

from tests.conftest import write_study
from tests.helpers import refuse_model_loads

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_a_cached_plan_on_cuda_loads_no_weights(tiny_dirs, tmp_path, monkeypatch) -> None:
    from click.testing import CliRunner

    from lora_sweep.cli import cli

    monkeypatch.setenv("LORA_SWEEP_CACHE", str(tmp_path / "cache"))
    model = {"path": str(tiny_dirs("llama")), "device": "cuda"}
    path = write_study(tmp_path, tiny_dirs("llama"), "cuda-plan", model=model, budget={"trials": 4})
    first = CliRunner().invoke(cli, ["plan", str(path)])
    assert first.exit_code == 0, first.output
    assert "calibrating the memory model on cuda" in first.output

    refuse_model_loads(monkeypatch)
    second = CliRunner().invoke(cli, ["plan", str(path)])
    assert second.exit_code == 0, second.output

    def rows(text: str) -> dict[str, str]:
        return dict(re.split(r"\s{2,}", line, maxsplit=1) for line in text.splitlines())

    a, b = rows(first.stdout), rows(second.stdout)
    assert b["calibration"].startswith("cached (") and a["device"] == b["device"] == "cuda"
    for key in ("slots per pack", "predicted peak of a full pack", "frozen (base model)", "predicted step"):
        assert a[key] == b[key], key
    # the sized pack is timed on the run's step, the CUDA graph, once: the second plan reads it back
    assert re.fullmatch(r"mean of \d+ steps of \d+ slots x \d+ rows x \d+ tokens, cuda-graph step, after 1 warm-up "
                        r"and a turnover; measured in .*", a["sized pack's step"]), a
    assert b["sized pack's step"].startswith("cached (")


def test_a_plan_and_a_runs_pack_share_one_cuda_key(tiny_dirs, tmp_path) -> None:
    """``sweep plan`` resolves ``model.device: auto`` to ``cuda``, a run's pack sits on ``cuda:0``: one calibration."""
    from lora_sweep.sweep.calibration import calibration_key
    from lora_sweep.sweep.config.loader import load_study

    spec = load_study(write_study(tmp_path, tiny_dirs("llama"), "cuda-key"))
    assert calibration_key(spec, "cuda") == calibration_key(spec, "cuda:0")
    assert calibration_key(spec, "cuda")["device"] == f"cuda {torch.cuda.get_device_name(0)}"
