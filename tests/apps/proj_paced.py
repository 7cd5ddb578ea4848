"""Test app for per-key rate limits and throttling from a job (``-A tests.apps.proj_paced``:
``tests.apps.proj``'s app plus the tasks below). Each records its runs in db 2 of the
broker's server, stamped with that server's clock (Redis ``TIME``, µs): the clock the
limits are kept on.

Every task has a job queue of its own (``queue=``), so a drop-in producer reaches it too
and a drop-in worker consumes it with ``-Q``.
"""

from __future__ import annotations

from typing import Any

import celery_ext
from tests.apps.proj import app, recorder

#: The per-key rate limit of ``paced``; the tests read it from here.
KEY_RATE = "5/s"
#: How long a job of ``throttled`` or ``throttled_queue`` holds its key or queue (s).
HOLD = 2.0


def stamp() -> int:
    """Now on the broker server's clock, in µs."""
    seconds, micros = recorder().time()
    return int(seconds) * 1_000_000 + int(micros)


@app.task(queue="paced", fair_by=lambda tenant, n: tenant, fair_rate_limit=KEY_RATE,
          ignore_result=True)
def paced(tenant: str, n: int) -> None:
    """Append the start's Redis time to "paced:<tenant>"."""
    recorder().rpush(f"paced:{tenant}", stamp())


@app.task(bind=True, queue="throttled", fair_by=lambda tenant, n: tenant, max_retries=0,
          ignore_result=True)
def throttled(self: Any, tenant: str, n: int) -> None:
    """Append "<tenant><n> <Redis time> <retries> <redelivered>" to "throttle:runs" at
    each start; the first run of job 0 of a tenant whose name starts with "slow" raises
    Throttled(HOLD) (noted in "throttle:raised:<tenant>0")."""
    r = recorder()
    delivery = self.request.delivery_info or {}
    r.rpush("throttle:runs", f"{tenant}{n} {stamp()} {self.request.retries} "
                             f"{int(bool(delivery.get('redelivered')))}")
    if tenant.startswith("slow") and n == 0 and r.incr(f"throttle:raised:{tenant}0") == 1:
        raise celery_ext.Throttled(HOLD)


@app.task(bind=True, queue="throttled_queue", max_retries=0, ignore_result=True)
def throttled_queue(self: Any, n: int) -> None:
    """The same without a fair key: job 0's first run holds the whole queue."""
    r = recorder()
    r.rpush("throttle:runs", f"q{n} {stamp()} {self.request.retries}")
    if n == 0 and r.incr("throttle:raised:q0") == 1:
        raise celery_ext.Throttled(HOLD)


@app.task(queue="free", ignore_result=True)
def free(n: int) -> None:
    """A job of another queue: runs while a throttled queue is held."""
    recorder().rpush("throttle:runs", f"free{n} {stamp()} 0")
