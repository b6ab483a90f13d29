"""The documentation site, built strictly by docs/build.sh, served on localhost and opened in headless Chromium:
the getting-started page and the study-file reference render (their headings, tables and navigation are there),
with no JavaScript error, console error or error log entry, and nothing fetched from outside the site.

Screenshots go to $DOCS_SCREENSHOTS (``DOCS_SCREENSHOTS=docs/assets/screenshots`` refreshes the repository's),
else $TEST_ARTIFACTS/docs, else pytest's base temp.
"""

from __future__ import annotations

import functools
import http.server
import os
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import need_module
from tests.reports._browser import KEPT, load_page, need_chromium

ROOT = Path(__file__).resolve().parents[2]
PAGES = {
    "getting-started": ("getting-started.html", "Getting started", 2),
    "study-file": ("reference/study-file.html", "Study-file reference", 15),
}
"""screenshot name -> (page, its title, at least this many tables)."""


def _shots(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if os.environ.get("DOCS_SCREENSHOTS"):
        root = Path(os.environ["DOCS_SCREENSHOTS"])
    elif os.environ.get("TEST_ARTIFACTS"):
        root = Path(os.environ["TEST_ARTIFACTS"]) / "docs"
    else:
        root = tmp_path_factory.getbasetemp() / "artifacts" / "docs"
    root.mkdir(parents=True, exist_ok=True)
    return root


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    need_module("mkdocs", "docs")
    out = tmp_path_factory.mktemp("site")
    run = subprocess.run(["bash", str(ROOT / "docs" / "build.sh")], cwd=ROOT, env={**os.environ, "SITE_DIR": str(out)},
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return out


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:  # noqa: A002  (the base class's name)
        pass


@pytest.fixture(scope="module")
def served(site: Path) -> Iterator[str]:
    """The site on http://127.0.0.1:PORT/, as a user's ``python3 -m http.server`` serves it (search needs a server)."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_Quiet, directory=str(site)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(PAGES))
def test_page_renders_in_headless_chromium(name: str, served: str, tmp_path: Path, tmp_path_factory) -> None:
    need_chromium()
    page, title, tables = PAGES[name]
    shot = _shots(tmp_path_factory) / f"{name}.png"
    result = load_page(served + page, user_data_dir=tmp_path / "chromium-profile", screenshot=shot,
                       settle_expression="document.querySelectorAll('article h1, article table').length",
                       expressions={"h1": "document.querySelector('article h1').firstChild.textContent",
                                    "tables": "document.querySelectorAll('article table').length",
                                    "nav": "document.querySelectorAll('nav.md-nav a').length",
                                    "styled": "getComputedStyle(document.body).fontFamily"})
    KEPT.append(shot)
    assert result.errors == [], result.errors
    outside = [url for url in result.requests if not url.startswith(served)]
    assert outside == [], f"fetched from outside the site: {outside}"
    assert any(url.endswith("search_index.json") for url in result.requests), "the search index was not loaded"
    assert result.values["h1"].strip() == title
    assert result.values["tables"] >= tables
    assert result.values["nav"] >= 10, "the navigation did not render"
    assert shot.stat().st_size > 20_000
