"""lora-sweep: hyperparameter sweeps for LoRA adapters, many trials packed into one training run.

The import package is ``lora_sweep``; its directory is the checkout's root, whose folders install as
``lora_sweep.sweep``, ``lora_sweep.store``, ``lora_sweep.packer``, ``lora_sweep.kernels``, ``lora_sweep.evaluators``,
``lora_sweep.reports``, ``lora_sweep.benchmarks`` and ``lora_sweep.testing`` (the contract suites a user's own
evaluator or storage backend runs in its tests; pyproject.toml's ``package-dir``). Those eight folders have no
``__init__.py``: they are namespace portions (PEP 420), which the import system takes only after every ``sys.path``
entry has been searched for a regular package of that name, so from the checkout's root an installed ``kernels``
(Hugging Face's) or ``sweep`` is the one imported. The entry points sit on top of them, beside this file: ``cli``
(the ``sweep`` command, ``python -m lora_sweep``) and ``api`` (the Python API below); no folder imports either.
The public API::

    import lora_sweep

    spec = lora_sweep.load_study("study.yaml", ["budget.trials=8"], out="runs/demo")
    summary = lora_sweep.run(spec)
    results = lora_sweep.open_results("runs/demo")
    results.best_trials()                 # the feasible Pareto front (one trial for one objective)
    lora_sweep.export("runs/demo", "adapter/", best=True)
    lora_sweep.write_report("runs/demo")

Importing ``lora_sweep`` is light: the API's names load on first use (PEP 562), so ``import lora_sweep.packer``
on a machine without optuna or plotly works.

Imported before torch, it sets ``OMP_WAIT_POLICY=PASSIVE`` unless the environment chose a policy (the CLI's setting,
the engine's in any process): docs/reference/api.md, "Threads", says why and what holds when torch came first.
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
import time
from typing import Any

__version__ = "0.1.0"

IMPORTED_AT = time.time()
"""Wall clock when ``lora_sweep`` was first imported, the start ``sweep.timing`` counts a process's seconds before a
run from (a ``sweep`` command imports it first, after the interpreter's own start of a few tens of ms)."""

TORCH_FIRST = "torch" in sys.modules
"""Whether torch was imported before ``lora_sweep``: its OpenMP runtime then read the wait policy already, and
``api.run`` caps torch's threads for the run instead (``api.engine_threads``)."""
if not TORCH_FIRST:
    # Let torch's OpenMP threads sleep rather than spin while they wait. The OpenMP runtime reads the policy once,
    # when torch loads it, so it is set here, before any module of the package imports torch. On a CPU whose cores
    # something else also uses, spinning threads wait on a descheduled sibling at every small matrix product, and a
    # sweep's many small products then run several times slower than on one thread (BENCHMARKS.md, "Planning").
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

# torchao (the qlora extra, packer.model.quant) is imported by transformers whenever it is installed; at import it logs
# a warning for each optional C++ extension the installed torch cannot load, and torch one for each enum it
# registers. None of those extensions is used here (NF4 is plain PyTorch): keep them off every command's stderr.
for _name in ("torchao", "torch.utils._pytree"):
    logging.getLogger(_name).setLevel(logging.ERROR)

_API = {
    "load_study": "lora_sweep.api",
    "run": "lora_sweep.api",
    "open_results": "lora_sweep.api",
    "Results": "lora_sweep.api",
    "export": "lora_sweep.api",
    "write_report": "lora_sweep.api",
    "examples": "lora_sweep.api",
    "copy_example": "lora_sweep.api",
    "StudySpec": "lora_sweep.sweep.config.spec",
    "RunSummary": "lora_sweep.sweep.study",
    "TrialRecord": "lora_sweep.store.api",
    "UserError": "lora_sweep.errors",
    "ConfigError": "lora_sweep.errors",
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
