"""Benchmarks of sdpa-fusion: run from the repo root as ``python -m benchmarks.<name>``
(``python -m benchmarks`` lists them).

Each benchmark writes ``benchmarks/results/<name>.json`` (every measurement, the command line
and the device and library versions it ran on) and ``<name>.png`` (TFLOP/s against sequence
length). See ``benchmarks/README.md``.
"""
