"""``cli``'s entry point: exit codes, the teardown-free exit after a CUDA run, the report's preload."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest

import lora_sweep.cli as cli


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

    from lora_sweep.evaluators import registry

    left: list[int] = []
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: cuda)
    monkeypatch.setattr(cli, "_leave", left.append)
    # what earlier commands in this process left (an export written, a hung evaluator's thread: other tests of the
    # same pytest worker) would also make the entry point leave: none here
    monkeypatch.setattr(cli, "_FINISHED", [])
    monkeypatch.setattr(cli, "_SPLIT_CLOSED", [])
    monkeypatch.setattr(registry, "abandoned", lambda: [])
    monkeypatch.setattr(sys, "argv", ["sweep", "status", "--help"])
    cli.main(argv)
    assert left == ([0] if leaves else [])


def test_leave_runs_the_atexit_handlers_flushes_and_exits_with_the_code() -> None:
    code = ("import atexit, sys; atexit.register(lambda: print('handler ran')); "
            "from lora_sweep.cli import _leave; sys.stdout.write('buffered, no newline'); _leave(3)")
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


def test_a_sigterm_whose_exception_python_swallowed_stops_the_run_at_its_next_step(monkeypatch) -> None:
    """A signal's handler runs wherever the main thread is; a ``Terminated`` raised inside a weakref callback (the
    import system's module locks use them) is printed as "Exception ignored" and lost, and the run would go on to
    its end. The SIGTERM is kept: the next step's progress raises it again."""
    import weakref

    from lora_sweep.errors import Terminated

    monkeypatch.setattr(cli, "_SIGTERMS", [])
    monkeypatch.setattr(cli, "_preload_report", lambda: None)
    calls: list[int] = []
    progress = cli._preloading_report(calls.append)
    progress(1)

    class Held:
        pass

    held = Held()
    ref = weakref.ref(held, lambda _: cli._on_sigterm(15, None))  # noqa: F841  (its callback runs at the del)
    del held  # the handler's Terminated is swallowed here, as Python does in a weakref callback
    with pytest.raises(Terminated):
        progress(2)
    assert calls == [1]


def _policy_in_a_command(env: dict[str, str]) -> str:
    """OMP_WAIT_POLICY as `sweep --help`, run as the console entry point, leaves it for torch's OpenMP runtime."""
    code = ("import os, sys; sys.argv = ['sweep', '--help']\n"
            "from lora_sweep.cli import main\n"
            "main()\n"
            "import torch  # the runtime reads the policy here\n"
            "print(os.environ.get('OMP_WAIT_POLICY'), file=sys.stderr)")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stderr.strip().splitlines()[-1]


def test_the_command_line_lets_openmp_threads_sleep_unless_the_user_chose() -> None:
    """Spinning OpenMP threads on cores another job uses make small products several times slower: the command line
    sets OMP_WAIT_POLICY=PASSIVE before torch loads, and a policy the user set wins."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    assert _policy_in_a_command(env) == "PASSIVE"
    assert _policy_in_a_command({**env, "OMP_WAIT_POLICY": "ACTIVE"}) == "ACTIVE"
