"""``precompile``: a call run inside it launches nothing and warms exactly the kernel variants the same call
launches for real; on a GPU the real call then compiles nothing more."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
import torch

from tests.conftest import need_triton

need_triton()  # before anything imports the Triton kernel modules

import lora_sweep.kernels._jit as J  # noqa: E402
import lora_sweep.kernels.triton_segments as K  # noqa: E402
from lora_sweep.kernels._launch import build_meta  # noqa: E402
from lora_sweep.kernels.ops import LayerRanks, PackLayout, packed_lora_eval_linear  # noqa: E402
from tests.conftest import record_launches  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = torch.device("cuda" if torch.cuda.is_available() and not INTERPRET else "cpu")
DTYPE = torch.float32 if DEVICE.type == "cpu" else torch.bfloat16  # the interpreter's tl.dot needs fp32


def _layer_call(seed: int, fill: float | None = None):  # type: ignore[no-untyped-def]
    """A packed linear layer's forward and backward: 3 slots (one rank-0), dropout, a bias."""
    layout = PackLayout((0, 1, 2), (0, 2, 3), (2, 1, 2), (5, 6, 7), (0.0, 0.25, 0.0), (0, 0, 0))
    ranks = LayerRanks((4, 0, 8), (2.0, 0.0, 1.0), layer_id=1)
    g = torch.Generator().manual_seed(seed)
    x, w, b = (torch.randn(shape, generator=g).to(DEVICE, DTYPE) for shape in ((5, 6, 24), (40, 24), (40,)))
    a_cat = torch.randn(12, 24, generator=g).to(DEVICE).requires_grad_()
    bt_cat = torch.randn(12, 40, generator=g).to(DEVICE).requires_grad_()
    x.requires_grad_()

    def run() -> torch.Tensor:
        y = packed_lora_eval_linear(x, w, b, a_cat, bt_cat, layout, ranks, impl="triton")
        y.backward(torch.ones_like(y))
        return y

    return run, (a_cat, bt_cat)


def test_precompile_warms_what_the_call_launches_and_launches_nothing(monkeypatch) -> None:
    calls = record_launches(monkeypatch)
    warm_run, leaves = _layer_call(0)
    J.precompile(warm_run)
    real_run, _ = _layer_call(0)
    real_run()
    warm = {v for inside, v in calls if inside}
    real = {v for inside, v in calls if not inside}
    assert real and warm == real, (warm ^ real)
    # nothing ran inside: the weight-gradient kernel's result is the zeros it was allocated as
    assert all(torch.count_nonzero(t.grad) == 0 for t in leaves)
    layout = PackLayout((0,), (0,), (2,), (5,), (0.0,), (0,))
    meta = build_meta(layout, LayerRanks((4,), (1.0,), 0), 10, 5, DEVICE)
    dst = torch.full((10, 40), 7.0, device=DEVICE, dtype=DTYPE)
    J.precompile(lambda: K.seg_expand_add(torch.ones(10, meta.r_cols, device=DEVICE), torch.ones(4, 40, device=DEVICE),
                                          meta, dst, src=None, dropout=False))
    assert bool((dst == 7.0).all())


def test_a_backward_on_another_thread_is_warmed_too(monkeypatch) -> None:
    """On CUDA autograd runs every backward on its own device thread, which a context variable set around the
    forward does not reach: here a plain thread runs the backward, as that one does (found on the H200, where
    the backward's kernels were launched for real inside ``precompile`` and compiled one by one)."""
    calls = record_launches(monkeypatch)
    layout = PackLayout((0, 1), (0, 2), (2, 1), (5, 6), (0.0, 0.25), (0, 0))
    x = torch.randn(3, 6, 24, device=DEVICE, dtype=DTYPE, requires_grad=True)
    w = torch.randn(40, 24, device=DEVICE, dtype=DTYPE)
    a_cat = torch.randn(12, 24, device=DEVICE).requires_grad_()
    bt_cat = torch.randn(12, 40, device=DEVICE).requires_grad_()

    def run() -> None:
        y = packed_lora_eval_linear(x, w, None, a_cat, bt_cat, layout, LayerRanks((4, 8), (2.0, 1.0), 0), impl="triton")
        worker = threading.Thread(target=y.backward, args=(torch.ones_like(y),))
        worker.start()
        worker.join()

    J.precompile(run)
    assert len(calls) >= 6 and all(inside for inside, _ in calls), calls  # 2 forward + 4 backward launches
    assert torch.count_nonzero(a_cat.grad) == 0 and torch.count_nonzero(bt_cat.grad) == 0


def test_precompile_loads_what_the_warm_ups_compiled_on_other_threads(monkeypatch) -> None:
    """A warm-up compiles a kernel without loading it; its first launch would load it, which on Triton 3.6
    builds a C launcher with the system compiler, one after another (on the H200 that cost the cold W3 first
    step 1.8 s). ``precompile``
    loads each compiled kernel once, in its own threads. Stand-ins here: the interpreter compiles nothing."""
    monkeypatch.setattr(J, "INTERPRET", False)
    loads: list[str] = []

    class Compiled:
        def _init_handles(self) -> None:
            loads.append(threading.current_thread().name)

    one = Compiled()

    class Kernel:
        def warmup(self, *args: object, grid: tuple, **kwargs: object) -> Compiled:
            return one if args[0] == 0 else Compiled()

    J.precompile(lambda: [J.launch(Kernel(), (1,), i % 2) for i in range(4)])
    assert len(loads) == 3  # two warm-ups of one variant load it once
    assert all(name.startswith("triton-load") for name in loads)


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE.type != "cuda", reason="needs CUDA (compiled Triton)")
def test_after_precompile_the_call_compiles_and_loads_nothing() -> None:
    kernels = (K._seg_shrink_kernel, K._seg_expand_kernel, K._seg_wgrad_kernel)
    device = torch.cuda.current_device()
    J.precompile(_layer_call(1)[0])
    sizes = [len(k.device_caches[device][0]) for k in kernels]
    assert all(c.module is not None for k in kernels for c in k.device_caches[device][0].values())
    _layer_call(1)[0]()
    assert [len(k.device_caches[device][0]) for k in kernels] == sizes


def test_the_compiler_hash_starts_on_a_thread_and_precompile_waits_for_it(monkeypatch) -> None:
    """``hash_compiler_early`` computes Triton's lru-cached compiler key on a daemon thread (the interpreter
    compiles nothing: off there); ``precompile`` joins that thread rather than hash beside it."""
    import importlib

    from lora_sweep.packer.model.load import prepare_kernels

    key = next(f for f in (getattr(importlib.import_module(m), "triton_key", None)
                           for m in ("triton.runtime.cache", "triton.compiler.compiler")) if callable(f))
    monkeypatch.setattr(J, "_COMPILER_KEY", None)
    monkeypatch.setattr(J, "INTERPRET", True)
    prepare_kernels("auto", "cpu")  # the CPU runs no Triton kernels by default: nothing starts
    prepare_kernels("triton", "cpu")  # the interpreter: nothing to hash for
    assert J._COMPILER_KEY is None
    monkeypatch.setattr(J, "INTERPRET", False)
    key.cache_clear()
    prepare_kernels("triton", "cpu")
    started = J._COMPILER_KEY
    assert isinstance(started, threading.Thread) and started.daemon and started.name == "triton-key"
    joined = []
    monkeypatch.setattr(started, "join", lambda: (joined.append(True), threading.Thread.join(started)))
    J.precompile(lambda: None)
    assert joined and not started.is_alive() and key.cache_info().currsize == 1
    prepare_kernels("triton", "cpu")
    assert J._COMPILER_KEY is started, "once per process"


def _no_user_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_CACHE_DIR", "unset")  # recorded, so the test's own setting is undone after it
    monkeypatch.delenv("TRITON_CACHE_DIR")


def test_the_kernel_cache_is_keyed_by_triton_and_the_device(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import triton

    assert J.kernel_cache_dir(tmp_path, torch.device("cpu")) == tmp_path / "triton" / triton.__version__ / "cpu"
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    h100 = J.kernel_cache_dir(tmp_path, torch.device("cuda"))
    assert h100 == tmp_path / "triton" / triton.__version__ / "NVIDIA-H100-80GB-HBM3-sm90"
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (10, 0))
    assert J.kernel_cache_dir(tmp_path, torch.device("cuda")) != h100  # another card, another folder
    monkeypatch.setattr(triton, "__version__", "99.0.0")
    assert J.kernel_cache_dir(tmp_path, torch.device("cpu")).parent.name == "99.0.0"


def test_the_users_triton_cache_dir_wins(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "mine"))
    assert J.use_kernel_cache(tmp_path / "root", torch.device("cpu")) == tmp_path / "mine"
    assert os.environ["TRITON_CACHE_DIR"] == str(tmp_path / "mine") and not (tmp_path / "root").exists()
    _no_user_cache(monkeypatch)
    folder = J.use_kernel_cache(tmp_path / "root", torch.device("cpu"))
    assert folder == J.kernel_cache_dir(tmp_path / "root", torch.device("cpu")) and folder.is_dir()
    assert os.environ["TRITON_CACHE_DIR"] == str(folder)


_RUN = """
import sys, torch
from pathlib import Path
from lora_sweep.packer.model.load import prepare_kernels
from lora_sweep.store.api import cache_dir
from triton.runtime.cache import get_cache_manager
folder = prepare_kernels("triton", "cpu", cache_dir())
cache = get_cache_manager("ab" * 32)  # a kernel's hash
found = cache.get_file("kernel.bin")
if found is None:
    cache.put(b"compiled", "kernel.bin", binary=True)
print(folder, found)
"""


def test_a_second_run_finds_what_the_first_compiled(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Two processes (runs) with the same ``$LORA_SWEEP_CACHE``: the first run's entry, put where Triton's cache
    manager puts a compiled kernel, is what the second run's lookup finds, under that root's keyed folder."""
    import subprocess
    import sys

    _no_user_cache(monkeypatch)
    monkeypatch.setenv("LORA_SWEEP_CACHE", str(tmp_path / "cache"))
    runs = []
    for _ in range(2):
        done = subprocess.run([sys.executable, "-c", _RUN], capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
        runs.append(done.stdout.split())
    folder = J.kernel_cache_dir(tmp_path / "cache", torch.device("cpu"))
    assert runs[0] == [str(folder), "None"]
    assert runs[1][0] == str(folder) and Path(runs[1][1]).is_relative_to(folder)
    assert Path(runs[1][1]).read_bytes() == b"compiled"
