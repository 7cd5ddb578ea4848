"""Test app whose extra job queue comes from a task registered after ``install(app)``.

``tests.apps.proj`` calls ``install(app)``; this module then asks the worker to import
``tests.apps.proj_late_tasks`` at start-up (``include``), the usual way tasks living in
other modules reach a worker. Run as ``celery -A tests.apps.proj_late worker``.
"""

from __future__ import annotations

from tests.apps.proj import app

app.conf.include = [*(app.conf.include or ()), "tests.apps.proj_late_tasks"]

__all__ = ["app"]
