"""Test app for the scheduled, retry and dead sets, unique jobs and concurrency limits.

Workers run it as ``-A tests.apps.proj_sets`` (``tests.apps.proj``'s app plus these tasks).
Tasks leave traces in db 2 of the broker's server, so tests count runs without
relying on results.
"""

from __future__ import annotations

import os
import time
from typing import Any

from tests.apps.proj import app, recorder

# Updates "active:<key>" and its high-water mark "max:<key>" in one step.
_ENTER = """
local n = redis.call('INCR', KEYS[1])
if n > tonumber(redis.call('GET', KEYS[2]) or 0) then redis.call('SET', KEYS[2], n) end
return n
"""


@app.task(bind=True, ignore_result=True)
def timed(self: Any, key: str) -> None:
    """Record when it ran and the eta it was published with: "<task id> <start> <eta>".
    (No result stored: the lateness test measures promotion, not the result backend.)"""
    recorder().rpush(f"runs:{key}", f"{self.request.id} {time.time()} {self.request.eta}")


@app.task(bind=True, autoretry_for=(ValueError,), max_retries=1, default_retry_delay=1.0)
def flaky(self: Any, key: str) -> str:
    """Fails (and retries, then dies) until the test sets "heal:<key>"."""
    r = recorder()
    r.rpush(f"runs:{key}", f"{os.getpid()}:{time.time()}:{self.request.retries}")
    if not r.exists(f"heal:{key}"):
        raise ValueError(f"{key} is broken")
    return "healed"


@app.task(bind=True, max_retries=5, backoff={"base": 0.2, "max": 0.4, "jitter": 0.0})
def backing_off(self: Any, key: str) -> None:
    """Retries by hand (no countdown given): the backoff option picks the delays."""
    recorder().rpush(f"runs:{key}", f"{time.time()}")
    try:
        raise KeyError(key)
    except KeyError as exc:
        raise self.retry(exc=exc, max_retries=2) from exc


@app.task(unique=True)
def unique_job(key: str, sleep: float = 0.0) -> None:
    """Identical calls while one is pending enqueue nothing."""
    if sleep:
        time.sleep(sleep)
    recorder().rpush(f"runs:{key}", f"{os.getpid()}:{time.time()}")


@app.task(unique=True, unique_key=lambda key, n: key, unique_ttl=60)
def unique_by_key(key: str, n: int) -> None:
    """Unique by ``key`` only, whatever ``n``."""
    recorder().rpush(f"runs:{key}", str(n))


@app.task(max_concurrency=2)
def limited(key: str, seconds: float) -> None:
    """At most two run at once across all pools: tracks the high-water mark."""
    r = recorder()
    r.eval(_ENTER, 2, f"active:{key}", f"max:{key}")
    try:
        time.sleep(seconds)
    finally:
        r.decr(f"active:{key}")
    r.rpush(f"runs:{key}", str(os.getpid()))



@app.task(ignore_result=True)
def fails_late(key: str, seconds: float) -> None:
    """Records its start, then fails after ``seconds`` (a test shuts its worker down in
    between, so that the failure comes during the shutdown)."""
    recorder().rpush(f"start:{key}", f"{os.getpid()}:{time.time()}")
    time.sleep(seconds)
    recorder().rpush(f"runs:{key}", f"{os.getpid()}:{time.time()}")
    raise ValueError(f"{key} fails")

if os.environ.get("TEST_VISIBILITY_TIMEOUT"):
    # Stock Celery would redeliver a countdown job longer than this; celery_ext ignores it.
    app.conf.broker_transport_options = {
        **(app.conf.broker_transport_options or {}),
        "visibility_timeout": float(os.environ["TEST_VISIBILITY_TIMEOUT"]),
    }
