"""Draw the picture of the README and the docs' home page: the report's Pareto front of a study, as a PNG.

    python3 docs/figure.py runs/demo                      # writes docs/assets/demo-pareto.png
    python3 docs/figure.py STUDY_DIR --out FILE.png

The figure is the one the HTML report shows (``reports.figures.plot_pareto`` over the study directory's
results.db), with a log axis for the first objective so that trials a hundred times apart stay readable, and the
trial numbers of the front and the default written beside them.
plotly renders it through kaleido, which drives a headless Chromium (Debian's ``chromium``; the docs extra).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path

import plotly.graph_objects as go

from lora_sweep.reports._load import load_study_data
from lora_sweep.reports.figures import _pareto_info, plot_pareto

OUT = Path(__file__).resolve().parent / "assets" / "demo-pareto.png"


def draw(study_dir: Path, out: Path, *, width: int = 900, height: int = 480) -> Path:
    """Write the study's Pareto front to ``out`` (PNG); the study needs two objectives."""
    data = load_study_data(study_dir)
    info = _pareto_info(data)
    if len(info.objectives) != 2:
        raise SystemExit(f"error: {study_dir}: the picture needs a study with two objectives "
                         f"(it has {', '.join(info.objectives) or 'none'})")
    fig = plot_pareto(info)
    named = [p for p in info.points if p.front or p.default]  # the front and the default, labelled by trial number
    fig.add_trace(go.Scatter(x=[p.values[0] for p in named], y=[p.values[1] for p in named], mode="text",
                             text=[f"   #{p.number}" for p in named], textposition="middle right", showlegend=False,
                             hoverinfo="skip"))
    fig.update_xaxes(type="log")
    name = data.meta.get("name") or study_dir.resolve().name
    fig.update_layout(title=f"{name}: Pareto front (★ = the default trial)",
                      margin={"l": 70, "r": 20, "t": 60, "b": 60})
    if "BROWSER_PATH" not in os.environ and (chromium := shutil.which("chromium")):
        os.environ["BROWSER_PATH"] = chromium  # kaleido's browser: the system's, nothing downloaded
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.write_image(out, format="png", width=width, height=height, scale=1)
    return out


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("study_dir", type=Path)
    p.add_argument("--out", type=Path, default=OUT)
    args = p.parse_args(argv)
    print(draw(args.study_dir, args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
