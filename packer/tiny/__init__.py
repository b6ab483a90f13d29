"""Tiny random-init models of every supported family (``models``, ``families``) and their arithmetic task (``data``):
what tests, benchmarks and the offline demo build in a second."""
