"""URIs as they may be kept or shown: without their password.

Every URI a study names (its ``storage``, a tracker's ``tracking_uri``, any later one) and every text that may hold
one (a resolved spec, an error from a library that echoes the URI it was given) passes through ``redact_url`` (or,
for data, ``redact_record``) before it reaches an output, a log, a file, a report or a tracker. ``strip_password``
is the storage URL as a study records it (``sweep run --join`` compares it): the same match, the password dropped.

The password is the user information's part after its first ``:`` in a ``scheme://user:password@host`` URI, up to
the last ``@`` before a space (a raw ``@`` or ``/`` in a password, which SQLAlchemy accepts, is hidden whole).
"""

from __future__ import annotations

import re
from typing import Any

__all__ = ["strip_password", "redact_url", "redact_record", "HIDDEN"]

HIDDEN = "***"
"""What a password is shown as (SQLAlchemy's ``hide_password`` shows the same)."""
_USERINFO = re.compile(r"(?P<head>\b[A-Za-z][A-Za-z0-9+.\-]*://[^\s:/?#@]*):(?P<password>\S*)@")
"""``scheme://user:`` then the password (greedy: to the last ``@`` of the word) and ``@``."""


def redact_url(text: str) -> str:
    """``text`` (a URI, or a message holding URIs) with each URI's password shown as ``***``, for messages, logs,
    files and trackers (a path or a URI without a password unchanged)."""
    return _USERINFO.sub(lambda m: f"{m['head']}:{HIDDEN}@", text) if "@" in text else text


def strip_password(url: str) -> str:
    """``url`` without its password, as a study records its storage (a journal path or a URL without one unchanged).

    The password of a PostgreSQL storage can come from ``PGPASSWORD`` or ``~/.pgpass`` instead (libpq
    reads both when the URL has none), of a MySQL one from ``?read_default_file=~/.my.cnf``.
    """
    return _USERINFO.sub(lambda m: f"{m['head']}@", url) if "@" in url else url


def redact_record(data: Any) -> Any:
    """``data`` (plain JSON-like data: a resolved spec, a tracker's options) with ``redact_url`` applied to every
    string in it, keys included."""
    if isinstance(data, str):
        return redact_url(data)
    if isinstance(data, dict):
        return {redact_record(k): redact_record(v) for k, v in data.items()}
    if isinstance(data, list | tuple):
        return type(data)(redact_record(v) for v in data)
    return data
