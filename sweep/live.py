"""Live progress of a running pack (rich), and log lines printed above it."""

from __future__ import annotations

from types import TracebackType

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from lora_sweep.sweep.study import Progress as PackProgress

__all__ = ["LiveProgress"]


class LiveProgress:
    """A progress bar over finished trials with the pack's step, slots, tokens/s and best so far."""

    def __init__(self, enabled: bool = True) -> None:
        self.console = Console(stderr=True)
        self.enabled = enabled
        self.bar = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                            TextColumn("{task.fields[info]}"), TimeElapsedColumn(), console=self.console,
                            disable=not enabled)
        self.task = self.bar.add_task("trials", total=None, info="starting")

    def __enter__(self) -> LiveProgress:
        self.bar.__enter__()
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        self.bar.__exit__(et, ev, tb)

    def update(self, p: PackProgress) -> None:
        eta = "" if p.eta_s is None else f"  ETA {_clock(p.eta_s)}"
        info = f"step {p.step}  slots {p.active}/{p.capacity}  {p.tokens_per_s:,.0f} tok/s{eta}  best {p.best}"
        self.bar.update(self.task, completed=p.finished, total=p.budget_trials, info=info)

    def log(self, message: str) -> None:
        self.console.print(message)


def _clock(seconds: float) -> str:
    """h:mm:ss of ``seconds``."""
    s = int(round(seconds))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"
