"""``sweep run --gpus 2`` with ``pack.shard: fsdp``: two CPU ranks (gloo) train the study's packs with the base
sharded, rank 0 owning the study, and reach the trials the unsharded study reaches (a refill and a prune among
them); a run killed mid-pack resumes to its budget in a process group of one; ``sweep worker`` under torchrun
leads its ranks the same way; without the devices, or without ``fsdp``, one line, exit 2."""

from __future__ import annotations

import contextlib
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from optuna.trial import TrialState
from safetensors.torch import load_file

from lora_sweep.api import run
from lora_sweep.cli import _main
from lora_sweep.errors import ConfigError
from lora_sweep.sweep.config.loader import load_study
from lora_sweep.sweep.study import run_study
from tests.conftest import optuna_study, write_study

ROOT = Path(__file__).resolve().parents[2]
SMALL = {"train": {"max_steps": 6, "micro_batch": 2}, "budget": {"trials": 4},
         "pruning": {"kind": "cohort_sha", "rungs": [3], "reduction_factor": 2},
         "evaluators": [{"name": "heldout_loss"}]}
"""4 trials of 6 steps in 2 slots, halved at step 3: the first pair's weaker half is pruned and both slots are
refilled; the held-out loss only (generation is tested sharded in tests/packer/model/test_shard.py)."""


def _study(tmp_path: Path, model_dir: Path, name: str, shard: str, device: str = "cpu", **changes) -> Path:
    return write_study(tmp_path, model_dir, name=name, pack={"max_slots": 2, "shard": shard, "cuda_graphs": "off"},
                       **(SMALL | changes | {"model": {"path": str(model_dir), "device": device}}))


def _adapter(out: Path, number: int) -> dict[str, torch.Tensor]:
    return load_file(out / "adapters" / f"trial-{number}" / "adapter_model.safetensors")


def _curves(out: Path) -> dict[tuple[int, int], float]:
    """(trial, step) -> training loss, as the study stored it."""
    with sqlite3.connect(out / "results.db") as db:
        return {(t, step): loss for t, step, loss in db.execute("select trial, step, loss from steps")}


def _plain(tmp_path: Path, model: Path, device: str) -> Path:
    """The unsharded study's directory, run."""
    spec = load_study(_study(tmp_path, model, "plain", "none", device))
    run(spec)
    return spec.out_dir


def _assert_ranks_reach_the_unsharded_trials(tmp_path: Path, model: Path, plain: Path, gpus: int,
                                             device: str) -> None:
    """``sweep run --gpus`` on the sharded study ends every trial as the unsharded study did: the same states and
    parameters, per-step training losses and objective values within 1e-5 relative, saved adapters within 1e-4
    (fp32)."""
    path = _study(tmp_path, model, "sharded", "fsdp", device)
    assert _main(["run", str(path), "--gpus", str(gpus), "--quiet"]) == 0
    ref = optuna_study(plain, "plain").get_trials()
    got = optuna_study(tmp_path / "runs-sharded", "sharded").get_trials()
    assert [t.state for t in got] == [t.state for t in ref]
    assert [t.state for t in ref].count(TrialState.PRUNED) >= 1 and len(ref) == 4  # a prune, both slots refilled
    curves = [_curves(d) for d in (tmp_path / "runs-sharded", plain)]
    assert curves[0].keys() == curves[1].keys() and len(curves[1]) > 4 * 3  # every trial's every step
    for key, loss in curves[1].items():
        assert curves[0][key] == pytest.approx(loss, rel=1e-5)
    for g, r in zip(got, ref, strict=True):
        assert g.params == r.params
        if r.state == TrialState.COMPLETE:
            assert g.values == pytest.approx(r.values, rel=1e-5)
            mine, theirs = _adapter(tmp_path / "runs-sharded", g.number), _adapter(plain, r.number)
            assert mine.keys() == theirs.keys()
            for key, weight in theirs.items():
                torch.testing.assert_close(mine[key], weight, rtol=0, atol=1e-4)


@pytest.fixture(scope="module")
def plain_cpu(tiny_dirs, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _plain(tmp_path_factory.mktemp("plain"), tiny_dirs("llama"), "cpu")


def test_two_ranks_reach_the_unsharded_trials(tiny_dirs, tmp_path, plain_cpu: Path) -> None:
    _assert_ranks_reach_the_unsharded_trials(tmp_path, tiny_dirs("llama"), plain_cpu, 2, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("gpus", [1, 2])
def test_ranks_on_gpus_reach_the_unsharded_trials(tiny_dirs, tmp_path, gpus: int) -> None:
    """NCCL, one GPU per rank (the Triton kernels, the static step eager on both sides)."""
    if torch.cuda.device_count() < gpus:
        pytest.skip(f"needs {gpus} CUDA devices")
    model = tiny_dirs("llama")
    _assert_ranks_reach_the_unsharded_trials(tmp_path, model, _plain(tmp_path, model, "cuda"), gpus, "cuda")


def test_killed_sharded_run_resumes_to_its_budget_on_one_rank(tiny_dirs, tmp_path) -> None:
    path = _study(tmp_path, tiny_dirs("llama"), "killed", "fsdp", train={"max_steps": 8, "micro_batch": 2},
                  pruning={"kind": "none"})
    out = tmp_path / "runs-killed"
    proc = subprocess.Popen([sys.executable, "-m", "lora_sweep", "run", str(path), "--gpus", "2", "--quiet"],
                            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
                            env=os.environ | {"PYTHONPATH": os.pathsep.join(sys.path)})
    deadline, states = time.time() + 120, []
    while time.time() < deadline and proc.poll() is None and not (TrialState.COMPLETE in states
                                                                  and TrialState.RUNNING in states):
        time.sleep(0.2)
        try:
            states = [t.state for t in optuna_study(out, "killed").get_trials()]
        except Exception:  # not created yet
            continue
    with contextlib.suppress(ProcessLookupError):  # ended on its own: the assertion below says so
        os.killpg(proc.pid, signal.SIGKILL)  # rank 0 and its follower
    proc.wait()
    assert TrialState.RUNNING in states, "the kill must land mid-pack"
    # resumed without --gpus: the sharded path in this process alone (a process group of one)
    assert _main(["run", str(path), "--quiet"]) == 0
    after = optuna_study(out, "killed").get_trials()
    assert [t.state for t in after].count(TrialState.COMPLETE) == 4
    failed = {t.number for t in after if t.state == TrialState.FAIL}
    assert failed and sorted(t.user_attrs["retry_of"] for t in after if "retry_of" in t.user_attrs) == sorted(failed)
    assert all((out / "adapters" / f"trial-{t.number}").is_dir() for t in after if t.state == TrialState.COMPLETE)


def test_worker_under_torchrun_trains_a_sharded_pack(tiny_dirs, tmp_path) -> None:
    """``sweep worker`` started by torchrun on 2 CPU ranks: rank 0 is the worker, rank 1 follows its pack."""
    path = _study(tmp_path, tiny_dirs("llama"), "ranked", "fsdp", budget={"trials": 3}, pruning={"kind": "none"},
                  train={"max_steps": 4, "micro_batch": 2})
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           "-m", "lora_sweep", "worker", str(path), "--index", "0", "--quiet"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300,
                          env=os.environ | {"PYTHONPATH": os.pathsep.join(sys.path), "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    trials = optuna_study(tmp_path / "runs-ranked", "ranked").get_trials()
    assert [t.state for t in trials] == [TrialState.COMPLETE] * 3  # a refill: 3 trials through 2 slots
    assert all((tmp_path / "runs-ranked" / "adapters" / f"trial-{t.number}").is_dir() for t in trials)
    assert "worker 0: 3 complete" in done.stdout


@pytest.mark.parametrize(("shard", "device", "said"), [
    ("fsdp", "auto", "error: --gpus 2 (gpus=2 in the API): 0 CUDA device(s) visible"),
    ("none", "cpu", "error: --gpus 2 (gpus=2 in the API): needs pack.shard: fsdp"),
])
def test_gpus_without_devices_or_fsdp_exits_2(tiny_dirs, tmp_path, capsys, shard, device, said) -> None:
    if torch.cuda.is_available():
        pytest.skip("a CUDA host has devices")
    path = _study(tmp_path, tiny_dirs("llama"), "refused", shard, device)
    capsys.readouterr()  # (building the tiny model, when this test is the first to, writes a progress bar)
    assert _main(["run", str(path), "--gpus", "2", "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(said) and "\n" not in err
    assert not (tmp_path / "runs-refused").exists()


def test_sample_packing_is_refused_on_a_sharded_pack(tiny_dirs, tmp_path, capsys) -> None:
    path = _study(tmp_path, tiny_dirs("llama"), "packed", "fsdp")
    capsys.readouterr()
    assert _main(["run", str(path), "--quiet", "train.sample_packing=true"]) == 2
    assert capsys.readouterr().err.startswith("error: pack.shard: fsdp does not take sample packing")
    assert not (tmp_path / "runs-packed").exists()


def test_fsdp_without_started_ranks_is_refused(tiny_dirs, tmp_path) -> None:
    spec = load_study(_study(tmp_path, tiny_dirs("llama"), "alone", "fsdp"))
    with pytest.raises(ConfigError, match="the ranks of a sharded pack are not started"):
        run_study(spec, log=lambda m: None)
    assert not spec.out_dir.exists()
