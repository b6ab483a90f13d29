"""The HTML report of a real (tiny) study, opened in headless chromium: no JavaScript error, every figure drawn,
nothing fetched from the network, the trial table sorts; plus ``sweep report`` on the command line."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from lora_sweep.reports.html import write_report
from tests.reports._browser import KEPT, load_page, need_chromium
from tests.reports._study import ROOT


def _artifacts(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where screenshots are kept: $TEST_ARTIFACTS/reports (CI can upload it), else under pytest's base temp."""
    root = Path(os.environ["TEST_ARTIFACTS"]) if os.environ.get("TEST_ARTIFACTS") else (
        tmp_path_factory.getbasetemp() / "artifacts")
    (root / "reports").mkdir(parents=True, exist_ok=True)
    return root / "reports"


def test_report_is_self_contained(study: Path, tmp_path: Path) -> None:
    text = write_report(study, tmp_path / "r.html").read_text()
    assert len(re.findall(r"\* plotly\.js v[\d.]+", text)) == 1, "plotly.js must be embedded exactly once"
    assert not re.search(r"<script[^>]+src=", text) and not re.search(r"<link[^>]+href=", text)
    assert "cdn." not in text.split("</head>")[1].lower()  # the body (our part) names no CDN
    assert "Could not draw" not in text


def test_report_renders_in_headless_chromium(study: Path, tmp_path: Path, tmp_path_factory) -> None:
    need_chromium()
    report = write_report(study)
    figures = report.read_text().count("Plotly.newPlot(")
    shot = tmp_path / "report.png"
    result = load_page(report.resolve().as_uri(), user_data_dir=tmp_path / "chromium-profile", screenshot=shot,
                       expressions={
                           "plots": "document.querySelectorAll('.js-plotly-plot').length",
                           "drawn": "Array.from(document.querySelectorAll('.js-plotly-plot'))"
                                    ".filter(p => p.querySelector('.main-svg')).length",
                           "rows": "document.querySelectorAll('#trials tbody tr').length",
                           "sorted": """(() => {
                               const th = Array.from(document.querySelectorAll('#trials th'))
                                   .find(h => h.textContent === 'eval_loss');
                               const col = Array.from(th.parentNode.children).indexOf(th);
                               th.click();
                               return Array.from(document.querySelectorAll('#trials tbody tr'))
                                   .map(r => r.cells[col].getAttribute('data-v'));
                           })()""",
                       })
    keep = _artifacts(tmp_path_factory) / "report.png"
    shutil.copyfile(shot, keep)
    KEPT.append(keep)
    assert result.errors == [], result.errors
    assert result.requests == [], f"the report fetched from the network: {result.requests}"
    assert figures >= 8 and result.values["plots"] == figures and result.values["drawn"] == figures
    assert result.values["rows"] == 8
    keys = result.values["sorted"]
    numbers = [float(k) for k in keys if k]
    assert numbers == sorted(numbers) and keys[len(numbers):] == [""] * (len(keys) - len(numbers))  # empties last
    assert shot.stat().st_size > 50_000


def test_the_trial_table_fits_a_1400_px_window(study: Path, tmp_path: Path) -> None:
    """Every column of the trial table in view at 1400 px: long cells (adapter path, reason) wrap, headers break
    after an underscore, and the metrics that have columns of their own are not repeated."""
    need_chromium()
    report = write_report(study, tmp_path / "r.html")
    result = load_page(report.resolve().as_uri(), user_data_dir=tmp_path / "chromium-profile",
                       screenshot=tmp_path / "wide.png", width=1400, expressions={
                           "table": "document.getElementById('trials').getBoundingClientRect().width",
                           "box": "document.getElementById('trials').parentNode.clientWidth",
                           "page": "document.documentElement.scrollWidth"})
    assert result.errors == [], result.errors
    assert result.values["table"] <= result.values["box"] and result.values["page"] <= 1400, result.values


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lora_sweep", *args], capture_output=True, text=True, cwd=ROOT,
                          timeout=120)


def test_cli_report(study: Path, tmp_path: Path) -> None:
    out = tmp_path / "elsewhere" / "study.html"
    proc = _cli("report", str(study), "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    assert out.is_file() and proc.stdout.strip() == f"report: {out}"
    assert 'href="../../' in out.read_text() or "adapters/trial-" in out.read_text()  # adapter links resolve
    bad = _cli("report", str(tmp_path))
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "not a study directory" in bad.stderr


def test_the_report_preload_imports_what_write_report_loads_lazily() -> None:
    code = ("import sys; from lora_sweep.reports.html import preload; lazy = ('optuna.visualization', 'scipy.stats'); "
            "assert not any(m in sys.modules for m in lazy); preload(); "
            "assert all(m in sys.modules for m in lazy)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
