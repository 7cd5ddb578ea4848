"""The result backend: Celery's result API on Redis/Valkey, one node, Sentinel or cluster.

``result_backend = "celery-ext://host:6379/1"`` (``celery-exts://`` for TLS,
``celery-ext+sentinel://`` through Sentinel, the ``cluster`` option of
``result_backend_transport_options`` for a cluster) once ``celery_ext`` is imported.
See docs/results.md.
"""

from __future__ import annotations

from celery_ext.results.backend import ResultBackend, TLSResultBackend

__all__ = ["ResultBackend", "TLSResultBackend"]
