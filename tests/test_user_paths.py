"""What the README and the example studies tell a new user to type: the commands agree, and what they write into
the clone is ignored by git."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_every_example_study_builds_its_tiny_model_with_the_readmes_command() -> None:
    readme = (ROOT / "README.md").read_text()
    assert "sweep tiny-model" in readme
    for study in sorted((ROOT / "studies").glob("*.yaml")):
        head = "".join(line for line in study.read_text().splitlines(keepends=True) if line.startswith("#"))
        if "--family llama --out models/tiny-llama" in head:  # the README's tiny Llama: the README's command
            assert "sweep tiny-model --family llama --out models/tiny-llama" in head, study.name


def test_what_the_readmes_commands_write_into_the_clone_is_ignored() -> None:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    readme = (ROOT / "README.md").read_text()
    outs = sorted({o for o in re.findall(r"--out ([\w./-]+)", readme) if not o.isupper()})  # not a DIR placeholder
    assert "best-adapter" in outs, outs
    for out in outs:
        probe = f"{out.rstrip('/')}/file"
        ignored = subprocess.run(["git", "check-ignore", "-q", probe], cwd=ROOT).returncode == 0
        assert ignored, f"README's --out {out} writes into the clone, not ignored by .gitignore"
