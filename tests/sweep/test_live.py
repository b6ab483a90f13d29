"""Progress without a terminal, read line by line, and every way a run ends: in its output, status and report."""

from __future__ import annotations

import io
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lora_sweep.sweep.config.loader import load_study
from lora_sweep.sweep.live import LiveProgress, PlainLog
from lora_sweep.sweep.status import study_status
from lora_sweep.sweep.study import Progress, run_study
from tests.conftest import write_study

ROOT = Path(__file__).resolve().parents[2]
STAMP = r"\d\d:\d\d:\d\d "


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _frame(step: int, finished: int, eta: float | None = None, phase: str = "training") -> Progress:
    return Progress(step, 2, 3, 1234.5, finished, 6, "-", eta, phase)


def test_plain_log_prints_each_event_and_a_status_line_a_minute() -> None:
    out, clock = io.StringIO(), _Clock()
    log = PlainLog(out, every_s=60, clock=clock)
    log.tick()  # nothing for less than a minute: quiet
    clock.now += 61
    log.tick()  # still loading, a minute on: says so
    log.line("trial 0 (community default) started in slot 0: rank=16")  # the run's log, as it happens
    clock.now += 60
    log.tick()  # the first step, a minute on: says that, not loading again
    log.update(_frame(1, 0))
    clock.now += 10
    log.update(_frame(2, 0))  # a plain step within the minute: no line
    log.line("trial 0 (community default) complete: eval_loss=1.5 (3 steps, 120 tokens)")
    log.update(_frame(3, 1, eta=90))  # a trial finished: a status line
    clock.now += 30
    log.update(_frame(4, 1))
    clock.now += 31
    log.tick()  # the ticker, a minute after the last status line
    lines = out.getvalue().splitlines()
    assert all(re.match(STAMP, line) for line in lines), lines
    bodies = [line[9:] for line in lines]
    assert bodies[0] == "starting (0:01:01 elapsed): loading"
    assert bodies[1] == "trial 0 (community default) started in slot 0: rank=16"
    assert bodies[2] == "starting (0:02:01 elapsed): the first step (warm-up, compile)"
    assert bodies[3] == "trial 0 (community default) complete: eval_loss=1.5 (3 steps, 120 tokens)"
    assert bodies[4].startswith("progress: 1/6 trials finished  step 3  slots 2/3  1,234 tok/s  ETA 0:01:30")
    assert bodies[5].startswith("progress: 1/6 trials finished  step 4") and "ETA -" in bodies[5]
    assert len(bodies) == 6, bodies


def test_the_status_line_says_each_start_phase_then_counts_the_eta_down_and_says_an_evaluation() -> None:
    out, clock = io.StringIO(), _Clock()
    log = PlainLog(out, every_s=60, clock=clock)
    for line, phase in (("loading the base model m on cpu (model.dtype: auto)", "loading the base model"),
                        ("tokenizing the data (data.max_length: 48)", "tokenizing the data"),
                        ("calibrating the memory model on cuda:0: 1 x 4 probe packs", "calibrating the memory model"),
                        ("pack 1: training 3 slots on 20 examples (its first step also warms up)",
                         "the first step (warm-up, compile)")):
        log.line(line)
        clock.now += 60
        log.tick()
        assert out.getvalue().splitlines()[-1].endswith(f"elapsed): {phase}")
    log.update(_frame(1, 0, eta=600))  # the first step's frame: an ETA at once, though no trial finished
    clock.now += 60
    log.tick()
    assert " step 1 " in out.getvalue().splitlines()[-1] and "ETA 0:09:00" in out.getvalue().splitlines()[-1]
    log.update(_frame(5, 0, eta=480, phase="evaluating"))  # an evaluation starts
    clock.now += 120
    log.tick()  # two minutes into it
    last = out.getvalue().splitlines()[-1][9:]
    assert last.startswith("progress: 0/6 trials finished  evaluating  step 5") and "ETA 0:06:00" in last, last
    assert sum("starting" in line for line in out.getvalue().splitlines()) == 4  # never once a step has run


def test_live_progress_off_a_terminal_is_plain(capsys) -> None:
    live = LiveProgress()  # pytest's captured stderr is no terminal
    assert live.plain is not None
    with live:
        live.log("trial 3 started in slot 1: lr=0.001")
        live.update(_frame(1, 0))
        live.log("a log line")
    err = capsys.readouterr().err
    assert re.search(STAMP + r"trial 3 started in slot 1: lr=0.001\n", err)
    assert re.search(STAMP + "a log line\n", err) and "\x1b[" not in err  # no terminal codes in a log file


def test_quiet_keeps_warnings_and_the_end_but_not_the_progress_notes(capsys) -> None:
    from lora_sweep.sweep.session import Note

    with LiveProgress(enabled=False) as live:  # sweep run --quiet
        live.log(Note("trial 3 started in slot 1: lr=0.001"))
        live.log("warning: trial 3 warms up for 10 steps of its 4")
    err = capsys.readouterr().err
    assert err == "warning: trial 3 warms up for 10 steps of its 4\n", err


def _run(spec, out: io.StringIO):  # noqa: ANN001, ANN202
    log = PlainLog(out, every_s=60)
    return run_study(spec, progress=log.update, log=log.line)


def test_a_run_logs_every_trial_and_how_it_ended(tiny_dirs, tmp_path) -> None:
    spec = load_study(write_study(tmp_path, tiny_dirs("llama"), name="logged", budget={"trials": 4}))
    out = io.StringIO()
    summary = _run(spec, out)
    bodies = [line[9:] for line in out.getvalue().splitlines()]
    started = [b for b in bodies if re.fullmatch(r"trial \d+( \(community default\))? started in slot \d: .*", b)]
    ended = [b for b in bodies if re.fullmatch(r"trial \d+( \(community default\))? (complete: eval_loss=\S+, "
                                               r"adapter_params=\S+|pruned by cohort SHA at step 6) .*", b)]
    assert len(started) == 4 and len(ended) == 4, bodies
    assert started[0].startswith("trial 0 (community default) started") and "rank=16" in started[0]
    assert any(b.startswith("progress: ") and "ETA" in b for b in bodies)
    line = "stopped: budget.trials reached: 4 trials used of 4 trials"
    assert bodies[-1] == f"logged: {line}" and summary.ended == line and not summary.over
    assert study_status(spec.out_dir)["last_end"]["text"] == line
    from lora_sweep.reports.html import write_report

    assert line in write_report(spec.out_dir).read_text()


def test_start_lines_come_before_training_and_a_trials_start_is_stamped_when_it_starts(tiny_dirs, tmp_path) -> None:
    spec = load_study(write_study(tmp_path, tiny_dirs("llama"), name="start", budget={"trials": 2},
                                  train={"max_steps": 3, "micro_batch": 2}, pruning={"kind": "none"}))
    said: list[tuple[float, str]] = []
    frames: list[float] = []
    run_study(spec, progress=lambda p: frames.append(time.time()), log=lambda m: said.append((time.time(), m)))
    lines = [m for _, m in said]
    assert lines[0].startswith(f"loading the base model {spec.model.path} on cpu")
    assert lines[1] == "tokenizing the data (data.max_length: 48)"
    assert lines[2] == "pack 1: training 3 slots on 2000 examples (its first step also warms up)"
    assert lines[3].startswith("trial 0 (community default) started in slot 0")
    # said when the trial is asked, before the pack's first step (and its progress frame) ends
    assert said[3][0] < frames[0] and said[4][0] < frames[0], (said, frames)


def test_a_wall_time_overshoot_is_flagged(tiny_dirs, tmp_path) -> None:
    spec = load_study(write_study(tmp_path, tiny_dirs("llama"), name="late", budget={"wall_time": 0.5},
                                  pruning={"kind": "none"}))
    summary = _run(spec, io.StringIO())
    assert summary.end_reason == "budget.wall_time" and summary.over
    assert re.fullmatch(r"stopped: budget.wall_time reached: [\d.,]+ s used of 0.5 s \(OVER by [\d.,]+ s: the "
                        r"trials training when it was reached ran to their end\)", summary.ended), summary.ended
    from lora_sweep.reports.html import write_report

    html = write_report(spec.out_dir).read_text()
    assert re.search(r"0\.5 \(OVER by [\d.,]+ s\)", html) and "budget.wall_time reached" in html


def test_an_error_is_recorded_as_the_end(tiny_dirs, tmp_path, monkeypatch) -> None:
    import lora_sweep.sweep.study as study

    spec = load_study(write_study(tmp_path, tiny_dirs("llama"), name="broken", budget={"trials": 2}))

    def boom(*a, **k):  # noqa: ANN002, ANN003, ANN202
        raise RuntimeError("evaluator exploded\nsecond line")

    monkeypatch.setattr(study, "evaluate", boom)
    out = io.StringIO()
    with pytest.raises(RuntimeError):
        _run(spec, out)
    end = study_status(spec.out_dir)["last_end"]
    assert end["reason"] == "error"
    assert re.fullmatch(r"stopped by an error at pack step \d+ \(0 trials finished in this run; the 2 training are "
                        r"retried when the run is resumed\): evaluator exploded", end["text"]), end
    # the run's output does not repeat it: the raised error is the one line its caller shows (the CLI's error:
    # line, or a bug's traceback), so a disk-full or data error stays one line
    assert "stopped by an error" not in out.getvalue()


@pytest.mark.parametrize(("sig", "code", "said"), [(signal.SIGTERM, 143, "terminated (SIGTERM)"),
                                                   (signal.SIGINT, 130, "interrupted (Ctrl-C)")])
def test_a_signal_stops_the_run_and_says_so(tiny_dirs, tmp_path, sig: int, code: int, said: str) -> None:
    path = write_study(tmp_path, tiny_dirs("llama"), name="signalled", budget={"trials": 6},
                       train={"max_steps": 400, "micro_batch": 4}, pruning={"kind": "none"})
    log = tmp_path / "run.log"
    with log.open("w") as f:  # a log file, as under nohup: no terminal
        proc = subprocess.Popen([sys.executable, "-m", "lora_sweep", "run", str(path)], cwd=ROOT, stdout=f,
                                stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    deadline = time.time() + 180
    while " started in slot 2" not in log.read_text() and time.time() < deadline:
        time.sleep(0.2)
    proc.send_signal(sig)
    assert proc.wait(timeout=120) == code
    text = log.read_text()
    assert re.search(rf"signalled: stopped: {re.escape(said)} at pack step \d+ \(0 trials finished in this run; "
                     r"the 3 training are retried when the run is resumed\)", text), text
    assert "Traceback" not in text
    assert said in study_status(tmp_path / "runs-signalled")["last_end"]["text"]


def test_a_ctrl_c_a_library_wrapped_in_its_own_error_still_stops_the_run_as_an_interrupt(tiny_dirs, tmp_path,
                                                                                          monkeypatch) -> None:
    """A Ctrl-C that lands inside transformers' lazy import of a name surfaces as ModuleNotFoundError (by way of
    Python's RuntimeError around ``__set_name__``): the run still ends as interrupted, resumable, and raises the
    KeyboardInterrupt itself, which the command line turns into exit 130."""
    import lora_sweep.sweep.study as study

    spec = load_study(write_study(tmp_path, tiny_dirs("llama"), name="wrapped", budget={"trials": 2}))

    def interrupted_import(*a, **k):  # noqa: ANN002, ANN003, ANN202
        try:
            try:
                raise KeyboardInterrupt
            except KeyboardInterrupt as err:
                raise RuntimeError("Error calling __set_name__ on 'Field' instance 'target_modules'") from err
        except RuntimeError as err:
            raise ModuleNotFoundError("Could not import module 'get_scheduler'.") from err

    monkeypatch.setattr(study, "evaluate", interrupted_import)
    with pytest.raises(KeyboardInterrupt) as caught:
        _run(spec, io.StringIO())
    assert caught.value.__suppress_context__
    end = study_status(spec.out_dir)["last_end"]
    assert end["reason"] == "interrupt"
    assert end["text"].startswith("stopped: interrupted (Ctrl-C) at pack step "), end


def test_a_run_has_an_eta_from_its_first_step_in_steps_and_says_its_evaluations(tiny_dirs, tmp_path) -> None:
    """No trial finishes before the pack's trials reach their rung, yet the first frame has an ETA: the budget's
    expected steps (6 trials of 12 steps, 1 in 2 kept at step 6: 9 each, 3 slots) at the run's pace; the
    evaluations are said as they start, and the ETA is 0 once the budget is spent."""
    spec = load_study(write_study(tmp_path, tiny_dirs("llama"), name="eta"))
    frames: list[tuple[float, Progress]] = []
    run_study(spec, progress=lambda p: frames.append((time.time(), p)), log=lambda m: None)
    first = frames[0][1]
    assert first.phase == "training" and first.finished == 0 and first.eta_s is not None and first.eta_s > 0
    end = frames[-1][0]
    half = next((t, p) for t, p in frames if p.phase == "training" and t - frames[0][0] >= (end - frames[0][0]) / 2)
    assert 0.5 < half[1].eta_s / (end - half[0]) < 2, (half, end)  # halfway: the time left within 2x
    assert any(p.phase == "evaluating" for _, p in frames)
    assert frames[-1][1].eta_s == 0.0
