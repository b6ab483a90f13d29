"""The project's user-facing exceptions.

Anything a user can fix (a study file, a data file, a model path, a flag) raises ``UserError`` or a
subclass; the CLI prints its message on one line and exits with status 2. Every other exception is
a bug and keeps its traceback.
"""

__all__ = ["UserError", "ConfigError", "DataError", "Terminated", "STOP_SAID", "first_line"]


class UserError(Exception):
    """Bad user input. The message names the key, file or file:line that is wrong."""


class ConfigError(UserError, ValueError):
    """A configuration value is invalid (names the key)."""


class DataError(UserError, ValueError):
    """A dataset file or row is invalid (names file:line and field)."""


class Terminated(KeyboardInterrupt):  # noqa: N818 (a signal, like KeyboardInterrupt, not an error)
    """SIGTERM arrived (``sweep run`` turns it into this): the run stops as on Ctrl-C, saying so, and exits 143.
    A KeyboardInterrupt, so every path that cleans up after Ctrl-C (a worker's, the live display's) does so here."""


STOP_SAID = "lora-sweep: the run has said how it stopped"
"""The note (``BaseException.add_note``) a run adds to the Ctrl-C or SIGTERM that stopped it once it has logged its
one end line; the CLI then adds no second line."""


def first_line(err: BaseException, default: str | None = None) -> str:
    """The first non-empty line of ``err``'s message, for a one-line report of it; ``default`` (else the exception's
    type name) when the message is empty. Tracebacks of library errors run to pages: a user sees this line."""
    text = str(err).strip()
    return text.splitlines()[0] if text else (type(err).__name__ if default is None else default)
