"""The report's smaller promises: the gain over the default for every per-item metric (under the heading that names
it), importances drawn only from enough trials, a trial table without a column twice, whole-number trial ticks, and
one row per generated answer however many scorers scored it."""

from __future__ import annotations

import re

from lora_sweep.reports._load import load_study_data
from lora_sweep.reports.html import IMPORTANCE_TRIALS, write_report
from lora_sweep.reports.summary import _gain_info
from lora_sweep.sweep.config.loader import load_study
from lora_sweep.sweep.study import run_study
from tests.conftest import write_study


def test_report_details(tiny_dirs, tmp_path) -> None:
    path = write_study(tmp_path, tiny_dirs("llama"), name="details", budget={"trials": 3},
                       objectives=[{"metric": "eval_loss", "direction": "minimize"}], pruning={"kind": "none"},
                       train={"max_steps": 4, "micro_batch": 4},
                       evaluators=[{"name": "heldout_loss"},
                                   {"name": "generation", "options": {"max_new_tokens": 3,
                                                                      "scorers": ["exact_match", "contains"]}}])
    spec = load_study(path)
    run_study(spec, log=lambda m: None)
    data = load_study_data(spec.out_dir)
    gain = _gain_info(data)
    assert [r.objective for r in gain.rows] == ["eval_loss", "contains", "exact_match"]  # every reported metric
    for r in gain.rows[1:]:
        assert r.direction == "maximize" and r.n_items == 200 and r.diff == r.best_value - r.default_value
    html = write_report(spec.out_dir).read_text()
    assert 3 < IMPORTANCE_TRIALS and f"importances need at least {IMPORTANCE_TRIALS} complete trials (3 so far)" in html
    importances = html[html.index('<section id="importances">'):]
    assert "Plotly.newPlot" not in importances[:importances.index("</section>")]  # noise is not drawn as a ranking
    # a study file's default is the community default: no word of a config's own hyperparameters
    assert "<h2>Gain over the community default (rank 16, alpha 32, lr 2e-4)</h2>" in html
    assert "config&#x27;s own" not in html
    trials = html[html.index('<table id="trials"'):]
    heads = re.findall(r"<th>(.*?)</th>", trials[:trials.index("</thead>")])
    assert heads.count("tokens") == 1 and "device s" in heads and not {"train_<wbr>tokens", "device_<wbr>seconds"} & \
        set(heads), heads  # their own columns, not again as metrics
    assert '"dtick":1' in html.replace(" ", "") and '"tickmode":"linear"' in html.replace(" ", "")
    table = html[html.index('id="samples-table"'):]
    table = table[:table.index("</table>")]
    rows = re.findall(r"<tr>(.*?)</tr>", table, re.S)[1:]  # after the header
    keys = [tuple(re.findall(r"<td[^>]*>(.*?)</td>", row, re.S)[:2]) for row in rows]
    assert keys and len(keys) == len(set(keys)), keys  # one row per (trial, item)
    assert all("exact_match=" in row and "contains=" in row for row in rows)
