"""The Dramatiq side of the benchmark: the same no-op job, Dramatiq's own Redis broker.

``dramatiq bench.dramatiq_app --processes 2 --threads 8`` is the worker the harness
starts; ``python -m bench.client enqueue`` with ``BENCH_MODE=dramatiq`` is the producer
(``noop.send()`` in a loop). Both take the server from ``BENCH_BROKER_URL`` (a plain
``redis://`` URL of the same server and db the Celery sides use; the db is flushed
between runs). Dramatiq's default middleware, no result backend (Dramatiq has none
unless its ``Results`` middleware is added), its default prefetch (2 x threads per
process). A job counts its completion with the same ``INCR`` on db 2 as the Celery
jobs, so every side pays the same for it.
"""

from __future__ import annotations

import os
import time
from typing import Any

import dramatiq
from dramatiq.brokers.redis import RedisBroker
from dramatiq.middleware import Middleware

from bench.app import COUNTER_KEY, READY_KEY, WAIT, counter

BROKER_URL = os.environ.get("BENCH_BROKER_URL", "redis://127.0.0.1:6379/0")
#: Worker layout the harness starts (stated in every output).
PROCESSES = 2
THREADS = 8
QUEUE = "bench"


class _Ready(Middleware):
    """Tell the harness a worker process consumes (it waits for its pid in READY_KEY)."""

    def after_worker_boot(self, broker: Any, worker: Any) -> None:
        counter().sadd(READY_KEY, str(os.getpid()))


broker = RedisBroker(url=BROKER_URL)
broker.add_middleware(_Ready())
dramatiq.set_broker(broker)


@dramatiq.actor(queue_name=QUEUE, max_retries=0)
def noop() -> None:
    if WAIT:  # BENCH_WAIT: the I/O job of ``bench.green`` (cooperative under dramatiq-gevent)
        time.sleep(WAIT)
    counter().incr(COUNTER_KEY)
