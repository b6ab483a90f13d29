"""lora-sweep: hyperparameter sweeps for LoRA adapters, many trials packed into one training run.

The import package is ``lora_sweep``; its directory is the checkout's root, whose folders install as
``lora_sweep.sweep``, ``lora_sweep.packer``, ``lora_sweep.kernels``, ``lora_sweep.evaluators``,
``lora_sweep.reports`` and ``lora_sweep.benchmarks`` (pyproject.toml's ``package-dir``). The public API::

    import lora_sweep

    spec = lora_sweep.load_study("study.yaml", ["budget.trials=8"], out="runs/demo")
    summary = lora_sweep.run(spec)
    results = lora_sweep.open_results("runs/demo")
    results.best_trials()                 # the feasible Pareto front (one trial for one objective)
    lora_sweep.export("runs/demo", "adapter/", best=True)
    lora_sweep.write_report("runs/demo")

Importing ``lora_sweep`` is light: the API's names load on first use (PEP 562), so ``import lora_sweep.packer``
on a machine without optuna or plotly works.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import os
import sys
from pathlib import Path
from typing import Any

__version__ = "0.1.0"

FOLDERS = ("sweep", "packer", "kernels", "evaluators", "reports", "benchmarks")
"""The checkout's package folders: each installs below ``lora_sweep``, never as a top-level name."""


class _CheckoutRoot:
    """The path-entry finder of a checkout's root: every module there but the six package folders.

    From the checkout's root, ``python -m ...`` and ``python -m pytest`` put the root on ``sys.path``, where
    ``kernels/`` would shadow Hugging Face's installed ``kernels`` (and ``sweep/`` a ``sweep`` distribution)
    for transformers and everyone else. For those six names this finder finds nothing, so the import
    system goes on down ``sys.path``: an installed distribution of that name is found, a missing one is
    missing (``importlib.util.find_spec`` answers None), and neither is ours.
    """

    _LOADERS = ((importlib.machinery.ExtensionFileLoader, importlib.machinery.EXTENSION_SUFFIXES),
                (importlib.machinery.SourceFileLoader, importlib.machinery.SOURCE_SUFFIXES),
                (importlib.machinery.SourcelessFileLoader, importlib.machinery.BYTECODE_SUFFIXES))

    def __init__(self, path: str) -> None:
        self._files = importlib.machinery.FileFinder(path, *self._LOADERS)

    def find_spec(self, name: str, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        return None if name in FOLDERS else self._files.find_spec(name, target)

    def invalidate_caches(self) -> None:
        self._files.invalidate_caches()


def _guard_checkout() -> None:
    """In a checkout (not an installed wheel), route ``sys.path`` entries that are its root through
    ``_CheckoutRoot``, before any other path hook, whenever they are first searched."""
    root = Path(__file__).resolve().parent
    if not (root / "pyproject.toml").is_file():
        return

    def hook(entry: str) -> _CheckoutRoot:
        try:
            if Path(entry).resolve() == root:
                return _CheckoutRoot(entry)
        except OSError:
            pass
        raise ImportError  # not the root: the next hook's

    sys.path_hooks.insert(0, hook)
    for entry in [e for e in sys.path_importer_cache if e and os.path.isdir(e)]:
        if Path(entry).resolve() == root:
            del sys.path_importer_cache[entry]  # found before this import: searched afresh, through the hook


_guard_checkout()

_API = {
    "load_study": "lora_sweep.sweep.api",
    "run": "lora_sweep.sweep.api",
    "open_results": "lora_sweep.sweep.api",
    "Results": "lora_sweep.sweep.api",
    "export": "lora_sweep.sweep.api",
    "write_report": "lora_sweep.sweep.api",
    "examples": "lora_sweep.sweep.api",
    "copy_example": "lora_sweep.sweep.api",
    "StudySpec": "lora_sweep.sweep.spec",
    "RunSummary": "lora_sweep.sweep.study",
    "TrialRecord": "lora_sweep.sweep.store",
    "UserError": "lora_sweep.packer.errors",
    "ConfigError": "lora_sweep.packer.errors",
}

__all__ = [*_API, "__version__"]



def __getattr__(name: str) -> Any:
    if name in _API:
        value = getattr(importlib.import_module(_API[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'lora_sweep' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_API})
