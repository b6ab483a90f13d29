"""The screenshots of docs/guides/trackers.md, from a real run: the tiny demo (studies/tiny-demo.yaml, 8 trials)
logged to MLflow and TensorBoard, each tracker's own UI served on localhost, and each page opened in Debian's headless
chromium (``tests.reports._browser``, the driver the site tests use). Needs the mlflow and tensorboard extras and
chromium; writes docs/assets/screenshots/trackers-mlflow.png and trackers-tensorboard.png.

    python docs/tracker_screenshots.py
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.reports._browser import load_page  # noqa: E402  (the checkout's root first)

SHOTS = ROOT / "docs" / "assets" / "screenshots"
MLFLOW_PORT, TB_PORT = 5077, 6077
WAIT = "new Promise(r => setTimeout(() => r(1), 5000))"
SEARCH = ("(() => { const i = document.querySelector('input[placeholder=\"Search metric charts\"]');"
          " Object.getOwnPropertyDescriptor(HTMLInputElement.prototype, 'value').set.call(i, 'train/loss');"
          " i.dispatchEvent(new Event('input', {bubbles: true})); return 1; })()")
"""MLflow's chart view filtered to the training loss, per optimizer step, one line per trial's run."""


def _run_study(work: Path) -> Path:
    python = [sys.executable, "-m", "lora_sweep"]
    subprocess.run([*python, "tiny-model", "--family", "llama", "--out", str(work / "models" / "tiny-llama")],
                   check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    shutil.copytree(ROOT / "studies" / "data", work / "data")
    study = work / "tiny-demo.yaml"
    study.write_text((ROOT / "studies" / "tiny-demo.yaml").read_text().replace("../models/", "./models/"))
    subprocess.run([*python, "run", str(study), "--quiet", "--out", str(work / "run"), "budget.trials=8",
                    "trackers=[mlflow, tensorboard]"], check=True, cwd=ROOT)
    return work / "run"


def _serve(command: list[str], url: str, log: Path) -> subprocess.Popen:
    proc = subprocess.Popen(command, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)
    for _ in range(240):
        try:
            urllib.request.urlopen(url, timeout=2)
            return proc
        except OSError:
            time.sleep(0.5)
    proc.kill()
    raise SystemExit(f"no server at {url}; see {log}")


def main() -> None:
    from mlflow import MlflowClient

    with tempfile.TemporaryDirectory(prefix="lora-sweep-tracker-shots.") as tmp:
        work = Path(tmp)
        run = _run_study(work)
        store = f"sqlite:///{run / 'mlflow.db'}"
        experiment = MlflowClient(tracking_uri=store).get_experiment_by_name("tiny-demo").experiment_id
        servers = [
            _serve(["mlflow", "ui", "--backend-store-uri", store, "--host", "127.0.0.1", "--port", str(MLFLOW_PORT)],
                   f"http://127.0.0.1:{MLFLOW_PORT}/health", work / "mlflow.log"),
            _serve(["tensorboard", "--logdir", str(run / "tensorboard"), "--host", "127.0.0.1", "--port",
                    str(TB_PORT)], f"http://127.0.0.1:{TB_PORT}/", work / "tensorboard.log")]
        try:
            # the study's run expanded to its trials' nested runs, the assistant panel closed, the loss charts
            load_page(f"http://127.0.0.1:{MLFLOW_PORT}/#/experiments/{experiment}/runs?compareRunsMode=CHART",
                      user_data_dir=work / "chromium-mlflow", screenshot=SHOTS / "trackers-mlflow.png", width=1600,
                      settle_expression="document.querySelectorAll('button[data-component-id*=runnamecell]').length",
                      expressions={"close": "document.querySelector('button[aria-label=Close]')?.click() ?? 0",
                                   "expand": "document.querySelector('button[data-component-id*=runnamecell]')"
                                             "?.click() ?? 0", "wait": WAIT, "search": SEARCH, "drawn": WAIT})
            load_page(f"http://127.0.0.1:{TB_PORT}/#scalars&tagFilter=train%2Floss%7Crung", width=1400,
                      user_data_dir=work / "chromium-tensorboard", screenshot=SHOTS / "trackers-tensorboard.png",
                      settle_expression="document.querySelectorAll('svg, canvas').length",
                      expressions={"drawn": WAIT})
        finally:
            for proc in servers:
                proc.terminate()
                proc.wait(timeout=30)
    for name in ("trackers-mlflow.png", "trackers-tensorboard.png"):
        print(f"{SHOTS / name}: {(SHOTS / name).stat().st_size // 1024} KiB")


if __name__ == "__main__":
    main()
