"""The sweep layer: study files, the Optuna ledger, packs, pruning, the study directory and the CLI."""

import time

IMPORTED_AT = time.time()
"""Wall clock when the package was first imported, the start ``sweep.timing`` counts a process's seconds before a
run from (a ``sweep`` command imports it first, after the interpreter's own start of a few tens of ms)."""
