"""Benchmarks: commands that measure the library (``python -m lora_sweep.benchmarks.<name>``, ``sweep bench``), not
timed tests.

They may import every library package; no library package imports them except ``sweep.cli``'s ``bench`` command,
lazily (the import contracts in pyproject.toml). ``shapes`` and ``timing`` are the leaves the others share.
"""
