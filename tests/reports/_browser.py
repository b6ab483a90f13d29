"""Drive Debian's headless chromium over the DevTools protocol on a pipe (``--remote-debugging-pipe``).

Python only, no new dependency: chromium reads protocol commands from fd 3 and writes replies and events
to fd 4, as NUL-terminated JSON. ``load_page`` opens a URL, waits for the load event and for the plotly
figures to settle, records every JavaScript exception, ``console.error``, error log entry and network
request, evaluates the given expressions and saves a full-page screenshot.
"""

from __future__ import annotations

import base64
import fcntl
import json
import os
import queue
import subprocess
import threading
import time
from pathlib import Path
from typing import Any, NamedTuple

from tests.conftest import missing

CHROMIUM = Path("/usr/bin/chromium")


def need_chromium() -> None:
    """Skip the calling test unless Debian's chromium is installed (``tests.conftest.missing``)."""
    if not CHROMIUM.exists():
        missing(f"Debian's chromium ({CHROMIUM})", "apt-get install -y chromium")


FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-extensions", "--mute-audio", "--hide-scrollbars"]
_LOCAL = ("file:", "data:", "blob:", "about:")
KEPT: list[Path] = []
"""Screenshots kept as test artifacts; listed at the end of the pytest run (conftest.py)."""


class PageResult(NamedTuple):
    errors: list[str]
    """JavaScript exceptions, console.error / console.assert calls and error log entries."""
    requests: list[str]
    """URLs requested that are not local (file:, data:, blob:, about:)."""
    values: dict[str, Any]
    """name -> value of each expression evaluated after the page settled."""


class _Pipe:
    def __init__(self, proc: subprocess.Popen, write_fd: int, read_fd: int) -> None:
        self.proc, self.write_fd = proc, write_fd
        self.messages: queue.Queue[dict] = queue.Queue()
        self.events: list[dict] = []
        self.next_id = 0
        threading.Thread(target=self._read, args=(read_fd,), daemon=True).start()

    def _read(self, fd: int) -> None:
        buf = b""
        with os.fdopen(fd, "rb", buffering=0) as f:
            while chunk := f.read(1 << 16):
                buf += chunk
                *msgs, buf = buf.split(b"\0")
                for m in msgs:
                    self.messages.put(json.loads(m))

    def call(self, method: str, params: dict | None = None, session: str | None = None,
             timeout: float = 30.0) -> dict:
        self.next_id += 1
        msg: dict[str, Any] = {"id": self.next_id, "method": method, "params": params or {}}
        if session:
            msg["sessionId"] = session
        os.write(self.write_fd, json.dumps(msg).encode() + b"\0")
        deadline = time.monotonic() + timeout
        while True:
            m = self.messages.get(timeout=max(0.01, deadline - time.monotonic()))
            if m.get("id") == self.next_id:
                if "error" in m:
                    raise RuntimeError(f"{method}: {m['error']}")
                return m.get("result", {})
            if "method" in m:
                self.events.append(m)

    def wait_event(self, method: str, timeout: float = 30.0) -> dict:
        deadline = time.monotonic() + timeout
        while not any(e["method"] == method for e in self.events):
            m = self.messages.get(timeout=max(0.01, deadline - time.monotonic()))
            if "method" in m:
                self.events.append(m)
        return next(e for e in self.events if e["method"] == method)


def _spawn(user_data_dir: Path) -> tuple[subprocess.Popen, int, int]:
    cmd_r, cmd_w = os.pipe()  # we write commands, chromium reads them on fd 3
    out_r, out_w = os.pipe()  # chromium writes on fd 4, we read

    def child() -> None:  # runs in the child before exec: move the pipe ends to fds 3 and 4
        a, b = fcntl.fcntl(cmd_r, fcntl.F_DUPFD, 10), fcntl.fcntl(out_w, fcntl.F_DUPFD, 10)
        os.dup2(a, 3)
        os.dup2(b, 4)

    proc = subprocess.Popen([str(CHROMIUM), *FLAGS, f"--user-data-dir={user_data_dir}", "--remote-debugging-pipe",
                             "about:blank"], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, preexec_fn=child, close_fds=False)
    os.close(cmd_r)
    os.close(out_w)
    return proc, cmd_w, out_r


def _errors(events: list[dict]) -> tuple[list[str], list[str]]:
    errors, requests = [], []
    for e in events:
        p = e.get("params", {})
        if e["method"] == "Runtime.exceptionThrown":
            d = p["exceptionDetails"]
            errors.append(f"exception: {d.get('exception', {}).get('description') or d.get('text')}")
        elif e["method"] == "Runtime.consoleAPICalled" and p.get("type") in ("error", "assert"):
            errors.append("console.error: " + " ".join(str(a.get("value", a.get("description"))) for a in p["args"]))
        elif e["method"] == "Log.entryAdded" and p["entry"].get("level") == "error":
            errors.append(f"log: {p['entry'].get('text')} {p['entry'].get('url', '')}".strip())
        elif e["method"] == "Network.requestWillBeSent" and not p["request"]["url"].startswith(_LOCAL):
            requests.append(p["request"]["url"])
    return errors, requests


def load_page(url: str, *, user_data_dir: Path, screenshot: Path, expressions: dict[str, str],
              settle_expression: str = "document.querySelectorAll('.js-plotly-plot .main-svg').length",
              width: int = 1280, timeout: float = 60.0) -> PageResult:
    """Open ``url`` in headless chromium and report what happened (see ``PageResult``)."""
    proc, write_fd, read_fd = _spawn(user_data_dir)
    try:
        cdp = _Pipe(proc, write_fd, read_fd)
        target = cdp.call("Target.createTarget", {"url": "about:blank"}, timeout=timeout)["targetId"]
        session = cdp.call("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        for domain in ("Runtime", "Log", "Page", "Network"):
            cdp.call(f"{domain}.enable", session=session)
        cdp.call("Emulation.setDeviceMetricsOverride", {"width": width, "height": 900, "deviceScaleFactor": 1,
                                                         "mobile": False}, session=session)
        cdp.call("Page.navigate", {"url": url}, session=session)
        cdp.wait_event("Page.loadEventFired", timeout=timeout)

        def evaluate(expr: str) -> Any:
            r = cdp.call("Runtime.evaluate", {"expression": expr, "returnByValue": True, "awaitPromise": True},
                         session=session)
            if "exceptionDetails" in r:
                raise RuntimeError(f"{expr}: {r['exceptionDetails'].get('text')}")
            return r["result"].get("value")

        last, deadline = None, time.monotonic() + timeout
        while time.monotonic() < deadline:  # plotly draws asynchronously: wait until the count stops changing
            now = evaluate(settle_expression)
            if now == last and now:
                break
            last = now
            time.sleep(0.5)
        values = {name: evaluate(expr) for name, expr in expressions.items()}
        size = cdp.call("Page.getLayoutMetrics", session=session)["cssContentSize"]
        shot = cdp.call("Page.captureScreenshot", {"format": "png", "captureBeyondViewport": True,
                                                   "clip": {"x": 0, "y": 0, "width": width,
                                                            "height": min(size["height"], 16000), "scale": 1}},
                        session=session, timeout=timeout)
        screenshot.write_bytes(base64.b64decode(shot["data"]))
        time.sleep(0.2)
        cdp.call("Runtime.evaluate", {"expression": "0"}, session=session)  # drain late events
        errors, requests = _errors(cdp.events)
        cdp.call("Browser.close")
        return PageResult(errors, requests, values)
    finally:
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        os.close(write_fd)
