"""Test app for routing (issue 33): tasks whose job queue comes from ``task_routes`` (a dict
or a router function), from ``queue=`` on the task, or from the default queue.

Workers run it as ``-A tests.apps.proj_routes``; ``PROJ_ROUTES`` picks the form of the
routes (``dict``, ``function`` or ``none``) and ``CELERY_EXT_NO_INSTALL=1`` runs it drop-in
(with ``task_acks_late``, which ``max_concurrency`` needs). A test builds its producer with
:func:`make_app` and the same arguments, so both route alike. Tasks record in db 2 how many
of them ran at once (``max:<key>``) and each run (``runs:<key>``).
"""

from __future__ import annotations

import os
from typing import Any

from celery import Celery

import celery_ext
from tests.apps.proj import BROKER_URL, backend_url, recorder

PREFIX = "tests.apps.proj_routes."
#: max_concurrency=1, routed to ``reports``.
REPORT = PREFIX + "report"
#: rate_limit, routed to ``rated_reports``.
RATED = PREFIX + "rated_report"
#: weight=3, routed to ``heavy_reports``.
HEAVY = PREFIX + "heavy_report"
#: max_concurrency=1 and 3, both routed to ``shared``.
SHARED_A, SHARED_B = PREFIX + "shared_a", PREFIX + "shared_b"
#: max_concurrency=1 with ``queue="explicit_reports"`` on the task (no route).
EXPLICIT = PREFIX + "explicit_report"

ROUTED = {REPORT: "reports", RATED: "rated_reports", HEAVY: "heavy_reports",
          SHARED_A: "shared", SHARED_B: "shared"}
RATE = "2/s"

# Updates "active:<key>" and its high-water mark "max:<key>" in one step.
_ENTER = """
local n = redis.call('INCR', KEYS[1])
if n > tonumber(redis.call('GET', KEYS[2]) or 0) then redis.call('SET', KEYS[2], n) end
return n
"""


def route_reports(name: str, args: Any, kwargs: Any, options: Any, task: Any = None,
                  **kw: Any) -> dict[str, str] | None:
    """A router function: the routed tasks to their queues, the others to the next router."""
    queue = ROUTED.get(name)
    return {"queue": queue} if queue else None


ROUTES: dict[str, Any] = {
    "dict": {name: {"queue": queue} for name, queue in ROUTED.items()},
    "function": [route_reports],
    "none": None,
}


def _run(key: str, seconds: float) -> None:
    r = recorder()
    r.eval(_ENTER, 2, f"active:{key}", f"max:{key}")
    try:
        if seconds:
            import time

            time.sleep(seconds)
    finally:
        r.decr(f"active:{key}")
    r.rpush(f"runs:{key}", str(os.getpid()))


def make_app(routes: str, install: bool, broker_url: str = BROKER_URL) -> Celery:
    """The app with ``routes`` (a key of ROUTES), with ``install(app)`` or drop-in."""
    app = Celery("proj_routes", broker=broker_url, backend=backend_url(broker_url),
                 set_as_current=False)
    app.conf.update(broker_connection_retry_on_startup=True, worker_hijack_root_logger=False,
                    task_routes=ROUTES[routes])
    if install:
        celery_ext.install(app)
    else:
        app.conf.update(task_acks_late=True, task_reject_on_worker_lost=True)
    app.task(name=REPORT, max_concurrency=1, ignore_result=True, shared=False)(_run)
    app.task(name=RATED, rate_limit=RATE, ignore_result=True, shared=False)(_run)
    app.task(name=HEAVY, weight=3, ignore_result=True, shared=False)(_run)
    app.task(name=SHARED_A, max_concurrency=1, ignore_result=True, shared=False)(_run)
    app.task(name=SHARED_B, max_concurrency=3, ignore_result=True, shared=False)(_run)
    app.task(name=EXPLICIT, queue="explicit_reports", max_concurrency=1, ignore_result=True,
             shared=False)(_run)
    return app


app = make_app(os.environ.get("PROJ_ROUTES", "none"),
               install=os.environ.get("CELERY_EXT_NO_INSTALL") != "1")
