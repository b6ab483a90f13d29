"""The machine's faults under `sweep`: a full disk, a read-only study directory, paths below a file. Each ends
in one line and exit 2, with everything written before kept and resumable (SIGTERM: tests/sweep/test_study.py).

The full and read-only disks are tmpfs mounts (``mount -t tmpfs -o size=...``, ``remount,ro``): root with
CAP_SYS_ADMIN, as in CI. Root ignores file modes, so a mount is the one way to refuse it a write; where
``mount`` is refused the tests skip, saying so."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState

from lora_sweep.api import examples
from lora_sweep.cli import main
from lora_sweep.packer.model.checkpoint import read_adapter
from lora_sweep.store.api import StudyDir
from lora_sweep.store.storage import open_storage
from lora_sweep.sweep.budget import counted
from lora_sweep.sweep.config.loader import load_study
from lora_sweep.sweep.study import run_study
from tests.conftest import write_study

ROOT = Path(__file__).resolve().parents[2]
SMALL = {"budget": {"trials": 3}, "train": {"max_steps": 6, "micro_batch": 4}, "pruning": {"kind": "none"},
         "evaluators": [{"name": "heldout_loss"}]}


@pytest.fixture
def mounted(tmp_path):  # noqa: ANN001, ANN201
    """``mount(size)`` -> a fresh tmpfs of that size; each is unmounted at the end."""
    mounts: list[Path] = []

    def mount(size: str) -> Path:
        path = tmp_path / f"tmpfs-{len(mounts)}"
        path.mkdir()
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                              capture_output=True, text=True)
        if done.returncode != 0:
            pytest.skip(f"mount -t tmpfs is refused here ({done.stderr.strip() or done.returncode}): it needs root "
                        f"with CAP_SYS_ADMIN, which CI has")
        mounts.append(path)
        return path

    yield mount
    for path in reversed(mounts):
        subprocess.run(["umount", "-l", str(path)], check=False)


def _remount_ro(path: Path) -> None:
    subprocess.run(["mount", "-o", "remount,ro", str(path)], check=True)


def _sweep(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lora_sweep", *args], capture_output=True, text=True, cwd=ROOT,
                          timeout=timeout)


def _one_line(done: subprocess.CompletedProcess, code: int = 2) -> str:
    """The command's one error line: the last of its output, the only ``error:`` one (before it, a run's own log
    lines: the step a pack trained on, how the run ended), and no traceback."""
    assert done.returncode == code and "Traceback" not in done.stderr, done.stderr
    lines = done.stderr.strip().splitlines()
    assert [line for line in lines if line.startswith("error:")] == lines[-1:], done.stderr
    return lines[-1]


def _trials(out: Path, name: str) -> list[optuna.trial.FrozenTrial]:
    return optuna.load_study(study_name=name, storage=open_storage(StudyDir(out).optuna_url)).get_trials()


def _ballast(folder: Path, free_kb: int) -> None:
    """Fill the file system of ``folder`` but ``free_kb`` KiB."""
    free = shutil.disk_usage(folder).free
    (folder / "ballast").write_bytes(b"\0" * max(0, free - free_kb * 1024))


def test_a_sweep_that_fills_the_disk_exits_2_and_its_copy_resumes_to_the_budget(tiny_dirs, tmp_path, mounted) -> None:
    study = write_study(tmp_path, tiny_dirs("llama"), name="full", **SMALL)
    disk = mounted("4m")
    _ballast(disk, 300)  # room for the store and an adapter or two, not for the whole study
    out = disk / "study"
    line = _one_line(_sweep("run", str(study), "--quiet", "--out", str(out)))
    assert line.startswith(f"error: no space left on the device of {out}") and "resume" in line
    bigger = tmp_path / "bigger"
    shutil.copytree(out, bigger, symlinks=True)
    done = _sweep("run", str(study), "--quiet", "--out", str(bigger))
    assert done.returncode == 0, done.stderr
    trials = _trials(bigger, "full")
    assert len(counted(trials)) == 3 and not [t for t in trials if t.state == TrialState.RUNNING]
    complete = [t for t in trials if t.state == TrialState.COMPLETE]
    assert len(complete) == 3
    for t in complete:
        config, tensors = read_adapter(StudyDir(bigger).adapter_dir(t.number))
        assert tensors and config["r"] == t.params["rank"]


def test_a_full_disk_at_the_report_is_one_line_after_every_trial_is_kept(tiny_dirs, tmp_path, mounted) -> None:
    study = write_study(tmp_path, tiny_dirs("llama"), name="report", **SMALL)
    disk = mounted("4m")
    _ballast(disk, 1200)  # the study fits, its ~5 MB report.html does not
    out = disk / "study"
    line = _one_line(_sweep("run", str(study), "--quiet", "--out", str(out)))
    assert "no space left" in line and str(out / "report.html") in line
    assert [t.state for t in _trials(out, "report")] == [TrialState.COMPLETE] * 3
    assert not list(out.glob(".report.html.*"))  # the half-written report is removed


def test_a_read_only_study_is_read_by_status_report_and_export_and_refused_by_run(tiny_dirs, tmp_path,
                                                                                    mounted) -> None:
    spec = load_study(write_study(tmp_path, tiny_dirs("llama"), name="ro", **SMALL))
    run_study(spec, log=lambda m: None)
    disk = mounted("16m")
    out = disk / "study"
    shutil.copytree(spec.out_dir, out, symlinks=True, ignore=shutil.ignore_patterns("results.db-*"))
    _remount_ro(disk)
    status = _sweep("status", str(out), "--json")
    assert status.returncode == 0 and '"COMPLETE": 3' in status.stdout, status.stderr
    assert _sweep("report", str(out), "--out", str(tmp_path / "r.html")).returncode == 0
    assert (tmp_path / "r.html").stat().st_size > 0
    exported = _sweep("export", str(out), "--trial", "0", "--out", str(tmp_path / "exported"))
    assert exported.returncode == 0 and (tmp_path / "exported" / "adapter_config.json").is_file(), exported.stderr
    line = _one_line(_sweep("run", str(spec.source), "--quiet", "--out", str(out)))
    assert f"run: {out}: Read-only file system" in line
    assert "read-only" in _one_line(_sweep("report", str(out)))  # its default --out is inside


@pytest.mark.parametrize("args", [
    ("run", "{study}", "--quiet", "--out", "{file}/study"),
    ("export", "{dir}", "--trial", "0", "--out", "{file}/x"),
    ("report", "{dir}", "--out", "{file}/x/report.html"),
    ("tiny-model", "--out", "{file}/model"),
    ("status", "{junk}"),
    ("example", "{example}", "--out", "{file}/x"),
], ids=["run", "export", "report", "tiny-model", "status-not-a-database", "example"])
def test_a_path_below_a_file_or_a_file_that_is_no_database_is_one_line(tiny_dirs, tmp_path, capsys, args) -> None:
    spec = load_study(write_study(tmp_path, tiny_dirs("llama"), name="paths", **{**SMALL, "budget": {"trials": 1}}))
    if args[0] in ("export", "report"):
        run_study(spec, log=lambda m: None)
    file = tmp_path / "a-file"
    file.write_text("not a folder")
    junk = tmp_path / "junk"
    junk.mkdir()
    (junk / "results.db").write_text("not a database either")
    (junk / "study.yaml").write_text("name: junk\n")
    names = {"study": spec.source, "file": file, "dir": spec.out_dir, "junk": junk, "example": examples()[0]}
    capsys.readouterr()  # what building the model and the study printed
    with pytest.raises(SystemExit) as exit_:
        main([a.format(**names) for a in args])
    err = capsys.readouterr().err.strip()
    assert exit_.value.code == 2 and len(err.splitlines()) == 1, err
    assert str(junk / "results.db") in err if args[0] == "status" else str(file) in err


def test_a_full_disk_says_the_space_the_study_needs(tmp_path) -> None:
    """The line names the free space and what the study writes next, judged by what it wrote: its largest
    adapter and its report."""
    import errno

    from lora_sweep.sweep._faults import fault_line

    study = tmp_path / "study"
    (study / "adapters" / "trial-0").mkdir(parents=True)
    (study / "adapters" / "trial-1").mkdir()
    (study / "adapters" / "trial-0" / "adapter_model.safetensors").write_bytes(b"0" * 2_000_000)
    (study / "adapters" / "trial-1" / "adapter_model.safetensors").write_bytes(b"0" * 1_000_000)
    (study / "report.html").write_bytes(b"0" * 500_000)
    target = study / "adapters" / "trial-2" / "adapter_model.safetensors"
    line = fault_line(OSError(errno.ENOSPC, "No space left on device", str(target)), study)
    assert line.startswith(f"no space left on the device of {target.parent} (") and " MB free; writing " in line
    assert "each trial's adapter needs about 2.0 MB here, the report 0.5 MB)" in line
    assert "before the first" not in (fault_line(OSError(errno.ENOSPC, "No space", None), tmp_path / "new") or "")
