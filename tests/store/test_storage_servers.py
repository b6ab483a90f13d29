"""``store.storage`` over a database server that accepts connections and never answers: bounded by the connect
timeout, stopped by SIGTERM, one line naming the masked URL; a bare ``postgresql://`` or ``mysql://`` takes the
installed driver. (A URL no storage takes, refused before the model loads: tests/sweep/test_battery.py.)"""

from __future__ import annotations

import signal
import socket
import subprocess
import time
from collections.abc import Iterator

import pytest

import lora_sweep.store._servers as servers
from lora_sweep.errors import UserError
from lora_sweep.store.storage import normalize_url, open_storage
from tests.conftest import need_module, write_study
from tests.helpers import cli

DRIVERS = {"postgresql": ("psycopg2", "postgres"), "mysql": ("pymysql", "mysql")}


@pytest.fixture
def silent_server() -> Iterator[socket.socket]:
    """A loopback TCP server that accepts (the kernel completes the handshake) and never sends a byte."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(8)
        yield server


def _url(scheme: str, server: socket.socket, timeout: int | None) -> str:
    need_module(*DRIVERS[scheme])
    query = f"?connect_timeout={timeout}" if timeout is not None else ""
    return f"{scheme}://alice:SECRETPW@127.0.0.1:{server.getsockname()[1]}/db{query}"


@pytest.mark.parametrize("scheme", list(DRIVERS))
def test_a_server_that_never_answers_is_one_line_within_its_connect_timeout(silent_server, scheme: str) -> None:
    url = _url(scheme, silent_server, timeout=1)
    start = time.monotonic()
    with pytest.raises(UserError) as err:
        open_storage(normalize_url(url))
    assert time.monotonic() - start < 6
    port = silent_server.getsockname()[1]
    assert str(err.value) == (f"storage: cannot open '{scheme}://alice:***@127.0.0.1:{port}/db?connect_timeout=1': "
                              "the server did not answer within 1 s (set ?connect_timeout=N in the URL to wait "
                              "longer)")


def test_the_default_connect_timeout_is_at_most_30_s_and_the_url_sets_another() -> None:
    assert 0 < servers.connect_timeout("postgresql://h/db") == servers.CONNECT_TIMEOUT_S <= 30
    assert servers.connect_timeout("mysql+pymysql://h/db?connect_timeout=45") == 45
    with pytest.raises(UserError, match=r"^storage: 'postgresql://u:\*\*\*@h/db\?connect_timeout=soon': "
                                        r"connect_timeout must be a whole number"):
        normalize_url("postgresql://u:pw@h/db?connect_timeout=soon")


@pytest.mark.parametrize("scheme", list(DRIVERS))
def test_sigterm_while_connecting_stops_sweep_run_at_once(silent_server, tiny_dirs, tmp_path, scheme: str) -> None:
    url = _url(scheme, silent_server, timeout=120)
    study = write_study(tmp_path, tiny_dirs("llama"), storage=url)
    proc = subprocess.Popen(cli("run", str(study), "--quiet"), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    try:
        silent_server.settimeout(120)
        conn, _ = silent_server.accept()  # the driver is connecting now (conn stays open, unanswered)
        proc.send_signal(signal.SIGTERM)
        sent = time.monotonic()
        out, _ = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert time.monotonic() - sent < 10 and proc.returncode == 143, out
    assert out.strip().startswith("terminated (SIGTERM)") and "Traceback" not in out and "SECRETPW" not in out


@pytest.mark.parametrize(("bare", "driver"), [("postgresql", "psycopg2"), ("mysql", "pymysql")])
def test_a_bare_scheme_takes_the_driver_its_extra_installs(bare: str, driver: str) -> None:
    need_module(*DRIVERS[bare])
    assert servers.driven_url(f"{bare}://u:pw@h:1/db") == f"{bare}+{driver}://u:pw@h:1/db"
    assert servers.driven_url(f"{bare}+{driver}://h/db") == f"{bare}+{driver}://h/db"


def test_a_scheme_without_its_driver_names_the_extra(monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.setattr(servers, "_installed", lambda module: False)
    with pytest.raises(UserError, match=r"^storage: 'postgresql://u:\*\*\*@h/db' needs a postgresql driver "
                                        r"\(psycopg2 or psycopg\), none is installed: "
                                        r"pip install 'lora-sweep\[postgres\]'$"):
        normalize_url("postgresql://u:pw@h/db")
    with pytest.raises(UserError, match=r"needs the pymysql driver, which is not installed: "
                                        r"pip install 'lora-sweep\[mysql\]'"):
        normalize_url("mysql+pymysql://h/db")

