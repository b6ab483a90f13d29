"""Storage URLs as they may be kept or shown: without their password."""

from __future__ import annotations

__all__ = ["strip_password", "redact_url"]


def strip_password(url: str) -> str:
    """``url`` without its password, to be kept or shown (a journal path or a URL without one unchanged).

    The password of a PostgreSQL storage can come from ``PGPASSWORD`` or ``~/.pgpass`` instead (libpq
    reads both when the URL has none), of a MySQL one from ``?read_default_file=~/.my.cnf``.
    """
    if "@" not in url:  # no user info, no password: a journal path, or a URL without credentials
        return url      # (and no SQLAlchemy import, 0.2 s, for a study on a journal file)
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    try:
        parsed = make_url(url)
    except ArgumentError:
        return url
    # URL.set(password=None) leaves the password as it is: None means "unchanged" there
    return url if parsed.password is None else parsed._replace(password=None).render_as_string(hide_password=False)


def redact_url(url: str) -> str:
    """``url`` with its password shown as ``***`` (SQLAlchemy's ``hide_password``), for messages and logs."""
    if "@" not in url:  # as in strip_password: nothing to hide
        return url
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    try:
        parsed = make_url(url)
    except ArgumentError:
        return url
    return url if parsed.password is None else parsed.render_as_string(hide_password=True)

