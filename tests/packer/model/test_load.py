"""The load straight onto the device (``packer.model.load.load_base``: ``from_pretrained`` with a ``device_map``,
the tokenizer on a thread): every tiny family's checkpoint gives exactly what the load onto the CPU and then ``.to``
gave (parameters, buffers such as rotary ``inv_freq`` and position tables, the tied head, dtypes, config), and no
weight is initialised on the way."""

from __future__ import annotations

import itertools
import json
import random
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch.overrides import TorchFunctionMode
from transformers import AutoConfig, AutoModelForCausalLM

from lora_sweep.errors import UserError
from lora_sweep.packer.model.load import LOAD_PARTS, load_base
from lora_sweep.packer.tiny.models import FAMILIES
from tests.damage import judge, model_cases

INIT_OPS = {"normal_", "uniform_", "fill_", "zero_", "trunc_normal_", "random_", "exponential_", "bernoulli_",
            "orthogonal_", "kaiming_uniform_", "kaiming_normal_", "xavier_uniform_", "xavier_normal_"}
"""In-place ops an initialisation writes a weight with (torch.nn.init's functions end in these)."""


class CountInits(TorchFunctionMode):
    """Counts in-place initialising ops on real (not meta) parameters: what a second initialisation costs."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        name = getattr(func, "__name__", "")
        if name in INIT_OPS and args and isinstance(args[0], torch.nn.Parameter) and not args[0].is_meta:
            self.calls.append(name)
        return func(*args, **(kwargs or {}))


def _reference(path: Path, dtype: torch.dtype | str) -> torch.nn.Module:
    """The load as it was: transformers' ``from_pretrained`` in ``dtype`` onto the CPU, then ``.to`` the device."""
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to("cpu")


def _assert_same(mine: torch.nn.Module, theirs: torch.nn.Module) -> None:
    """Bit-identical parameters and buffers (persistent or not) with their dtypes, the same tying, config, mode."""
    for kind in ("named_parameters", "named_buffers"):
        a = dict(getattr(mine, kind)(remove_duplicate=False))
        b = dict(getattr(theirs, kind)(remove_duplicate=False))
        assert a.keys() == b.keys(), kind
        for key, tensor in b.items():
            assert a[key].dtype == tensor.dtype and torch.equal(a[key], tensor), key
            assert a[key].requires_grad == tensor.requires_grad, key
    head, embed = theirs.get_output_embeddings(), theirs.get_input_embeddings()
    tied = head is not None and head.weight is embed.weight
    assert (mine.get_output_embeddings().weight is mine.get_input_embeddings().weight) == tied
    assert mine.config.to_dict() == theirs.config.to_dict()
    assert mine.generation_config.to_dict() == theirs.generation_config.to_dict()
    assert not mine.training and type(mine) is type(theirs) and not hasattr(mine, "hf_device_map")


@pytest.mark.parametrize("family", FAMILIES)
def test_the_direct_load_gives_from_pretrained_weights_bit_for_bit(family: str, tiny_dirs: Callable[[str], Path]
                                                                  ) -> None:
    path = tiny_dirs(family)
    for dtype in ("float32", "bfloat16"):
        split: dict[str, float] = {}
        mine, tokenizer = load_base(str(path), dtype=dtype, split=split)
        assert set(split) == set(LOAD_PARTS), split
        _assert_same(mine, _reference(path, getattr(torch, dtype)))
        assert len(tokenizer) > 0


@pytest.mark.parametrize("family", ["llama", "gpt2", "gemma"])  # untied with rotary; tied, learned positions; tied
def test_no_weight_is_initialised_on_the_direct_load(family: str, tiny_dirs: Callable[[str], Path]) -> None:
    path = tiny_dirs(family)
    with CountInits() as counted:  # the counter sees a plain build's initialisation
        AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
    assert counted.calls
    with CountInits() as counted:
        load_base(str(path), dtype="bfloat16")
    assert counted.calls == []


def test_a_sharded_checkpoint_in_another_dtype_is_read_and_cast(tiny_dirs: Callable[[str], Path],
                                                                tmp_path: Path) -> None:
    """Two shards in bfloat16 loaded as float32 and as ``auto`` (the config's bfloat16): the shards' union, cast."""
    source = tiny_dirs("llama")
    out = tmp_path / "sharded"
    shutil.copytree(source, out)
    weights = load_file(out / "model.safetensors")
    (out / "model.safetensors").unlink()
    keys = sorted(weights)
    shards = {"model-00001-of-00002.safetensors": keys[::2], "model-00002-of-00002.safetensors": keys[1::2]}
    for name, part in shards.items():
        save_file({k: weights[k].to(torch.bfloat16) for k in part}, out / name, metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": {k: name for name, part in shards.items() for k in part}}
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "dtype": "bfloat16"}))
    for dtype, want in (("float32", torch.float32), ("auto", torch.bfloat16)):
        mine, _ = load_base(str(out), dtype=dtype)
        _assert_same(mine, _reference(out, "auto" if dtype == "auto" else want))
        assert mine.model.embed_tokens.weight.dtype == want
        assert torch.equal(mine.model.embed_tokens.weight, weights["model.embed_tokens.weight"].to(torch.bfloat16)
                           .to(want))


def test_a_model_the_checkpoint_does_not_fill_says_so(tiny_dirs: Callable[[str], Path], tmp_path: Path) -> None:
    """A directory without weights is a one-line user error naming it, after the tokenizer's thread ended."""
    out = tmp_path / "empty"
    shutil.copytree(tiny_dirs("llama"), out)
    (out / "model.safetensors").unlink()
    with pytest.raises(UserError, match=f"{out}: cannot load model"):
        load_base(str(out))


DAMAGED_CONFIGS = [
    ({"num_hidden_layers": 100000}, "config.json: num_hidden_layers is 100000, but the weights hold 2"),
    ({"num_hidden_layers": 0}, "config.json: num_hidden_layers is 0: a model has at least 1 layer"),
    ({"hidden_size": "x"}, "config.json: StrictDataclassFieldValidationError: Validation error for field "
                           "'hidden_size': TypeError: Field 'hidden_size' expected int, got str"),
    ({"num_attention_heads": 0}, "config.json: ZeroDivisionError: integer modulo by zero"),
    ({"rope_scaling": {"type": "weird"}}, "KeyError: 'weird'"),
    ({"hidden_act": "x"}, "KeyError: "),
]
"""A damaged or hand-edited config.json, and the line it ends in (the first two were a build of 100,000 layers, minutes
of it, and a model without layers; the others, tracebacks from transformers' config classes and model code)."""


@pytest.mark.parametrize(("change", "said"), DAMAGED_CONFIGS, ids=[next(iter(c)) + "=" + str(next(iter(c.values())))
                                                                   for c, _ in DAMAGED_CONFIGS])
def test_a_damaged_config_is_one_line_at_once(tiny_dirs: Callable[[str], Path], tmp_path: Path, change: dict,
                                              said: str) -> None:
    out = tmp_path / "damaged"
    shutil.copytree(tiny_dirs("llama"), out)
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, **change}))
    started = time.monotonic()
    with pytest.raises(UserError) as err:
        load_base(str(out))
    assert str(err.value).startswith(f"{out}: cannot load model: ") and said in str(err.value), str(err.value)
    assert "\n" not in str(err.value) and time.monotonic() - started < 5


@pytest.mark.parametrize("damage", ["a torn header", "an index that is no mapping"])
def test_damaged_weights_are_one_line_before_a_model_is_built(tiny_dirs: Callable[[str], Path], tmp_path: Path,
                                                               damage: str) -> None:
    out = tmp_path / "damaged"
    shutil.copytree(tiny_dirs("llama"), out)
    if damage == "a torn header":
        weights = (out / "model.safetensors").read_bytes()
        (out / "model.safetensors").write_bytes(weights[:8] + b"{\xff" + weights[10:])
    else:
        (out / "model.safetensors.index.json").write_text("[1, 2]")
    with pytest.raises(UserError, match=rf"^{out}: cannot load model: its weights' header: \w+Error: ") as err:
        load_base(str(out))
    assert "\n" not in str(err.value)


def test_randomly_damaged_checkpoints_are_one_line_each(tmp_path: Path) -> None:
    """60 seeded random damages of a tiny Llama checkpoint's config.json and weights (a sample of ``python -m
    tests.damage model``, which found the cases above): each loads or is one ``UserError`` line, within 10 s."""
    for path, run in itertools.islice(model_cases(tmp_path, random.Random(0)), 60):
        assert judge(run, 10.0) is None, (path / "config.json").read_text()


@pytest.mark.gpu
def test_the_weights_go_straight_to_the_gpu_as_they_are_on_the_cpu(tiny_dirs: Callable[[str], Path]) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    path = tiny_dirs("llama")
    mine, _ = load_base(str(path), dtype="bfloat16", device="cuda")
    assert {t.device.type for t in (*mine.parameters(), *mine.buffers())} == {"cuda"}
    assert not hasattr(mine, "hf_device_map")  # whole on one device: nothing for PEFT to dispatch again
    _assert_same(mine.to("cpu"), _reference(path, torch.bfloat16))
