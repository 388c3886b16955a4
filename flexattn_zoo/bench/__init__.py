"""Benchmark harness: every route for a case, side by side, in one process.

``python -m flexattn_zoo.bench CONFIG.yaml`` (or ``flexattn-zoo bench``) runs it; see
:mod:`flexattn_zoo.bench.runner` for the options and :mod:`flexattn_zoo.bench.config` for the YAML schema.
"""
