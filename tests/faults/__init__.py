"""Chaos harness: enqueue jobs, inject faults, count what was lost and what ran twice.

``python -m tests.faults`` (or ``./dev faults``) runs every scenario against stock
Kombu ``redis://`` (with its best settings) and against ``celery-ext://`` and prints
both side by side; ``tests/integration/test_faults.py`` runs a short version of each in CI.
See ``docs/reliability.md``.
"""
