"""Test app for per-message priority (``-A tests.apps.proj_priority``: ``tests.apps.proj``'s app
plus one task). Runs are recorded in db 2 of the broker's server, in order."""

from __future__ import annotations

import time
from typing import Any

from tests.apps.proj import app, recorder


@app.task(bind=True, max_retries=1)
def mark(self: Any, key: str, value: str, retry_in: float = 0.0, hold: bool = False) -> None:
    """Append ``value`` to "order:<key>" (the order jobs ran in). ``retry_in``: the
    first attempt retries after that many seconds instead. ``hold``: keep the worker
    busy until the test sets "open:<key>" (at most 60 s)."""
    if retry_in and not self.request.retries:
        raise self.retry(countdown=retry_in)
    r = recorder()
    r.rpush(f"order:{key}", value)
    deadline = time.monotonic() + 60
    while hold and not r.exists(f"open:{key}") and time.monotonic() < deadline:
        time.sleep(0.02)
