"""Tracking servers for the tracker tests, on a free loopback port, bounded in time: a live MLflow server
(``mlflow server``, its store in the test's folder), and ports where nothing answers (refused, or a listener that
never replies)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

START_S = 180.0
"""How long a server may take to answer its first request (a busy 2-core machine imports MLflow's server slowly)."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def mlflow_server(folder: Path) -> Iterator[str]:
    """``mlflow server`` on 127.0.0.1 (one worker; store and artifacts in ``folder``); yields its URL
    (``http://127.0.0.1:PORT``), stops it after."""
    folder.mkdir(parents=True, exist_ok=True)
    port = free_port()
    cmd = [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
           "--backend-store-uri", f"sqlite:///{folder / 'server.db'}",
           "--artifacts-destination", (folder / "artifacts").as_uri()]
    log = (folder / "server.log").open("w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_S
        while True:
            assert proc.poll() is None, (folder / "server.log").read_text()
            with contextlib.suppress(OSError):
                with urllib.request.urlopen(f"{url}/health", timeout=5) as answer:
                    if answer.status == 200:
                        break
            assert time.monotonic() < deadline, f"mlflow server not up in {START_S:.0f} s"
            time.sleep(0.5)
        yield url
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()


@contextlib.contextmanager
def silent_port() -> Iterator[int]:
    """A loopback port that takes connections and never answers (a server that hangs)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(64)
        yield int(s.getsockname()[1])
