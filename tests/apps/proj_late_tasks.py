"""A task module imported by the worker at start-up, after ``install(app)`` ran."""

from __future__ import annotations

from tests.apps.proj_late import app


@app.task
def late_add(x: int, y: int) -> int:
    return x + y
