"""lora-sweep against Optuna + PEFT, head to head: one study file run every way on one device, one table.

The ways (``--ways``, in this order):

- ``sweep``: ``sweep run`` (``api.run``) of the study: its trials packed as slots of one training run.
- ``peft``: Optuna with the study's sampler, seed, rungs and reduction factor, each trial trained eagerly by
  transformers + PEFT alone on a base loaded once, one trial after another (``benchmarks.optuna_peft``, whose
  docstring lists what it does the same per trial and what differs).
- ``peft-graph``: the same, each trial's step at fixed shapes, captured as a CUDA graph (on a CPU: under
  ``torch.compile``): the strongest single-trial loop.
- ``peft-procs``: N ``peft`` processes sharing the device and one Optuna study (a journal file), the trials dealt
  between them, for each N of ``--procs``; its row is the N with the shortest makespan, every N in the JSON.
- ``peft-graph-procs``: the same with ``peft-graph``'s step in every process.

Every way trains the same ``--trials`` trials (the study's ``budget.trials`` by default; no wall-time budget) and
scores them by held-out loss only (a study's other evaluators are dropped from every way). Per way: the makespan
(wall seconds from the start of the way, the base's load included, to its last trial told), device seconds per
finished trial (makespan x 1 device / trials: every way holds the whole device), complete / pruned trials, the
best held-out loss, and the time to target: the first moment a complete trial of the way closes 95% of the gap
between the community default's held-out loss (trial 0, enqueued first in every way) and the best held-out loss any
way found (``gap_target``); with ``--target LOSS``, also the first moment one reaches a held-out loss of ``LOSS``
or less, a column of its own. Each way's finished trials are logged with their seconds since its start
(``trials.csv``: way, t_s, trial, state, eval_loss), so the curve of best-so-far against time can be drawn.
``vs_peft.json`` holds the rows, every N of the processes ways, the trial logs and the settings; the table comes last.

Each way (each N of a processes way) is recorded in ``--out`` as it ends and is not run again by a later command
with the same settings (study file, overrides, shape, trials), which adds the ways it runs to the same table: on a
machine whose commands have a time limit, one way per command. A way cut short is run again from its start.

``--shape`` swaps the study's model for a random-init model of that architecture shape
(``benchmarks.shapes.SHAPES``, e.g. ``qwen2.5-0.5b``; throughput does not depend on weight values), saved once
under ``--out`` with the study model's tokenizer (whose ids its larger vocabulary covers).

Run: ``python -m lora_sweep.benchmarks.vs_peft --study studies/demo-gpu.yaml [--shape qwen2.5-0.5b]
[--ways sweep,peft,peft-graph,peft-procs,peft-graph-procs] [--procs 1,2,4,8] [--trials N] [--target LOSS] [--out DIR]
[key=value ...]``.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import gc
import json
import math
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import optuna
import torch

from lora_sweep import api
from lora_sweep.benchmarks import optuna_peft
from lora_sweep.benchmarks.shapes import SHAPES, build_shape
from lora_sweep.benchmarks.timing import check_row
from lora_sweep.errors import UserError
from lora_sweep.sweep.config.spec import Budget, EvalSpec, StudySpec
from lora_sweep.sweep.device import resolve_device

__all__ = ["WAYS", "Way", "prepare", "gap_target", "time_to_target", "vs_peft", "table", "main"]

WAYS = ("sweep", "peft", "peft-graph", "peft-procs", "peft-graph-procs")
PROCS_WAYS = ("peft-procs", "peft-graph-procs")
"""Ways of N processes: each N is recorded apart (``<way>-<N>``), the way's row is its fastest N."""
GAP = 0.95
"""Time to target: the first complete trial that closes this fraction of the gap between the community default's
held-out loss and the best any way found (a target set by the study's own losses, not a fraction of the loss: on a
task learned to a loss of 0.002, 1% of it sits inside the noise between trials)."""


@dataclasses.dataclass
class Way:
    """One way's run: its makespan and its finished trials, each with its seconds since the way's start."""

    name: str
    makespan_s: float
    trials: list[dict[str, Any]]
    """``{t, trial, state, eval_loss, ...}`` in the order they finished."""
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def best(self) -> float | None:
        losses = [t["eval_loss"] for t in self.trials if t["state"] == "COMPLETE" and t["eval_loss"] is not None]
        return min(losses) if losses else None

    def count(self, state: str) -> int:
        return sum(t["state"] == state for t in self.trials)


def prepare(spec: StudySpec, trials: int | None, out: Path) -> StudySpec:
    """The study every way runs: ``trials`` trials and no other budget, ``heldout_loss`` as its only evaluator, the
    sweep's study directory ``out/sweep``.

    Raises:
        UserError: no trial count, an objective or pruning proxy the PEFT ways cannot measure, sample packing, a
            quantized base or a sharded pack.
    """
    n = trials or spec.budget.trials
    if not n:
        raise UserError(f"vs_peft: {spec.name}: no budget.trials in the study; give --trials N")
    unknown = sorted({o.metric for o in spec.objectives} - set(optuna_peft.METRICS)
                     | ({spec.prune_metric()[0]} - {"eval_loss", "perplexity"} if spec.pruning.kind != "none"
                        else set()))
    if unknown:
        raise UserError(f"vs_peft: {spec.name}: objectives/pruning.proxy {', '.join(unknown)}: the PEFT ways measure "
                        f"only {', '.join(optuna_peft.METRICS)}")
    if spec.train.sample_packing or any(p.name == "sample_packing" for p in spec.search.params):
        raise UserError(f"vs_peft: {spec.name}: sample_packing is not benchmarked (the PEFT ways pad rows)")
    if spec.model.quantize is not None or spec.pack.shard != "none":
        raise UserError(f"vs_peft: {spec.name}: model.quantize / pack.shard are not benchmarked (the PEFT ways "
                        f"train a plain base on one device)")
    heldout = [e for e in spec.evaluators if e.name == "heldout_loss"] or [EvalSpec("heldout_loss")]
    return dataclasses.replace(spec, budget=Budget(trials=n), evaluators=tuple(heldout), output=out / "sweep")


def shape_base(shape: str, spec: StudySpec, out: Path) -> Path:
    """A random-init model of ``shape`` with the study model's tokenizer, saved under ``out`` (reused if there)."""
    from transformers import AutoTokenizer

    folder = out / f"base-{shape}"
    if (folder / "config.json").exists():
        return folder
    device = resolve_device(spec.model.device)
    dtype = torch.bfloat16 if device.startswith("cuda") and spec.model.dtype in ("auto", "bfloat16") \
        else torch.float32
    model = build_shape(shape, device=device, dtype=dtype)
    tokenizer = AutoTokenizer.from_pretrained(spec.model.path)
    if len(tokenizer) > model.config.vocab_size:
        raise UserError(f"vs_peft: --shape {shape}: its vocabulary ({model.config.vocab_size}) is smaller than the "
                        f"study model's tokenizer ({len(tokenizer)})")
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    del model
    _free()
    return folder


def run_sweep(spec: StudySpec) -> Way:
    """``sweep run`` of the study; its trials' times are their ``finished`` stamps in results.db."""
    t0 = time.time()
    api.run(spec, log=lambda m: print(m, file=sys.stderr, flush=True))
    span = time.time() - t0
    trials = [dict(t=r.finished - t0, trial=r.number, state=r.state, params=r.params,
                   eval_loss=(r.metrics or {}).get("eval_loss") if r.state == "COMPLETE" else None)
              for r in api.open_results(spec.output).trials() if r.finished is not None]
    return Way("sweep", span, sorted(trials, key=lambda t: t["t"]))


def run_peft(spec: StudySpec, n: int, out: Path, *, graph: bool) -> Way:
    """Optuna + PEFT in this process (in-memory storage, as ``optuna.create_study()``), one trial at a time."""
    name = "peft-graph" if graph else "peft"
    trials: list[dict[str, Any]] = []
    t0 = time.time()
    base = optuna_peft.load(spec)
    study = optuna_peft.create_study(spec, optuna.storages.InMemoryStorage())  # seeded as worker 0's sampler
    optuna_peft.run_trials(base, study, n, graph=graph,
                           adapters=out / name / "adapters", log=lambda line: trials.append(dict(t=time.time() - t0,
                                                                                                 **line)))
    span = time.time() - t0
    del base, study
    _free()
    return Way(name, span, trials)


def run_procs(study_file: str, overrides: Sequence[str], spec: StudySpec, n: int, procs: int, out: Path, *,
              graph: bool = False) -> Way:
    """``procs`` processes of ``optuna_peft`` sharing one journal-file study, the ``n`` trials dealt between them;
    ``graph``: each trial's step graphed (``peft-graph-procs``)."""
    name = "peft-graph-procs" if graph else "peft-procs"
    work = out / f"{name}-{procs}"
    work.mkdir(parents=True)
    storage = str(work / "optuna.log")
    optuna_peft.create_study(spec, optuna_peft.journal(storage))
    threads = max(1, (os.cpu_count() or 1) // procs) if resolve_device(spec.model.device) == "cpu" else 0
    t0 = time.time()
    children = []
    for p in range(procs):
        job = work / f"worker-{p}.json"
        job.write_text(json.dumps(dict(study=study_file, overrides=list(overrides), storage=storage, worker=p,
                                       trials=n // procs + (p < n % procs), graph=graph, t0=t0, threads=threads,
                                       adapters=str(work / "adapters"), log=str(work / f"worker-{p}.jsonl"))))
        children.append(subprocess.Popen([sys.executable, "-m", "lora_sweep.benchmarks.optuna_peft", "--child",
                                          str(job)]))
    codes = [child.wait() for child in children]
    span = time.time() - t0
    if any(codes):
        raise RuntimeError(f"{name}: {procs} processes exited with {codes} (their errors are above)")
    logs = [work / f"worker-{p}.jsonl" for p in range(procs)]
    trials = [json.loads(line) for path in logs if path.exists() for line in path.read_text().splitlines()]
    return Way(name, span, sorted(trials, key=lambda t: t["t"]), dict(procs=procs))


def gap_target(ways: Sequence[Way], gap: float = GAP) -> float | None:
    """The held-out loss that closes ``gap`` of the way from the community default's loss to the best any way found:
    ``best + (1 - gap) * (default - best)``.

    The default is trial 0 of every way (enqueued first, never pruned); its loss is the mean over the ways where it
    completed (they train the same trial, equal up to the device's rounding). None when no way completed it.
    """
    bests = [w.best for w in ways if w.best is not None]
    defaults = [t["eval_loss"] for w in ways for t in w.trials
                if t["trial"] == 0 and t["state"] == "COMPLETE" and t["eval_loss"] is not None]
    if not bests or not defaults:
        return None
    best, default = min(bests), sum(defaults) / len(defaults)
    return best + (1 - gap) * max(default - best, 0.0)


def time_to_target(way: Way, target: float) -> float | None:
    """Seconds until the way's first complete trial with held-out loss <= ``target``; None if it never got there."""
    hits = [t["t"] for t in way.trials if t["state"] == "COMPLETE" and t["eval_loss"] is not None
            and t["eval_loss"] <= target]
    return min(hits) if hits else None


def rows(ways: Sequence[Way], trials: int, target: float | None = None) -> list[dict[str, Any]]:
    """The table's rows: one per way, checked by ``timing.check_row``.

    Each row's ``time_to_target_s`` is to ``gap_target``; with ``target`` (a user's held-out loss), also
    ``time_to_user_target_s``, to that loss. The speed-ups over each way: ``makespan_speedup``,
    ``time_to_target_speedup`` and (with ``target``) ``time_to_user_target_speedup``.
    """
    gap = gap_target(ways)
    out = []
    for w in ways:
        finished = len(w.trials)
        row = dict(way=w.name, **w.extra, makespan_s=round(w.makespan_s, 3),
                   device_s_per_trial=round(w.makespan_s / max(finished, 1), 3), trials=finished,
                   complete=w.count("COMPLETE"), pruned=w.count("PRUNED"), failed=w.count("FAIL"),
                   best_eval_loss=w.best, target_eval_loss=gap, time_to_target_s=_reach(w, gap))
        if target is not None:
            row.update(user_target_eval_loss=target, time_to_user_target_s=_reach(w, target))
        if finished != trials:  # a sweep's pack out of memory retries its trials: said, not hidden
            print(f"vs_peft: warning: {w.name}: {finished} trials finished, {trials} asked", file=sys.stderr)
        out.append(check_row(row, f"vs_peft {w.name}"))
    for row in out:  # speed-ups of this way over each: the other's seconds / this one's
        row["makespan_speedup"] = {o["way"]: round(o["makespan_s"] / row["makespan_s"], 2) for o in out}
        for key in ("time_to_target", "time_to_user_target") if target is not None else ("time_to_target",):
            row[f"{key}_speedup"] = {o["way"]: (round(o[f"{key}_s"] / row[f"{key}_s"], 2)
                                                if row[f"{key}_s"] and o[f"{key}_s"] else None) for o in out}
    return out


def _reach(way: Way, target: float | None) -> float | None:
    """``time_to_target`` rounded as the makespan (never past it); None without a target."""
    seconds = None if target is None else time_to_target(way, target)
    return None if seconds is None else round(seconds, 3)


def table(rows: Sequence[dict[str, Any]]) -> str:
    """The rows as a text table; speed-up columns read "makespan x / time-to-target x" of the row's way over each
    (with a user's target, "/ its time x" too)."""
    user = "time_to_user_target_s" in rows[0] if rows else False
    keys = ("makespan", "time_to_target") + (("time_to_user_target",) if user else ())
    head = (f"{'way':<24}{'makespan s':>12}{'device-s/trial':>16}{'complete/pruned':>17}{'best loss':>11}"
            f"{'to target s':>13}" + (f"{'to --target s':>15}" if user else "")
            + "".join(f"  {'over ' + r['way']:>{7 * len(keys) + 2}}" for r in rows))
    lines = [head]
    for r in rows:
        name = r["way"] + (f" (N={r['procs']})" if "procs" in r else "")
        best = "-" if r["best_eval_loss"] is None else f"{r['best_eval_loss']:.4g}"
        over = [" / ".join(_ratio(r[f"{k}_speedup"][o["way"]]) for k in keys) for o in rows]
        lines.append(f"{name:<24}{r['makespan_s']:>12.1f}{r['device_s_per_trial']:>16.2f}"
                     f"{str(r['complete']) + '/' + str(r['pruned']):>17}{best:>11}{_seconds(r['time_to_target_s']):>13}"
                     + (f"{_seconds(r['time_to_user_target_s']):>15}" if user else "")
                     + "".join(f"  {cell:>{7 * len(keys) + 2}}" for cell in over))
    target = next((r["target_eval_loss"] for r in rows if r["target_eval_loss"] is not None), None)
    lines.append("over W: the row's speed-up over way W, makespan / time to target" + (" / time to --target"
                 if user else "") + " (W's seconds over the row's)")
    lines.append(f"target: held-out loss <= {target:.6g}, {GAP:.0%} of the way from the default trial's loss to the "
                 f"best any way found" if target is not None else "target: no way completed the default trial")
    if user:
        lines.append(f"--target: held-out loss <= {rows[0]['user_target_eval_loss']:.6g}")
    return "\n".join(lines)


def _seconds(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}"


def _ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}x"


def vs_peft(study_file: str, overrides: Sequence[str] = (), *, shape: str | None = None, ways: Sequence[str] = WAYS,
            procs: Sequence[int] = (1, 2, 4, 8), trials: int | None = None, out: str | Path = "runs/vs-peft",
            target: float | None = None) -> list[dict[str, Any]]:
    """Run the study every way of ``ways`` not yet recorded in ``out``; write ``vs_peft.json`` and ``trials.csv``
    of every way recorded there and return their rows (``rows``; ``target``: a user's held-out loss, timed beside
    the default target).

    Each way is recorded in ``out/ways/<way>.json`` as it ends (``<way>-<N>`` for each process count), so a
    command cut short by a time limit keeps the ways it finished, and ways run by separate commands with the same
    settings share one table; a way's unfinished work is discarded and run again. ``target`` is not a setting: it
    only reads the recorded trials, so a later command may ask another.

    Raises:
        UserError: ``out`` holds other files or a comparison of other settings, or ``prepare`` refuses the study.
    """
    out = Path(out).absolute()
    settings = dict(study=str(Path(study_file).resolve()), overrides=list(overrides), shape=shape, trials=trials)
    _claim(out, settings)
    overrides = list(overrides)
    spec = api.load_study(study_file, overrides)
    if shape is not None:
        overrides.append(f"model.path={shape_base(shape, spec, out)}")
        spec = api.load_study(study_file, overrides)
    spec = prepare(spec, trials, out)
    n = spec.budget.trials
    assert n is not None
    _warm(spec)
    runs: list[tuple[str, str, Callable[[], Way]]] = [
        ("sweep", "sweep", lambda: run_sweep(spec)), ("peft", "peft", lambda: run_peft(spec, n, out, graph=False)),
        ("peft-graph", "peft-graph", lambda: run_peft(spec, n, out, graph=True))]
    runs += [(f"{way}-{p}", way, lambda p=p, g=way != "peft-procs": run_procs(study_file, overrides, spec, n, p, out,
                                                                               graph=g))
             for way in PROCS_WAYS for p in procs]
    for key, name, go in runs:
        if name not in ways:
            continue
        if (out / "ways" / f"{key}.json").exists():
            print(f"vs_peft: {key}: recorded in {out / 'ways'}, not run again", file=sys.stderr, flush=True)
            continue
        shutil.rmtree(out / key, ignore_errors=True)  # an unfinished run's study and adapters
        way = go()
        (out / "ways" / f"{key}.json").write_text(json.dumps(dataclasses.asdict(way), default=str))
        print(f"vs_peft: {key}: {way.makespan_s:.1f} s, best held-out loss {way.best}", file=sys.stderr, flush=True)
    return _write(out, spec, settings, n, target)


def _claim(out: Path, settings: dict[str, Any]) -> None:
    """Make ``out`` this comparison's folder: new, empty, or one holding a comparison of the same ``settings``."""
    marker = out / "settings.json"
    if marker.exists():
        theirs = json.loads(marker.read_text())
        if theirs != settings:
            raise UserError(f"vs_peft: --out {out} holds a comparison of other settings ({theirs}); give another "
                            f"--out")
        return
    if out.exists() and any(out.iterdir()):
        raise UserError(f"vs_peft: --out {out} is not empty and holds no comparison: every way needs a fresh study")
    (out / "ways").mkdir(parents=True, exist_ok=True)
    marker.write_text(json.dumps(settings))


def _write(out: Path, spec: StudySpec, settings: dict[str, Any], n: int, target: float | None
           ) -> list[dict[str, Any]]:
    """The rows of every way recorded in ``out`` (a processes way: its fastest N), written with their trial logs."""
    recorded = {p.stem: Way(**json.loads(p.read_text())) for p in sorted((out / "ways").glob("*.json"))}
    by_n = {way: sorted((w for w in recorded.values() if w.name == way), key=lambda w: w.extra["procs"])
            for way in PROCS_WAYS}
    done = [min(by_n[w], key=lambda w: w.makespan_s) if w in PROCS_WAYS else recorded[w] for w in WAYS
            if (by_n[w] if w in PROCS_WAYS else w in recorded)]
    result = rows(done, n, target)
    device = resolve_device(spec.model.device)
    record = dict(settings, trials=n, device=device, torch=torch.__version__,
                  device_name=torch.cuda.get_device_name(device) if device.startswith("cuda") else "cpu",
                  rows=result, procs={way: {w.extra["procs"]: w.makespan_s for w in ws} for way, ws in by_n.items()},
                  trial_logs={key: w.trials for key, w in recorded.items()})
    (out / "vs_peft.json").write_text(json.dumps(record, indent=1, default=str))
    with open(out / "trials.csv", "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(["way", "t_s", "trial", "state", "eval_loss"])
        for key, w in recorded.items():
            writer.writerows([key, round(t["t"], 3), t["trial"], t["state"], t["eval_loss"]] for t in w.trials)
    return result


def _warm(spec: StudySpec) -> None:
    """The process's one-time costs, before any way's clock: the imports every way uses, the device's context."""
    import peft  # noqa: F401
    import transformers  # noqa: F401

    device = resolve_device(spec.model.device)
    if device.startswith("cuda"):
        a = torch.ones(64, 64, device=device, dtype=torch.bfloat16)
        (a @ a).sum().item()


def _free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m lora_sweep.benchmarks.vs_peft", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--study", required=True, help="the study file every way runs")
    p.add_argument("overrides", nargs="*", help="dotted key=value overrides of the study, as sweep run takes")
    p.add_argument("--shape", default=None, choices=sorted(SHAPES), help="a random-init model of this shape "
                   "instead of the study's model")
    p.add_argument("--ways", default=",".join(WAYS), help=f"comma-separated subset of {','.join(WAYS)}")
    p.add_argument("--procs", default="1,2,4,8", help="process counts of the processes ways")
    p.add_argument("--trials", type=int, default=None, help="trials per way (default: the study's budget.trials)")
    p.add_argument("--out", default="runs/vs-peft", help="an empty or new directory for every way's files")
    p.add_argument("--target", type=float, default=None, metavar="LOSS", help="also time each way to its first "
                   "complete trial with held-out loss <= LOSS (a column beside the default target's)")
    args = p.parse_args(argv)
    unknown = set(args.ways.split(",")) - set(WAYS)
    if unknown:
        p.error(f"--ways: unknown {', '.join(sorted(unknown))}; choose from {', '.join(WAYS)}")
    try:
        args.procs = [int(x) for x in args.procs.split(",")]
    except ValueError:
        p.error(f"--procs: comma-separated process counts (got {args.procs!r})")
    if min(args.procs) < 1 or (args.trials is not None and args.trials < 1):
        p.error("--procs and --trials: counts >= 1")
    if args.target is not None and not math.isfinite(args.target):
        p.error(f"--target: a finite held-out loss (got {args.target})")
    return args


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    args = _args(argv)
    try:
        result = vs_peft(args.study, args.overrides, shape=args.shape, ways=args.ways.split(","), procs=args.procs,
                         trials=args.trials, out=args.out, target=args.target)
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    print(json.dumps(result, default=str), flush=True)
    print(table(result), flush=True)
    return result


if __name__ == "__main__":
    main()
