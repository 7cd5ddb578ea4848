"""Test app of resumable jobs on one node (``-A tests.apps.proj_resume``): the job of
``tests/apps/resumable.py`` on the app of ``tests/apps/proj.py`` (install or drop-in)."""

from __future__ import annotations

from typing import Any

from tests.apps.proj import app
from tests.apps.resumable import run_steps


@app.task(bind=True)
def resumable(self: Any, path: str, steps: int, pause: float) -> int:
    return run_steps(self, path, steps, pause)


__all__ = ["app", "resumable"]
