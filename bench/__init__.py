"""Benchmark harness: kernel and whole-model sweeps (pytest-benchmark) and self-contained HTML roofline reports.

Run ``pytest bench/ --benchmark-only``; the report lands in ``reports/latest.html``. ``python -m bench.cli report
<benchmark.json> -o out.html`` re-renders a report from a saved ``--benchmark-json`` file.
"""
