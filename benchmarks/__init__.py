"""Benchmarks of lightning_acgc (scripts, not tests): each prints one JSON line.

Run from the repository root with ``python -m benchmarks.<name>``; ``python -m
benchmarks.run_all [--quick]`` runs them all and writes ``benchmarks/results/``, and
``python -m benchmarks.report`` turns the results into plots in ``docs/`` and the table
in ``README.md``.
"""
