"""A data file's lines, each bounded before it is held whole: the reading under ``packer.data.rows``."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from lora_sweep.errors import DataError

__all__ = ["MAX_LINE_BYTES", "line_bound", "iter_lines"]

MAX_LINE_BYTES = 1 << 20
"""The longest data row read, in bytes, unless the caller says (``line_bound``): 1 MiB, some 250k tokens of text."""


def line_bound(max_length: int) -> int:
    """The row bound for examples cut to ``max_length`` tokens: ``MAX_LINE_BYTES``, or 32 bytes a token when more
    (a token is a few bytes of text; JSON escapes such as ``\\uXXXX`` take up to 6 a character)."""
    return max(MAX_LINE_BYTES, 32 * max_length)


def iter_lines(path: str | Path, max_line_bytes: int = MAX_LINE_BYTES) -> Iterator[tuple[int, str]]:
    """``(line number, text)`` of a UTF-8 file, its line breaks removed, read in bounded blocks: a line is refused
    before it is held whole or parsed once it is longer than ``max_line_bytes`` (a 50 MB single-line row would
    otherwise be read, decoded and parsed whole, several times its size in memory).

    Lines end at ``\\n``, ``\\r\\n`` or a lone ``\\r``, as Python's text files split them (JSON strings hold neither
    raw); a byte-order mark at the start is skipped.

    Raises:
        DataError: a missing or unreadable file, text that is not UTF-8, or a line over the bound (``file:line``).
    """
    lineno, offset = 0, 0
    try:
        with open(path, "rb") as f:
            while chunk := f.readline(max_line_bytes + 2):  # +2: the bound counts no "\r\n"
                start, offset = offset, offset + len(chunk)
                body = chunk.rstrip(b"\n").removesuffix(b"\r")
                if len(body) > max_line_bytes:
                    raise DataError(f"{path}:{lineno + 1}: a row longer than {max_line_bytes:,} bytes (the row "
                                    f"bound, data.max_line_bytes); cut the row or raise the bound")
                if start == 0 and body.startswith(b"\xef\xbb\xbf"):  # a byte-order mark (utf-8-sig)
                    body, start = body[3:], 3
                try:
                    text = body.decode("utf-8")
                except UnicodeDecodeError as err:
                    raise DataError(f"{path}: not UTF-8 text ({err.reason} at byte {start + err.start})") from None
                for part in text.split("\r"):
                    lineno += 1
                    yield lineno, part
    except FileNotFoundError:
        raise DataError(f"{path}: file not found") from None
    except IsADirectoryError:
        raise DataError(f"{path}: cannot read (Is a directory)") from None
    except OSError as err:
        raise DataError(f"{path}: cannot read ({err.strerror})") from None
