"""The guides' code is inline (readable on GitHub and in a clone, where MkDocs includes are blank), and each inline
block taken from a repository file is that file's section, so the two never drift.

A block shown from a file is preceded by ``<!-- from PATH:SECTION ... -->``; the file marks the section with
``# --8<-- [start:SECTION]`` and ``# --8<-- [end:SECTION]`` lines (the block is the lines between, dedented).
"""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
GUIDES = sorted((ROOT / "docs").rglob("*.md"))
SHOWN = re.compile(r"^<!-- from (?P<path>[^\s:]+):(?P<section>[\w-]+)\b[^\n]*-->\n"
                   r"```(?P<lang>\w+)\n(?P<code>.*?)\n```$", re.MULTILINE | re.DOTALL)


def section(path: Path, name: str) -> str:
    """The lines of ``path`` between its ``[start:name]`` and ``[end:name]`` markers, dedented."""
    lines = path.read_text().splitlines()
    ends = (f"# --8<-- [start:{name}]", f"# --8<-- [end:{name}]")
    marks = [i for i, line in enumerate(lines) if line.strip() in ends]
    assert len(marks) == 2, f"{path.relative_to(ROOT)} marks section {name!r} {len(marks)} times, not twice"
    return textwrap.dedent("\n".join(lines[marks[0] + 1:marks[1]]))


def _shown(guide: Path) -> list[re.Match[str]]:
    return list(SHOWN.finditer(guide.read_text()))


def stale_blocks(text: str, root: Path) -> list[str]:
    """``PATH:SECTION`` of each block of the Markdown ``text`` that differs from its file's section (under ``root``)."""
    stale = []
    for match in SHOWN.finditer(text):
        source = root / match["path"]
        if not source.is_file() or match["code"] != section(source, match["section"]):
            stale.append(f"{match['path']}:{match['section']}")
    return stale


def test_no_guide_includes_code_github_cannot_show() -> None:
    """A section include (``--8<-- "file.py:section"``) is blank on GitHub; whole-page includes of a page GitHub shows
    itself (docs/performance.md of BENCHMARKS.md) are the site's copies."""
    includes = [f"{g.relative_to(ROOT)}:{n}" for g in GUIDES for n, line in enumerate(g.read_text().splitlines(), 1)
                if re.match(r'--8<-- "[^"]+:[\w-]+"', line) or (line.startswith("--8<--") and "guides" in g.parts)]
    assert not includes, f"MkDocs includes, blank outside the site: {includes}"


@pytest.mark.parametrize("guide", [g for g in GUIDES if _shown(g)], ids=lambda g: str(g.relative_to(ROOT)))
def test_each_inline_block_is_the_section_of_its_file(guide: Path) -> None:
    assert not stale_blocks(guide.read_text(), ROOT), f"{guide.name}: blocks that differ from their file; copy again"


def test_every_example_section_is_shown_in_a_guide() -> None:
    shown = {(m["path"], m["section"]) for g in GUIDES for m in _shown(g)}
    for example in sorted((ROOT / "docs" / "examples").glob("*.py")):
        rel = str(example.relative_to(ROOT))
        for name in re.findall(r"# --8<-- \[start:([\w-]+)\]", example.read_text()):
            assert (rel, name) in shown, f"{rel}:{name} is marked as a section but no guide shows it"


def test_the_extending_guide_shows_the_four_seams_and_the_contracts() -> None:
    shown = {f"{m['path']}:{m['section']}" for m in _shown(ROOT / "docs" / "guides" / "extending.md")}
    assert shown == {"docs/examples/extending_evaluator.py:evaluator", "docs/examples/extending_evaluator.py:study",
                     "docs/examples/extending_storage.py:backend", "docs/examples/extending_storage.py:use",
                     "tests/docs/test_extending.py:evaluator_contract", "tests/docs/test_extending.py:storage_contract",
                     "tests/docs/test_extending.py:check_call", "packer/families.py:family", "packer/families.py:rows",
                     "packer/tiny/families.py:tiny", "studies/variants.yaml:variants",
                     "packer/variants/lorafa.py:variant", "tests/testing/test_variant_suite.py:rows"}


def test_a_block_that_differs_from_its_file_is_stale(tmp_path: Path) -> None:
    (tmp_path / "ex.py").write_text("import os\n\n# --8<-- [start:part]\ndef f():\n    return 1\n# --8<-- [end:part]\n")
    guide = "<!-- from ex.py:part -->\n```python\ndef f():\n    return {}\n```\n"
    assert stale_blocks(guide.format(1), tmp_path) == []
    assert stale_blocks(guide.format(2), tmp_path) == ["ex.py:part"]
    assert stale_blocks(guide.format(1).replace("ex.py", "gone.py"), tmp_path) == ["gone.py:part"]
