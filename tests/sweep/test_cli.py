"""``sweep.cli``'s entry point: exit codes, the teardown-free exit after a CUDA run, the report's preload."""

from __future__ import annotations

import subprocess
import sys
import threading

import pytest

import lora_sweep.sweep.cli as cli


def test_main_returns_on_success_and_exits_2_on_a_user_error(tmp_path, capsys) -> None:
    cli.main(["status", "--help"])
    with pytest.raises(SystemExit) as err:
        cli.main(["report", str(tmp_path)])
    assert err.value.code == 2
    assert "not a study directory" in capsys.readouterr().err


@pytest.mark.parametrize(("argv", "cuda", "leaves"), [(None, True, True), (None, False, False),
                                                      (["status", "--help"], True, False)])
def test_only_the_entry_point_of_a_cuda_command_leaves_without_teardown(monkeypatch, argv, cuda, leaves) -> None:
    import torch

    left: list[int] = []
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: cuda)
    monkeypatch.setattr(cli, "_leave", left.append)
    monkeypatch.setattr(sys, "argv", ["sweep", "status", "--help"])
    cli.main(argv)
    assert left == ([0] if leaves else [])


def test_leave_runs_the_atexit_handlers_flushes_and_exits_with_the_code() -> None:
    code = ("import atexit, sys; atexit.register(lambda: print('handler ran')); "
            "from lora_sweep.sweep.cli import _leave; sys.stdout.write('buffered, no newline'); _leave(3)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 3
    assert done.stdout == "buffered, no newlinehandler ran\n"


def test_the_report_preload_starts_once_on_the_first_progress_and_passes_every_call_on(monkeypatch) -> None:
    started = threading.Event()
    calls: list[int] = []
    monkeypatch.setattr(cli, "_preload_report", lambda: (calls.append(-1), started.set()))
    progress = cli._preloading_report(calls.append)
    for p in (1, 2, 3):
        progress(p)
    assert started.wait(10)
    assert sorted(calls) == [-1, 1, 2, 3] and [c for c in calls if c > 0] == [1, 2, 3]
