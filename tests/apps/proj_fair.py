"""Test app for fair shares by key (``-A tests.apps.proj_fair``: ``tests.apps.proj``'s app plus
three tasks). Runs are recorded in db 2 of the broker's server, in order."""

from __future__ import annotations

import time
from typing import Any

from tests.apps.proj import app, recorder


@app.task(fair_by=lambda tenant, n: tenant)
def work(tenant: str, n: int) -> None:
    """Append "<tenant><n>" to "fair:order" when it starts."""
    recorder().rpush("fair:order", f"{tenant}{n}")


@app.task(fair_by=lambda tenant, n: tenant, fair_max_concurrency=2)
def limited(tenant: str, n: int) -> None:
    """Count this tenant's jobs running now; record the most seen ("fair:max:<t>")."""
    r = recorder()
    now = r.incr(f"fair:now:{tenant}")
    r.rpush(f"fair:seen:{tenant}", now)
    time.sleep(0.15)
    r.decr(f"fair:now:{tenant}")
    r.rpush("fair:order", f"{tenant}{n}")


@app.task(bind=True, fair_by=lambda tenant, n: tenant, fair_max_concurrency=5)
def held(self: Any, tenant: str, n: int) -> None:
    """Record the start, then block until the test sets "fair:open" (at most 60 s). Its
    per-key limit (never reached) makes fetch count each key's jobs in flight."""
    r = recorder()
    r.rpush("fair:started", f"{tenant}{n}")
    deadline = time.monotonic() + 60
    while not r.exists("fair:open") and time.monotonic() < deadline:
        time.sleep(0.02)


@app.task(bind=True, max_retries=1)
def again(self: Any, n: int) -> None:
    """No fair_by: its key comes per call. The first attempt retries in 1 s."""
    if not self.request.retries:
        raise self.retry(countdown=1.0)
    recorder().rpush("fair:order", f"again{n}")
