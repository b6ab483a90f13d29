"""A database server storage's connection: its driver, its connect timeout, and a first connection that a signal
can stop.

A server that accepts a TCP connection and never answers (a port forwarded to nothing, a paused container, a
firewall that drops after the handshake) holds a driver's connect in C code: psycopg2's libpq waits without limit
unless ``connect_timeout`` is set, and retries its ``poll`` after every signal, so the CLI's SIGTERM handler never
runs; PyMySQL bounds the TCP connect with ``connect_timeout`` but then waits for the server's greeting without limit.
So every connection gets ``connect_timeout`` (the URL's own ``?connect_timeout=N``, else ``CONNECT_TIMEOUT_S``), and
the first one of a process (``answers``) is made on a thread of its own while the calling thread waits on it in
short sleeps, where Ctrl-C and SIGTERM land, for at most that long.

A bare ``postgresql://`` or ``mysql://`` URL is given the driver that is installed (SQLAlchemy's default for
``postgresql://`` is psycopg 3, for ``mysql://`` mysqlclient, neither of which the extras install).
"""

from __future__ import annotations

import importlib.util
import signal
import threading
import time
from typing import Any

from lora_sweep.errors import UserError
from lora_sweep.store.urls import redact_url

__all__ = ["CONNECT_TIMEOUT_S", "connect_timeout", "driven_url", "answers"]

CONNECT_TIMEOUT_S = 10
"""Seconds a storage server has to answer a new connection, unless its URL sets ``?connect_timeout=N``."""

_DRIVERS: dict[str, tuple[tuple[str, str], ...]] = {
    "postgresql": (("psycopg2", "psycopg2"), ("psycopg", "psycopg")),
    "mysql": (("pymysql", "pymysql"), ("mysqldb", "MySQLdb")),
    "mariadb": (("pymysql", "pymysql"), ("mysqldb", "MySQLdb")),
}
"""URL scheme -> (SQLAlchemy driver name, module) in the order a bare scheme takes them: the extra's first."""

_EXTRAS = {"postgresql": "postgres", "mysql": "mysql", "mariadb": "mysql"}
"""URL scheme -> the lora-sweep extra that installs its first driver."""

_MODULES = {driver: module for drivers in _DRIVERS.values() for driver, module in drivers}


def _parse(url: str) -> Any:
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    try:
        return make_url(url)
    except ArgumentError as err:
        raise UserError(f"storage: {redact_url(url)!r} is not a database URL ({err})") from None


def _installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def driven_url(url: str) -> str:
    """``url`` with its scheme's installed driver named (``postgresql://`` -> ``postgresql+psycopg2://`` where
    psycopg2 is the one installed); a URL that names its driver unchanged.

    Raises:
        UserError: the driver it names, or every driver its bare scheme could take, is not installed (names the
            extra that installs one).
    """
    parsed = _parse(url)
    scheme, _, driver = parsed.drivername.partition("+")
    extra = _EXTRAS.get(scheme)
    hint = f"pip install 'lora-sweep[{extra}]'" if extra else "install its driver"
    if driver:
        module = _MODULES.get(driver)
        if module is not None and not _installed(module):
            raise UserError(f"storage: {redact_url(url)!r} needs the {module} driver, which is not installed: "
                            f"{hint}, or name an installed driver in the URL")
        return url
    choices = _DRIVERS.get(scheme, ())
    found = next((d for d, module in choices if _installed(module)), None)
    if found is None:
        names = " or ".join(module for _, module in choices)
        raise UserError(f"storage: {redact_url(url)!r} needs a {scheme} driver ({names}), none is installed: {hint}")
    return parsed.set(drivername=f"{scheme}+{found}").render_as_string(hide_password=False)


def connect_timeout(url: str) -> int:
    """The URL's ``?connect_timeout=N`` (seconds), else ``CONNECT_TIMEOUT_S``.

    Raises:
        UserError: it is not a whole number of seconds > 0.
    """
    given = _parse(url).query.get("connect_timeout")
    if given is None:
        return CONNECT_TIMEOUT_S
    text = given if isinstance(given, str) else given[-1]
    if not text.isdigit() or int(text) <= 0:
        raise UserError(f"storage: {redact_url(url)!r}: connect_timeout must be a whole number of seconds > 0 "
                        f"(got {text!r})")
    return int(text)


def answers(url: str) -> tuple[str, dict[str, Any]]:
    """Connect to the server of ``url`` once, on a thread of its own, waiting where a signal can stop the wait; the
    URL with its driver (``driven_url``) and the ``connect_args`` every later connection is made with.

    Raises:
        UserError: the server did not answer within the connect timeout (one line naming the masked URL).
        KeyboardInterrupt: Ctrl-C or SIGTERM (the CLI's ``Terminated``) while waiting.
        Exception: the driver's own error (a refused connection, a wrong password), as SQLAlchemy raises it.
    """
    import sqlalchemy as sa

    if url in _ANSWERED:
        return _ANSWERED[url]
    timeout, driven = connect_timeout(url), driven_url(url)
    args: dict[str, Any] = {"connect_timeout": timeout}
    failed: list[BaseException] = []

    def connect() -> None:
        # the signals go to the waiting thread: one delivered here would only make the driver retry its poll
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
        try:
            engine = sa.create_engine(driven, poolclass=sa.pool.NullPool, connect_args=args)
            with engine.connect():
                pass
            engine.dispose()
        except BaseException as err:  # handed to the waiting thread
            failed.append(err)

    thread = threading.Thread(target=connect, name="storage-connect", daemon=True)
    start = time.monotonic()
    thread.start()
    while thread.is_alive() and time.monotonic() < start + timeout + 1.0:  # the driver's own timeout comes first
        thread.join(0.1)  # short waits: the interpreter runs a signal's handler between them
    # still connecting (a daemon blocked in the driver, left to die with the process), or the driver's timeout
    if thread.is_alive() or (failed and time.monotonic() - start >= timeout):
        raise UserError(f"storage: cannot open {redact_url(url)!r}: the server did not answer within {timeout} s "
                        f"(set ?connect_timeout=N in the URL to wait longer)")
    if failed:
        raise failed[0]
    _ANSWERED[url] = driven, args
    return driven, args


_ANSWERED: dict[str, tuple[str, dict[str, Any]]] = {}
"""The URLs whose server answered in this process: their later connections need no thread (``connect_timeout``
still bounds each)."""
