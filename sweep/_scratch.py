"""The directory an export is written in: a scratch directory beside ``--out``, renamed onto it once complete.

An export stopped by Ctrl-C or SIGTERM removes its scratch directory (``scratch_dir``'s exit, over ``store``'s
``scratch_directory``: a signal between its ``mkdir`` and its name being held leaves none either); one stopped by
SIGKILL or a power loss leaves it, named for its process (``.<out>.partial-<pid>-<random>``), and the next export
to the same ``--out`` removes it once that process is gone. The system's refusals name ``--out``, not the scratch.
"""

from __future__ import annotations

import glob
import os
import re
import shutil
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

from lora_sweep.errors import UserError
from lora_sweep.store.directory import scratch_directory
from lora_sweep.sweep._faults import fault_line

__all__ = ["scratch_dir", "unwritable", "plain_modes"]


def _scratch_prefix(out: Path) -> str:
    """The name of an export's scratch directory beside ``out`` up to the pid of the process writing it."""
    return f".{out.name}.partial-"


@contextmanager
def scratch_dir(out: Path) -> Iterator[Path]:
    """A scratch directory beside ``out`` (``.<name>.partial-<pid>-<random>``, ``store``'s ``scratch_directory``, for
    the caller to rename onto ``out`` once complete), after removing those that exports to ``out`` by processes no
    longer alive left behind (a SIGKILL, a power loss). On exit, however the block ends (an error, Ctrl-C,
    SIGTERM), no scratch of this process is left beside ``out``.

    Raises:
        UserError: ``out`` cannot be written (named as given, ``unwritable``).
    """
    with ExitStack() as stack:  # the scratch's removal is held from the moment it exists
        try:
            out.parent.mkdir(parents=True, exist_ok=True)
            for old in out.parent.glob(glob.escape(_scratch_prefix(out)) + "*"):
                pid = old.name.removeprefix(_scratch_prefix(out)).split("-", 1)[0]
                if pid.isdigit() and not _alive(int(pid)):
                    shutil.rmtree(old, ignore_errors=True)
            tmp = stack.enter_context(scratch_directory(out.parent, _scratch_prefix(out), mode=0o700))
        except OSError as err:
            refused = unwritable(out, err)
            if refused is None:
                raise
            raise refused from err
        yield tmp


def _alive(pid: int) -> bool:
    """Whether process ``pid`` exists on this host."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's
        return True
    return True


def unwritable(out: Path, err: BaseException) -> UserError | None:
    """The one line for an ``err`` the system gave while writing ``out`` (a read-only or full disk, a file in the
    way: ``sweep._faults.fault_line``), naming ``out`` where it named the scratch directory; None for another error."""
    line = fault_line(err, out.parent)
    if line is None:
        return None
    if line.startswith("no space left"):  # (its advice is a study's)
        return UserError(f"export: no space left on the device for {out}: nothing was written (the partial export "
                         f"is removed); free space and run the same command again")
    scratch = re.escape(str(out.parent / _scratch_prefix(out))) + r"[\w-]*"  # <pid>-<hex>
    return UserError(f"export: {re.sub(scratch, lambda _: str(out), line)}")


def _umask() -> int:
    """The process's umask (read by setting it and putting it back: POSIX has no getter)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def plain_modes(root: Path) -> None:
    """Give ``root`` and everything in it the modes ``mkdir`` and ``open`` would have (0755 / 0644 under
    umask 022): ``scratch_dir`` made ``root`` 0700, and a serving process of another user must read the export."""
    mask = _umask()
    for path in [root, *root.rglob("*")]:
        os.chmod(path, (0o777 if path.is_dir() else 0o666) & ~mask)
