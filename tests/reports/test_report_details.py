"""The report's smaller promises: the gain over the default for every per-item metric, the importance caveat,
whole-number trial ticks, and one row per generated answer however many scorers scored it."""

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
    assert 3 < IMPORTANCE_TRIALS and "importances from 3 complete trials" in html
    assert '"dtick":1' in html.replace(" ", "") and '"tickmode":"linear"' in html.replace(" ", "")
    table = html[html.index('id="samples-table"'):]
    table = table[:table.index("</table>")]
    rows = re.findall(r"<tr>(.*?)</tr>", table, re.S)[1:]  # after the header
    keys = [tuple(re.findall(r"<td[^>]*>(.*?)</td>", row, re.S)[:2]) for row in rows]
    assert keys and len(keys) == len(set(keys)), keys  # one row per (trial, item)
    assert all("exact_match=" in row and "contains=" in row for row in rows)
