"""Test app for periodic jobs: ``tests.apps.proj``'s app with a ``beat_schedule``.

Workers run it as ``-A tests.apps.proj_periodic``. ``TEST_PERIODIC_EVERY`` (seconds, default
1) is the interval of the entry ``every``; the entry ``hourly`` (a crontab) does not
fall due during a test, so it runs only when asked (run-now). Runs leave one JSON
record each in db 2: job id, the due time it was enqueued for, and its enqueue time.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

from celery.schedules import crontab

from tests.apps.proj import app, recorder


@app.task(bind=True)
def beat_tick(self: Any, key: str) -> None:
    """Record one run: "{id, due (ms), enqueued_at (s), started (s)}"."""
    req = self.request
    recorder().rpush(f"runs:{key}", json.dumps({
        "id": req.id, "due": req.get("celery_ext_due"),
        "enqueued_at": (req.properties or {}).get("enqueued_at"), "started": time.time()}))


app.conf.beat_schedule = {
    "every": {"task": beat_tick.name, "schedule": float(os.environ.get("TEST_PERIODIC_EVERY", 1)),
              "args": ("every",)},
    "hourly": {"task": beat_tick.name, "schedule": crontab(minute=0), "args": ("hourly",)},
}
