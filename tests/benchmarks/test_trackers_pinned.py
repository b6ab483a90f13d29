"""The pinned trackers benchmark's bookkeeping: one CPU per physical core, runs in pairs, a plain run paired with
the tracked run beside it in its round, and the summary's numbers."""

from __future__ import annotations

from pathlib import Path

import pytest

from lora_sweep.benchmarks.trackers_pinned import pairs, physical_cpus, said_cost, slots, summary


def _topology(root: Path, cores: dict[int, tuple[int, int]]) -> Path:
    for cpu, (package, core) in cores.items():
        topo = root / f"cpu{cpu}" / "topology"
        topo.mkdir(parents=True)
        (topo / "physical_package_id").write_text(f"{package}\n")
        (topo / "core_id").write_text(f"{core}\n")
    return root


def test_one_cpu_per_physical_core(tmp_path: Path) -> None:
    # 8 CPUs: 0-3 and 4-7 hyperthread siblings on one package; 8-9 a second package with core ids reused
    sys_cpu = _topology(tmp_path, {**{c: (0, c % 4) for c in range(8)}, 8: (1, 0), 9: (1, 1)})
    assert physical_cpus([7, 6, 5, 4, 3, 2, 1, 0, 8, 9], sys_cpu) == [0, 1, 2, 3, 8, 9]
    assert physical_cpus([5, 6], sys_cpu) == [5, 6]  # siblings outside the allowed set do not count
    assert physical_cpus([3, 11, 1], sys_cpu) == [1, 3, 11]  # cpu11 has no topology: every allowed CPU


def test_slots_come_in_pairs() -> None:
    assert slots(list(range(16))) == [(0, 1), (2, 3), (4, 5), (6, 7), (8, 9), (10, 11), (12, 13), (14, 15)]
    assert slots(list(range(7))) == [(0, 1), (2, 3)]  # a third run would have no partner
    assert slots([0, 1, 2], 1) == [(0,), (1,)]
    assert slots([0, 1, 2], 2) == []


def _row(rnd: int, place: int, kind: str, wall: float, cpu: float, **more: float) -> dict:
    return dict(round=rnd, place=place, kind=kind, wall=wall, cpu=cpu, rc=0, **more)


def test_pairs_and_summary() -> None:
    rows = [_row(0, 0, "plain", 100.0, 190.0), _row(0, 1, "trackers", 102.0, 193.8, trackers_cpu_during=0.9),
            _row(0, 2, "plain", 110.0, 200.0), _row(0, 3, "trackers", 110.0, 200.0, trackers_cpu_during=1.1),
            _row(1, 0, "trackers", 99.0, 188.1, trackers_cpu_during=0.99), _row(1, 1, "plain", 100.0, 190.0),
            _row(1, 2, "trackers", 120.0, 240.0), _row(1, 3, "plain", 120.0, 240.0)]
    found = pairs(rows)
    assert [(p["round"], p["place"], t["place"]) for p, t in found] == [(0, 0, 1), (0, 2, 3), (1, 1, 0), (1, 3, 2)]
    assert all(p["kind"] == "plain" and t["kind"] == "trackers" for p, t in found)
    table = summary(rows)
    assert table[0] == "| pairs | 4 (failed runs: 0) |"
    # medians: plain 100, 110, 100, 120 -> 105; trackers 102, 110, 99, 120 -> 106
    assert table[1] == "| median wall, plain / trackers | 105.0 s / 106.0 s (+0.95%) |"
    # changes +2, 0, -1, 0 %: mean +0.25, sample SD 1.258, SE 0.63; median 0
    assert table[2] == "| pairs' wall change: mean (SE), median | +0.25% (0.63), +0.00% |"
    assert table[3] == "| pairs' wall change: min, max | -1.00%, +2.00% |"
    assert table[4] == "| pairs' change in the run's own CPU s: mean, median | +0.25%, +0.00% |"
    # the trackers' own CPU: 0.9/102, 1.1/110, 0.99/99 (the fourth did not say): 0.88%, 1.00%, 1.00%
    assert table[5] == "| trackers' CPU during the run, % of its wall: median, max | 1.00%, 1.00% |"


def test_summary_of_no_pairs_fails_loudly() -> None:
    with pytest.raises(ValueError):
        summary([_row(0, 0, "plain", 100.0, 190.0)])


def test_said_cost_reads_the_trackers_last_line() -> None:
    log = ("run: 6 complete\ntrackers: 60 passes; CPU 4.12 s in their process (2.73 s preparing, 0.05 s after the "
           "run), 0.17 s in its child processes\n")
    said = said_cost(log)
    assert said is not None and said["passes"] == 60 and said["own"] == 4.12 and said["children"] == 0.17
    assert said["during"] == pytest.approx(4.12 - 2.73 - 0.05 + 0.17)
    assert said_cost("run: 6 complete\n") is None
