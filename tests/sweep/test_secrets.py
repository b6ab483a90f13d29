"""No secrets in outputs: a storage URL's password is never shown, logged or stored."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from sqlalchemy.engine import make_url

from lora_sweep.store.api import redact_url, strip_password
from tests.conftest import write_study
from tests.helpers import server_url

ROOT = Path(__file__).resolve().parents[2]
SECRET = "hunter2-secret"


def test_redact_and_strip() -> None:
    url = f"postgresql+psycopg2://sweep:{SECRET}@127.0.0.1:5432/db?sslmode=require"
    assert redact_url(url) == "postgresql+psycopg2://sweep:***@127.0.0.1:5432/db?sslmode=require"
    assert strip_password(url) == "postgresql+psycopg2://sweep@127.0.0.1:5432/db?sslmode=require"
    for plain in ("sqlite:////tmp/x.db", "journal:///tmp/x.log", "runs/x.log", "mysql+pymysql://u@h/db"):
        assert redact_url(plain) == plain and strip_password(plain) == plain


def _files_without(root: Path, secret: str) -> None:
    for path in root.rglob("*"):
        if path.is_file():
            assert secret.encode() not in path.read_bytes(), f"{path} holds the password"


def test_an_unreachable_storage_error_names_the_url_without_its_password(tiny_dirs, tmp_path) -> None:
    url = f"postgresql+psycopg2://sweep:{SECRET}@127.0.0.1:9/db"  # port 9: nothing listens
    path = write_study(tmp_path, tiny_dirs("llama"), name="unreachable", storage=url, budget={"trials": 1})
    result = subprocess.run([sys.executable, "-m", "lora_sweep", "worker", str(path), "--quiet", "--index", "0"],
                            capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert result.returncode == 2, result.stderr
    assert SECRET not in result.stderr + result.stdout and "sweep:***@127.0.0.1:9/db" in result.stderr
    _files_without(tmp_path / "runs-unreachable", SECRET)


def test_a_password_in_the_storage_url_reaches_no_output(tiny_dirs, tmp_path) -> None:
    """Run a shared study on PostgreSQL with the password in the study file; then report and status."""
    url = make_url(server_url("postgresql"))
    assert url.password, "the test server's URL carries a password"
    secret = f":{url.password}@"
    path = write_study(tmp_path, tiny_dirs("llama"), name=f"secret{os.getpid()}",
                       storage=url.render_as_string(hide_password=False), budget={"trials": 2},
                       train={"max_steps": 6, "micro_batch": 2}, pruning={"kind": "none"}, pack={"max_slots": 2})
    out = tmp_path / f"runs-secret{os.getpid()}"
    env = {k: v for k, v in os.environ.items() if k != "PGPASSWORD"} | {"PGPASSWORD": url.password}
    run = subprocess.run([sys.executable, "-m", "lora_sweep", "run", str(path), "--workers", "1", "--grace", "20"],
                         capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert run.returncode == 0, run.stderr
    status = subprocess.run([sys.executable, "-m", "lora_sweep", "status", str(out), "--json"], capture_output=True,
                            text=True, timeout=120, cwd=ROOT, env=env)
    assert status.returncode == 0, status.stderr
    assert json.loads(status.stdout)["storage"] == strip_password(url.render_as_string(hide_password=False))
    for text in (run.stdout, run.stderr, status.stdout, status.stderr):
        assert secret not in text
    assert (out / "report.html").is_file()
    _files_without(out, secret)
