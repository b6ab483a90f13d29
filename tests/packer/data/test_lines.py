"""A data row's size is bounded before it is parsed: a row over the bound is refused by ``file:line`` having read at
most the bound, whatever the row's length; lines end as Python's text files end them."""

from __future__ import annotations

import tracemalloc
from pathlib import Path

import pytest

from lora_sweep.errors import DataError
from lora_sweep.packer.data.lines import MAX_LINE_BYTES, iter_lines, line_bound
from lora_sweep.packer.data.rows import read_jsonl


def test_a_50_mb_row_is_refused_by_file_line_without_being_read_whole(tmp_path: Path) -> None:
    path = tmp_path / "big.jsonl"
    with open(path, "w") as f:
        f.write('{"text": "a short row"}\n')
        f.write('{"text": "' + "x" * (50 << 20) + '"}\n')
    tracemalloc.start()
    try:
        with pytest.raises(DataError) as err:
            read_jsonl(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert str(err.value) == (f"{path}:2: a row longer than {MAX_LINE_BYTES:,} bytes (the row bound, "
                              f"data.max_line_bytes); cut the row or raise the bound")
    assert peak < 4 * MAX_LINE_BYTES  # the line is 50 MB: it was never held whole


def test_the_bound_is_the_callers_and_counts_no_line_break(tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl"
    row = '{"text": "abcdefgh"}'  # 20 bytes
    path.write_text(f"{row}\r\n{row}\n")
    assert len(read_jsonl(path, max_line_bytes=20)[1]) == 2
    with pytest.raises(DataError, match=r"d\.jsonl:1: a row longer than 19 bytes"):
        read_jsonl(path, max_line_bytes=19)
    assert line_bound(512) == MAX_LINE_BYTES and line_bound(1 << 16) == 32 << 16


def test_lines_end_as_text_files_end_them(tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl"
    path.write_bytes(b'\xef\xbb\xbf{"a": 1}\r\n{"b": 2}\r{"c": "\xc3\xa9"}\n\n{"d": 4}')
    assert list(iter_lines(path)) == [(1, '{"a": 1}'), (2, '{"b": 2}'), (3, '{"c": "\u00e9"}'), (4, ""),
                                      (5, '{"d": 4}')]
    path.write_bytes(b'{"a": 1}\n{"b": "\xff"}\n')
    with pytest.raises(DataError, match=r"d\.jsonl: not UTF-8 text \(invalid start byte at byte 16\)"):
        list(iter_lines(path))
