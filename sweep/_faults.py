"""What the operating system refused (a full disk, a read-only or missing folder, a path below a file) as the
one line of a user error, naming the file and its folder, instead of a traceback (``cli`` prints it).

Such a failure is the machine's state, not a bug: the study keeps everything it wrote before it (journal
appends and SQLite commits are synced, files are written atomically, a torn journal tail is set aside on the
next open), so the line says so and how to go on.
"""

from __future__ import annotations

import errno
import re
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from lora_sweep.errors import UserError, first_line
from lora_sweep.store.results import SQLITE_ERRNO

__all__ = ["fault_line", "about"]

_SPACE = {errno.ENOSPC, errno.EDQUOT}
_DENIED = {errno.EROFS, errno.EACCES, errno.EPERM}
_PATH = {errno.ENOTDIR, errno.EEXIST, errno.EISDIR, errno.ENOENT, errno.ENAMETOOLONG, errno.ELOOP}


_RUST_IO = re.compile(r"\(os error (\d+)\)")
"""How Rust's ``std::io::Error`` (safetensors' ``SafetensorError``) spells the errno it carries."""


def _chain(err: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        yield err
        err = err.__cause__ or err.__context__  # type: ignore[assignment]


def _free(folder: Path) -> str:
    """Free space of the file system holding ``folder`` (its nearest existing ancestor), e.g. '1.2 MB free'."""
    for candidate in (folder, *folder.parents):
        try:
            return f"{shutil.disk_usage(candidate).free / 1e6:.1f} MB free"
        except OSError:
            continue
    return "free space unknown"


def _needed(study: Path | None) -> str:
    """What the study writes next, judged by what it wrote: its largest adapter and its report, e.g. '; each
    trial's adapter needs about 1.8 MB here, the report 4.9 MB' ('' before the first adapter)."""
    if study is None:
        return ""
    try:
        adapters = [sum(f.stat().st_size for f in d.rglob("*") if f.is_file())
                    for d in (study / "adapters").glob("trial-*") if d.is_dir()]
        report = study / "report.html"
        parts = [f"each trial's adapter needs about {max(adapters) / 1e6:.1f} MB here"] if adapters else []
        if report.is_file():
            parts.append(f"the report {report.stat().st_size / 1e6:.1f} MB")
    except OSError:
        return ""
    return f"; {', '.join(parts)}" if parts else ""


def _file_in_the_way(path: Path) -> Path | None:
    """The regular file that ``path`` (or one of its parents) is, when a folder was wanted there."""
    return next((p for p in (path, *path.parents) if p.is_file()), None)


def fault_line(err: BaseException, folder: Path | None = None) -> str | None:
    """The one-line message for ``err`` (or an error it was raised from) when the system refused a file
    operation; None when it is something else (a bug keeps its traceback). ``folder``: the directory the
    command writes to, named when the error names no file."""
    for e in _chain(err):
        code, name = (e.errno, e.filename) if isinstance(e, OSError) else (None, None)
        if code is None:
            code = next((c for text, c in SQLITE_ERRNO.items() if text in str(e)), None)
        if code is None and (rust := _RUST_IO.search(str(e))):  # safetensors' writer, in Rust: no OSError
            code = int(rust[1])
        if code in _SPACE:
            where = Path(name).parent if name else folder
            what = (f" of {where} ({_free(where)}{f'; writing {name}' if name else ''}{_needed(folder)})" if where
                    else "")
            return (f"no space left on the device{what}: everything written before is kept; free space (or copy "
                    f"the study directory to a larger disk and give --out) and run the same command again to resume")
        if code in _DENIED:
            reason = "read-only file system" if code == errno.EROFS else "permission denied"
            return f"{name or folder or 'a file'}: {reason}"
        if code in (errno.ENOTDIR, errno.EEXIST) and name and _file_in_the_way(Path(name)):
            file = _file_in_the_way(Path(name))
            return f"{file}: a file, where a folder is needed{f' (for {name})' if str(file) != str(name) else ''}"
        if code in _PATH and name:
            return f"{name}: {e.strerror}"
        if "file is not a database" in str(e):
            return first_line(e)
    return None


@contextmanager
def about(folder: Path) -> Iterator[None]:
    """Inside the block, what the system refused becomes a ``UserError`` (``fault_line``) naming ``folder`` when
    the error names no file (a write through an open file, a SQLite commit)."""
    try:
        yield
    except UserError:
        raise
    except Exception as err:
        line = fault_line(err, folder)
        if line is None:
            raise
        raise UserError(line) from err
