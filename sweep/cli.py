"""The ``sweep`` command line.

Exit codes: 0 done, 2 user error (one line naming the key, file or file:line; no traceback), 1 bug
(with its traceback).
"""

from __future__ import annotations

import sys

import click

from packer.errors import UserError

__all__ = ["main", "cli"]


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def cli() -> None:
    """Hyperparameter sweeps for LoRA adapters, many trials packed into one training run."""


@cli.command()
@click.option("--cpu", "cpu", is_flag=True, help="The CPU benchmark: N adapters packed vs one after another.")
@click.option("--adapters", default=8, show_default=True, help="Adapters to train.")
@click.option("--steps", default=30, show_default=True, help="Optimizer steps per adapter.")
@click.option("--no-peft", is_flag=True, help="Skip the PEFT baseline.")
def bench(cpu: bool, adapters: int, steps: int, no_peft: bool) -> None:
    """Measure packed training against one adapter at a time."""
    if not cpu:
        raise UserError("bench: only --cpu exists so far (the GPU benchmark comes with the Triton kernels)")
    from packer.bench import cpu_bench

    result = cpu_bench(adapters, steps, with_peft=not no_peft, progress=lambda m: click.echo(m, err=True))
    click.echo(result.table())


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point: user errors become one line and exit status 2."""
    try:
        cli.main(args=argv, prog_name="sweep", standalone_mode=False)
    except UserError as err:
        click.echo(f"error: {err}", err=True)
        sys.exit(2)
    except click.exceptions.Abort:
        click.echo("aborted", err=True)
        sys.exit(130)
    except click.ClickException as err:
        err.show()
        sys.exit(2)


if __name__ == "__main__":
    main()
