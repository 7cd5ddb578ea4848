"""Test app of resumable jobs on a Redis Cluster (``-A tests.apps.proj_resume_cluster``):
the job of ``tests/apps/resumable.py`` on the app of ``tests/apps/proj_cluster.py``,
acked when it ends in both modes (a drop-in user sets that: a job acked when it starts is
not run again after a crash, resumable or not)."""

from __future__ import annotations

from typing import Any

from tests.apps.proj_cluster import app
from tests.apps.resumable import run_steps


@app.task(bind=True, name="tests.apps.proj_resume_cluster.resumable", acks_late=True,
          reject_on_worker_lost=True)
def resumable(self: Any, path: str, steps: int, pause: float) -> int:
    return run_steps(self, path, steps, pause)


__all__ = ["app", "resumable"]
