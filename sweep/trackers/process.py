"""The run's side of the trackers' process (``python -m lora_sweep.sweep.trackers.sync``): ``Tracking`` starts it,
tells it the study, and ends it.

The process can start before the engine is imported: ``sweep run`` starts it (``ahead``) as soon as the study is
loaded (no torch yet), with the study's trackers, and the process imports their packages (about 2 CPU seconds for the
three) while the run imports torch and loads the model, which keep one core busy for about 5 s on the 2-core demo and
leave the other idle. ``attach`` then sends the process the study's directory and its ``trackers``. ``start`` does
both at once (the Python API). This module imports neither
the results store nor a tracker's package: ``sweep run`` imports it before anything heavy.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lora_sweep.errors import first_line

if TYPE_CHECKING:  # not at run time: `sweep run` imports this module before the spec's engine (torch)
    from lora_sweep.sweep.config.spec import StudySpec

__all__ = ["Tracking", "ahead", "start", "FINISH_S", "RESTARTS"]

FINISH_S = 60.0
"""How long the end of a run waits at most for the trackers' last pass and closing (a tracker that talks to a server
is given up sooner, ``_guards.CALL_S`` a call)."""
RESTARTS = 2
"""How many times a trackers' process that died (killed, out of memory) is started again."""
LAST_LINE = "trackers: "
"""How the process's last line starts (what the trackers cost): the process ended its work."""
_PROCESS = "lora_sweep.sweep.trackers.sync"


class Tracking:
    """The trackers' process, seen from the run: ``begin`` starts it (importing the ``prepare`` trackers' packages
    at once), ``attach`` tells it the study and hands its lines to ``log``, ``finish`` ends it, ``abandon`` stops
    one never attached. It reads the study and its end from its stdin (EOF: the run's process is gone) and writes
    the lines it has to say to its stdout, which a thread of this process hands to ``log`` (the thread only
    waits). A process that dies before its last line is said in one warning line and started again (``RESTARTS``
    times at most), told the study and, if the run has ended, its end: it finds the runs the dead one opened by
    their ids (``Tracker.find``) and closes them."""

    def __init__(self, prepare: Sequence[tuple[str, Mapping[str, Any]]], interval: float = 2.0) -> None:
        self.prepare = [(name, dict(options)) for name, options in prepare]
        self.interval = interval
        self.process: subprocess.Popen[str] | None = None
        self.reader: threading.Thread | None = None
        self.log: Callable[[str], None] = lambda line: None
        self.told: list[str] = []  # the lines the run sent: the study, then its end
        self.lock = threading.Lock()  # the process and ``told``, between the reader (a restart) and ``finish``
        self.restarts = 0
        self.given_up = False  # killed at the end for taking too long: not started again

    def begin(self) -> Tracking:
        """Start the process (it imports the ``prepare`` trackers' packages at once)."""
        # the child imports lora_sweep from where this process did (an editable install, a PYTHONPATH, a script's dir)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        config = {"prepare": self.prepare, "interval": self.interval}
        # a process group of its own: the terminal's Ctrl-C is the run's to handle (it then ends the trackers), also
        # while this process still starts, before it can ignore SIGINT
        self.process = subprocess.Popen([sys.executable, "-m", _PROCESS, json.dumps(config)], env=env,
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, process_group=0)
        return self

    def _tell(self, line: str, last: bool = False) -> None:
        """Send ``line`` to the process (``last``: then close its stdin); a process that died already is the
        reader's to start again."""
        assert self.process is not None and self.process.stdin is not None
        with contextlib.suppress(OSError):
            self.process.stdin.write(line + "\n")
            self.process.stdin.flush()
        if last:
            with contextlib.suppress(OSError):
                self.process.stdin.close()

    def attach(self, spec: StudySpec, log: Callable[[str], None]) -> None:
        """Tell the process the study it logs (its directory, name and ``trackers``); its lines go to ``log``."""
        assert self.process is not None and self.process.stdin is not None and self.reader is None
        study = {"out_dir": str(spec.out_dir), "name": spec.name,
                 "trackers": [[t.name, dict(t.options)] for t in spec.trackers]}
        with self.lock:
            self.told.append(json.dumps(study))
            self._tell(self.told[0])
        self.log = log
        self.reader = threading.Thread(target=self._read, name="sweep-trackers-log", daemon=True)
        self.reader.start()

    def _read(self) -> None:
        while True:
            process = self.process
            assert process is not None and process.stdout is not None
            for line in process.stdout:
                self.log(line.rstrip("\n"))
                if line.startswith(LAST_LINE):
                    return
            code = process.wait()
            with self.lock:
                if not self._again(code):
                    return

    def _again(self, code: int) -> bool:
        """Start the process again after it died with ``code`` (one warning line); False: not again."""
        how = f"killed by signal {-code}" if code < 0 else f"exit status {code}"
        if self.given_up:
            return False
        if self.restarts >= RESTARTS:
            self.log(f"warning: the trackers' process ended ({how}) again; the run goes on without the trackers")
            return False
        self.restarts += 1
        self.log(f"warning: the trackers' process ended ({how}); started again, it carries on from the runs the "
                 f"trackers hold")
        self.begin()
        for i, line in enumerate(self.told):
            self._tell(line, last=i == 1)
        return True

    def abandon(self) -> None:
        """Stop a process that was never attached (the study did not load, or the run took another way); one
        attached is ``finish``'s."""
        if self.process is not None and self.reader is None:
            self.process.kill()
            self.process.wait()
            for pipe in (self.process.stdin, self.process.stdout):
                if pipe is not None:
                    with contextlib.suppress(OSError):
                        pipe.close()

    def finish(self, finished: bool, report: Callable[[], Path | None] | None = None) -> Path | None:
        """End the process after a last pass; with ``finished`` (the budget ended the run) ``report()`` is written
        here and attached with the Pareto table to the parent runs; every run is closed. Waits (at most ``FINISH_S``
        for a slow tracker) until the process has said its last line. Returns the report's path when ``report()``
        wrote it."""
        assert self.process is not None and self.process.stdin is not None and self.reader is not None
        path = None
        if finished and report is not None:
            try:
                path = report()
            except Exception as err:  # noqa: BLE001  (the report's own failure is the CLI's to say)
                self.log(f"warning: the report for the trackers could not be written ({first_line(err)})")
        with self.lock:
            self.told.append(json.dumps({"finished": finished, "report": path and str(path)}))
            _normal_priority(self.process.pid)
            self._tell(self.told[1], last=True)
        # done when its output closes, after its last line: its exit (the packages' exit handlers, W&B's core shut
        # down, and the interpreter's teardown of their thousands of modules, about 1 s) goes on without the run
        self.reader.join(timeout=FINISH_S)
        if self.reader.is_alive():
            self.log(f"warning: trackers still busy after {FINISH_S:.0f} s; the run ends without waiting for them")
            with self.lock:
                self.given_up = True
                self.process.kill()
            self.reader.join(timeout=5.0)
        return path


def _normal_priority(pid: int) -> None:
    """Take the trackers' process off ``SCHED_IDLE`` for its last pass, which the run waits for: on a host that other
    work keeps busy, an idle task may not run for seconds, also once training has ended. Where it is not allowed (an
    unprivileged user whose ``RLIMIT_NICE`` is 0), it stays."""
    with contextlib.suppress(AttributeError, OSError):
        if os.sched_getscheduler(pid) == os.SCHED_IDLE:
            os.sched_setscheduler(pid, os.SCHED_OTHER, os.sched_param(0))


def ahead(prepare: Sequence[tuple[str, Mapping[str, Any]]], interval: float = 2.0) -> Tracking | None:
    """The trackers' process started before the engine's imports, importing ``prepare``'s packages ((name, options)
    of the study's trackers); None when it names none."""
    return Tracking(prepare, interval).begin() if prepare else None


def start(spec: StudySpec, log: Callable[[str], None], started: Tracking | None = None,
          interval: float = 2.0) -> Tracking | None:
    """The study's trackers' process, attached to the study: ``started`` (``ahead``'s) when given, else one
    started here; None when the study names no tracker (``started`` is then stopped)."""
    if not spec.trackers:
        if started is not None:
            started.abandon()
        return None
    tracking = started or Tracking([(t.name, t.options) for t in spec.trackers], interval).begin()
    tracking.attach(spec, log)
    return tracking
