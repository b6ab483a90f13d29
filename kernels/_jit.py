"""What every Triton kernel module of ``kernels`` shares: the interpreter flag, launches that turn into
compile-only warm-ups inside ``precompile``, and the context an autograd backward needs to see them.

Imported only by the kernel modules (``triton_lora``, ``triton_dropout``, ``triton_norm``,
``triton_swiglu``), which ``kernels`` loads on first use, after a test's ``TRITON_INTERPRET=1`` has been set.
"""

from __future__ import annotations

import importlib
import os
import re
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextvars import Context, ContextVar, copy_context
from pathlib import Path

import torch

try:  # the one guarded import of triton in the project (style guide habit 11): the kernel modules take it from here
    import triton
    import triton.language as tl
except ImportError as err:
    raise ImportError("kernels' Triton path needs triton: pip install 'lora-sweep[triton]'") from err

__all__ = ["INTERPRET", "MAX_COMBINE", "PRECOMPILE_THREADS", "SUM_COMBINE", "check_device", "hash_compiler_early",
           "kernel_cache_dir", "launch", "precompile", "use_kernel_cache", "warming", "warm_context", "run_in", "tl",
           "triton"]

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
"""Read once, as ``@triton.jit`` does when it decorates a kernel."""

SUM_COMBINE = tl.standard._sum_combine
"""``(a, b) -> a + b``, the combine of ``tl.sum``, for the kernels' ``tl.reduce`` sums (they call builtins only:
``tl.sum`` is jit'd, which the interpreter cannot run when triton was imported before ``TRITON_INTERPRET=1``).
Compiled, it is the same reduction as a combine of the module's own; the interpreter knows Triton's combines by
identity and reduces with one numpy call, where it applies any other combine element by element in Python (most of
a CPU test's Triton step went there)."""
MAX_COMBINE = tl.standard._elementwise_max
"""``(a, b) -> tl.maximum(a, b)``, the combine of ``tl.max``, for ``tl.reduce`` maxima (see ``SUM_COMBINE``)."""

PRECOMPILE_THREADS = max(1, min(16, len(os.sched_getaffinity(0))))
"""Threads compiling kernel variants at once in ``precompile``: one per CPU this process may run on, up to 16
(Triton's compiler releases the GIL in its MLIR passes, LLVM and ptxas, so they overlap)."""

_WARMING: ContextVar[list | None] = ContextVar("lora_kernels_warming", default=None)
"""Inside ``precompile``, the list of what the warm-ups compiled (None outside): launches become compile-only
warm-ups. A context variable does not reach other threads, and on CUDA autograd runs every backward on its own
device thread: each autograd Function of the kernel modules carries its forward's context over to its backward
(``warm_context``, ``run_in``), and Triton's ``AsyncCompileMode``, a context variable too, with it."""


_COMPILER_KEY: threading.Thread | None = None
"""The thread ``hash_compiler_early`` started (None: not started)."""


def hash_compiler_early() -> None:
    """Start computing Triton's compiler hash on a daemon thread; the process's first compile then finds it done.

    Every compile's cache key includes ``triton_key()``: a SHA-256 of Triton's own sources and of libtriton (~500 MB),
    computed once per process at the first compile or cache lookup (a measurable part of the first precompile:
    BENCHMARKS.md, "A GPU run's start-up and exit"). Reading and hashing in large blocks release the GIL, so on a thread
    it overlaps the Python work that comes before the first kernel (imports, loading the model). Off under the
    interpreter."""
    global _COMPILER_KEY
    if _COMPILER_KEY is not None or INTERPRET:
        return
    for where in ("triton.runtime.cache", "triton.compiler.compiler"):  # Triton 3.6 / earlier
        key = getattr(importlib.import_module(where), "triton_key", None)
        if callable(key) and hasattr(key, "cache_info"):  # lru_cached: the one computation every compile reuses
            _COMPILER_KEY = threading.Thread(target=key, name="triton-key", daemon=True)
            _COMPILER_KEY.start()
            return


def kernel_cache_dir(root: Path, device: torch.device) -> Path:
    """Where compiled kernels for ``device`` are kept under ``root``: ``triton/<triton version>/<device>``, the
    device named with its compute capability (``NVIDIA-H100-80GB-HBM3-sm90``; ``cpu`` for the interpreter).

    A kernel compiled by one Triton for one GPU is never looked up by another Triton or another GPU: an upgrade or a
    new card starts an empty folder instead of filling one shared folder with entries nobody reads again."""
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        name = f"{torch.cuda.get_device_name(device)}-sm{major}{minor}"
    else:
        name = device.type
    return root / "triton" / triton.__version__ / re.sub(r"[^A-Za-z0-9._-]+", "-", name)


def use_kernel_cache(root: Path, device: torch.device) -> Path:
    """Keep the compiled kernels in ``kernel_cache_dir(root, device)`` across runs (``TRITON_CACHE_DIR``) and
    return the folder in use: the user's ``TRITON_CACHE_DIR`` where one is set (theirs wins).

    Triton reads the variable at each compile and cache lookup (``triton.knobs.cache.dir``), so this works as long
    as it runs before the first kernel compiles; ``~/.triton/cache``, Triton's default, is keyed by nothing and
    lives outside the project's cache folder that ``$LORA_SWEEP_CACHE`` moves."""
    if os.environ.get("TRITON_CACHE_DIR"):
        return Path(os.environ["TRITON_CACHE_DIR"])
    folder = kernel_cache_dir(root, device)
    folder.mkdir(parents=True, exist_ok=True)
    os.environ["TRITON_CACHE_DIR"] = str(folder)  # inherited by the ranks a sharded pack launches
    return folder


def check_device(t: torch.Tensor, module: str) -> None:
    """Refuse ``t`` unless it is on CUDA or the interpreter is on (a kernel module's ``impl="triton"`` entry).

    Raises:
        RuntimeError: ``t`` is on the CPU and ``TRITON_INTERPRET=1`` was not set before ``module`` was imported.
    """
    if not t.is_cuda and not INTERPRET:
        raise RuntimeError(f"impl='triton' needs CUDA tensors (or TRITON_INTERPRET=1 set before {module} is "
                           "imported); use impl='auto' or 'torch' on the CPU")


def warming() -> bool:
    """Whether launches are warm-ups now (inside ``precompile``)."""
    return _WARMING.get() is not None


def launch(kernel: triton.runtime.JITFunction, grid: tuple[int, ...], *args: object, **kwargs: object) -> None:
    """``kernel[grid](*args, **kwargs)``; inside ``precompile`` a compile-only warm-up of that call instead (the
    outputs are left unwritten)."""
    warmed = _WARMING.get()
    if warmed is None:
        kernel[grid](*args, **kwargs)
    elif not INTERPRET:  # the interpreter compiles nothing
        warmed.append(kernel.warmup(*args, grid=grid, **kwargs))


def warm_context() -> Context | None:
    """For an autograd Function's forward to keep on its ``ctx``: a copy of the current context inside
    ``precompile`` (one per call: one thread enters each), else None."""
    return copy_context() if warming() else None


def run_in(context: Context | None, fn: Callable[..., object], *args: object) -> object:
    """``fn(*args)``, inside ``context`` when there is one (a backward of a forward run inside ``precompile``,
    perhaps on autograd's device thread: its launches are warm-ups too)."""
    return fn(*args) if context is None else context.run(fn, *args)


def precompile(run: Callable[[], object], threads: int = PRECOMPILE_THREADS) -> None:
    """Compile the kernel variants that ``run`` launches, ``threads`` at a time, and return when all are ready.

    ``run`` executes with every launch of the kernel modules replaced by a warm-up (the kernel's own ``warmup``: same
    arguments, so the same specialization, compiled and cached but not launched), so it should work on placeholder
    tensors whose values nobody reads. Without this, a step compiles its variants one after another as it reaches them:
    four or more on a cold cache, each taking seconds (BENCHMARKS.md, "A GPU run's start-up and exit"). Then the
    compiled kernels are loaded (``_load``), in parallel too.
    """
    try:  # Triton's own parallel compile: warm-ups inside the mode go to the executor
        from triton.runtime._async_compile import AsyncCompileMode
    except ImportError:  # an older Triton: the warm-ups still compile before the step, one after another
        AsyncCompileMode = None  # noqa: N806
    if _COMPILER_KEY is not None:
        _COMPILER_KEY.join()  # not a second computation of the same hash beside it
    warmed: list = []
    token = _WARMING.set(warmed)
    try:
        if AsyncCompileMode is None or INTERPRET:
            run()
        else:
            with ThreadPoolExecutor(threads, thread_name_prefix="triton-compile") as pool, AsyncCompileMode(pool):
                run()
    finally:
        _WARMING.reset(token)
    _load(warmed, threads)


def _load(warmed: list, threads: int) -> None:
    """Load what the warm-ups compiled, ``threads`` kernels at a time: each kernel's launcher and module.

    A warm-up compiles a kernel but does not load it; its first launch does (``CompiledKernel._init_handles``). Triton
    3.6 builds that launcher, a C extension per kernel signature, with the system C compiler, one after another in the
    first step on an empty cache (loading them here shortens a cold first step: BENCHMARKS.md, "A GPU run's start-up and
    exit"). The compiler runs in a subprocess, so threads overlap. A kernel that fails to load is left to its launch,
    which raises the same error where it belongs.
    """
    try:
        from triton.runtime._async_compile import FutureKernel
    except ImportError:
        FutureKernel = ()  # noqa: N806
    compiled = [w.result() if isinstance(w, FutureKernel) else w for w in warmed]
    unique = list({id(k): k for k in compiled if hasattr(k, "_init_handles")}.values())
    device = torch.cuda.current_device() if torch.cuda.is_available() else None

    def load(kernel: object) -> None:
        if device is not None:
            torch.cuda.set_device(device)  # a new thread's current device is 0
        try:
            kernel._init_handles()  # type: ignore[attr-defined]
        except Exception:  # noqa: BLE001, S110  (the launch raises it again; see the docstring)
            pass

    if unique:
        with ThreadPoolExecutor(threads, thread_name_prefix="triton-load") as pool:
            list(pool.map(load, unique))
