"""The project's user-facing exceptions.

Anything a user can fix (a study file, a data file, a model path, a flag) raises ``UserError`` or a
subclass; the CLI prints its message on one line and exits with status 2. Every other exception is
a bug and keeps its traceback.
"""

__all__ = ["UserError", "ConfigError", "DataError", "Terminated"]


class UserError(Exception):
    """Bad user input. The message names the key, file or file:line that is wrong."""


class ConfigError(UserError, ValueError):
    """A configuration value is invalid (names the key)."""


class DataError(UserError, ValueError):
    """A dataset file or row is invalid (names file:line and field)."""


class Terminated(KeyboardInterrupt):  # noqa: N818 (a signal, like KeyboardInterrupt, not an error)
    """SIGTERM arrived (``sweep run`` turns it into this): the run stops as on Ctrl-C, saying so, and exits 143.
    A KeyboardInterrupt, so every path that cleans up after Ctrl-C (a worker's, the live display's) does so here."""
