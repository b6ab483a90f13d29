"""Shared fixtures: tiny models built in code, saved and loaded back like a user's checkpoint; skipping a test for
want of what the README's install does not give (an extra, a system package, a server), and the record of those
skips that CI's second environment runs again."""

from __future__ import annotations

import importlib.util
import os
import signal
import tempfile
from pathlib import Path
from typing import NoReturn

import pytest
import torch
import yaml

from lora_sweep.packer.tiny.models import build_tiny_model
from lora_sweep.testing.variant import Recorder, random_examples  # noqa: F401  (the suite's, shared)

torch.set_num_threads(1)  # tiny models gain nothing from threads; one keeps timings stable
# A test run started from a script's background job (`cmd &`, no job control) inherits SIGINT ignored, and so would
# every `sweep` process a test starts (an ignored signal stays ignored across exec): the tests that press Ctrl-C on
# one would see it ignored. A handler of this process's own is reset to the default in each child it starts.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)
# calibrations are cached (sweep.planning.cache_dir): the tests' own, not the user's, shared by their subprocesses
os.environ.setdefault("LORA_SWEEP_CACHE", tempfile.mkdtemp(prefix="lora-sweep-test-cache-"))


PACKAGE_FOLDERS = ("sweep", "store", "packer", "kernels", "evaluators", "reports", "benchmarks", "testing")
"""The design card's top-level folders, each the namespace package ``lora_sweep.<folder>`` (no ``__init__.py``)."""

REQUIRE_ALL = bool(os.environ.get("LORA_SWEEP_REQUIRE_EXTRAS"))
"""Set by CI's second environment (.ci/run: every extra, Chromium, the database servers): there a test that would
skip for want of one of them fails instead."""


def missing(what: str, hint: str) -> NoReturn:
    """Skip the calling test (or, at a module's top, the module) for want of ``what``, which the README's install
    does not give, with ``hint`` saying how to get it; fail where ``REQUIRE_ALL`` says it must be there."""
    if REQUIRE_ALL:
        pytest.fail(f"{what} is missing in CI's full environment: {hint}")
    pytest.skip(f"{what} is missing: {hint}", allow_module_level=True)


def need_module(module: str, extra: str) -> None:
    """Skip (see ``missing``) unless ``module`` of the optional extra ``extra`` is installed."""
    if importlib.util.find_spec(module) is None:
        missing(f"the {extra} extra ({module})", f"pip install 'lora-sweep[{extra}]'")


def need_triton() -> None:
    """Call at the top of a test module that runs the Triton kernels, before anything imports them: without CUDA
    they run in the interpreter (``TRITON_INTERPRET`` is read when a kernel is decorated); without triton the
    module is skipped, naming the extra."""
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    need_module("triton", "triton")


def _record_skip(report: pytest.CollectReport | pytest.TestReport) -> None:
    """With LORA_SWEEP_SKIPPED=FILE, each skipped test's (or module's) id is added to FILE, one a line: CI's second
    environment runs exactly those (``pytest @FILE``), so every test runs once with what it needs."""
    out = os.environ.get("LORA_SWEEP_SKIPPED")
    if out and report.skipped:
        with open(out, "a") as f:
            f.write(report.nodeid + "\n")


def pytest_collectreport(report: pytest.CollectReport) -> None:
    _record_skip(report)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.when == "setup" or report.when == "call":
        _record_skip(report)


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory: pytest.TempPathFactory):
    """family -> directory of a saved tiny model (built once per test session)."""
    cache: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in cache:
            cache[family] = build_tiny_model(family, tmp_path_factory.mktemp(f"tiny-{family}"), seed=0)
        return cache[family]

    return get


def add_slots_random_b(pm, specs: dict, seed: int = 2):  # noqa: ANN001, ANN201
    """Add every slot of ``specs`` ({slot: AdapterSpec}) to ``pm`` with its B drawn at random (PEFT's zero init
    would leave B's gradient alone to check); returns ``pm``."""
    gen = torch.Generator().manual_seed(seed)
    for slot, spec in specs.items():
        pm.add_slot(slot, spec)
        with torch.no_grad():
            for _, b in pm.slot_weights(slot).values():
                b.copy_(torch.randn(b.shape, generator=gen) * 0.2)
    return pm


def load_adapter(pm, slot: int, adapter_dir: Path) -> None:  # noqa: ANN001
    """Copy a saved PEFT adapter's weights into ``slot`` of ``pm`` (added with the adapter's spec beforehand): an
    exported or saved adapter back in a pack, to compare its logits with PEFT's."""
    from lora_sweep.packer.model.checkpoint import read_adapter

    _, tensors = read_adapter(adapter_dir)
    weights = pm.slot_weights(slot)
    assert set(tensors) == {f"base_model.model.{p}.lora_{n}.weight" for p in weights for n in "AB"}, adapter_dir
    with torch.no_grad():
        for path, (a, b) in weights.items():
            a.copy_(tensors[f"base_model.model.{path}.lora_A.weight"])
            b.copy_(tensors[f"base_model.model.{path}.lora_B.weight"])


DEMO_DATA = Path(__file__).resolve().parents[1] / "studies" / "data"


def optuna_study(out: Path, name: str):  # noqa: ANN201
    """The Optuna study a run left in study directory ``out``, from its default storage (``StudyDir.optuna_url``)."""
    import optuna

    from lora_sweep.store.api import StudyDir
    from lora_sweep.store.storage import open_storage

    return optuna.load_study(study_name=name, storage=open_storage(StudyDir(out).optuna_url))


def write_study(tmp_path: Path, model_dir: Path, name: str = "small", **changes) -> Path:
    """A small CPU study file (6 trials of 12 steps, 3 slots, cohort SHA at step 6) with top-level
    sections replaced by ``changes``; written to ``tmp_path/<name>.yaml``, output ``runs-<name>``."""
    doc = {
        "name": name,
        "seed": 0,
        "model": {"path": str(model_dir), "device": "cpu"},
        "data": {"train": str(DEMO_DATA / "arith-train.jsonl"), "eval": str(DEMO_DATA / "arith-eval.jsonl"),
                 "format": "prompt_completion", "max_length": 48},
        "search": {"rank": [2, 4, 8, 16], "lr": {"low": 1e-4, "high": 3e-2, "log": True},
                   "targets": {"attn": ["q_proj", "v_proj"], "all": "all-linear"}},
        "train": {"max_steps": 12, "micro_batch": 4},
        "objectives": [{"metric": "eval_loss", "direction": "minimize"},
                       {"metric": "adapter_params", "direction": "minimize"}],
        "budget": {"trials": 6},
        "pruning": {"kind": "cohort_sha", "rungs": [6], "reduction_factor": 2},
        "pack": {"max_slots": 3},
        "evaluators": [{"name": "heldout_loss"}, {"name": "generation", "options": {"max_new_tokens": 4}}],
        "output": str(tmp_path / f"runs-{name}"),
        **changes,
    }
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def record_launches(monkeypatch: pytest.MonkeyPatch) -> list[tuple[bool, tuple]]:
    """(inside ``kernels.ops.precompile``, variant) of every Triton kernel launch from now on; a variant is what
    decides a compiled kernel short of integer specialization: kernel, tensor dtypes, constexprs. Imports
    ``kernels._jit``: call it after ``TRITON_INTERPRET`` is settled."""
    import lora_sweep.kernels._jit as J

    calls: list[tuple[bool, tuple]] = []
    launch = J.launch

    def recording(kernel, grid, *args, **kwargs):  # type: ignore[no-untyped-def]
        variant = (kernel.fn.__name__, tuple(str(a.dtype) for a in args if torch.is_tensor(a)),
                   tuple(sorted((k, str(v)) for k, v in kwargs.items())))
        calls.append((J.warming(), variant))
        launch(kernel, grid, *args, **kwargs)

    monkeypatch.setattr(J, "launch", recording)
    return calls
