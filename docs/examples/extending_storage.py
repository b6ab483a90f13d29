"""A new storage backend end to end: define it, add it to ``store.storage.BACKENDS``, run the tiny demo study on it.

``folder:///abs/dir`` keeps a study in a folder of its own (``dir/optuna.log``, a journal file), for instance a
scratch folder per study on a host's shared disk. It is built from the journal file backend: it opens, locks and
reads damaged records through it, and says which URLs it takes, how it normalises them and which file holds the
storage. Run it from the checkout's root: ``python docs/examples/extending_storage.py``; tests/docs/test_extending.py
runs it, and the storage contract on the backend.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path

import optuna
from optuna.storages import BaseStorage

import lora_sweep
from lora_sweep.api import STUDIES
from lora_sweep.packer.tiny.models import build_tiny_model
from lora_sweep.store import storage
from lora_sweep.store.storage import StorageBackend, backend_of, open_storage

# --8<-- [start:backend]
JOURNAL = backend_of("journal:///any.log")  # the built-in journal file backend this one is made of
PREFIX = "folder://"


def folder_file(url: str) -> Path:
    """The journal file of ``folder:///abs/dir``: ``/abs/dir/optuna.log``."""
    return Path(url.removeprefix(PREFIX)) / "optuna.log"


def folder_normalize(url: str) -> str:
    """``folder://runs/x`` (relative to the working directory) -> ``folder:///abs/runs/x``, what the study keeps."""
    return PREFIX + str(Path(url.removeprefix(PREFIX)).expanduser().absolute())


def as_journal(url: str) -> str:
    return f"journal://{folder_file(url)}"


def folder_open(url: str, log: Callable[[str], None]) -> BaseStorage:
    folder_file(url).parent.mkdir(parents=True, exist_ok=True)
    return JOURNAL.open(as_journal(url), log)


def folder_lock(url: str, study_name: str) -> AbstractContextManager[None]:
    folder_file(url).parent.mkdir(parents=True, exist_ok=True)  # the lock file lies beside the journal
    return JOURNAL.lock(as_journal(url), study_name)  # an flock beside the journal file: one host's processes


FOLDER = StorageBackend("study folder", (PREFIX,), folder_open, folder_lock, file=folder_file,
                        normalize=folder_normalize, damaged=lambda url: JOURNAL.damaged(as_journal(url)))
# --8<-- [end:backend]


def tiny_demo(work: Path, folder: Path) -> lora_sweep.StudySpec:
    """studies/tiny-demo.yaml cut to 4 short trials, its study kept in ``folder`` through the new backend."""
    model = build_tiny_model("llama", work / "model", seed=0)
    evals = (STUDIES / "data" / "arith-eval.jsonl").read_text().splitlines(keepends=True)[:24]  # a quick held-out set
    (work / "eval.jsonl").write_text("".join(evals))
    return lora_sweep.load_study(STUDIES / "tiny-demo.yaml", [
        f"model.path={model}", "model.device=cpu", f"data.eval={work / 'eval.jsonl'}", "budget.trials=4",
        "train.max_steps=8", "train.warmup_steps=0", "pruning.rungs=[4]", "packing.max_slots=4",
        f"storage={PREFIX}{folder}",  # the study file names the storage by its URL
    ], out=work / "runs")


def main(work: Path) -> None:
    # --8<-- [start:use]
    storage.BACKENDS.append(FOLDER)  # this process's studies may name folder:// URLs from now on
    # --8<-- [end:use]
    folder = work / "study-folder"
    spec = tiny_demo(work, folder)
    summary = lora_sweep.run(spec, log=lambda line: None)
    assert summary.complete + summary.pruned == 4, summary
    study = optuna.load_study(study_name=spec.name, storage=open_storage(f"{PREFIX}{folder}"))
    assert (folder / "optuna.log").is_file() and len(study.get_trials()) == 4
    again = lora_sweep.run(spec, log=lambda line: None)  # resumed: the budget is spent
    assert again.complete + again.pruned == 0 and len(study.get_trials()) == 4, again
    print(f"4 trials in {folder / 'optuna.log'}; the second run resumed the study and trained none")


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as tmp:
        main(Path(tmp))
