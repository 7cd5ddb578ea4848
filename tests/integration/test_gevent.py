"""The gevent executor (``-P gevent``): jobs are greenlets of the worker's main process,
sharing its Redis clients with the consumer, and Celery's signal handlers run in
gevent's event loop.

Real server, real ``celery worker -P gevent`` subprocesses (tests/apps/proj_pools.py).
"""

from __future__ import annotations

from typing import Any

import pytest
import redis

from celery_ext.config import Settings
from celery_ext.store.keys import Keys
from tests.apps import proj
from tests.helpers import wait_for
from tests.workers import WorkerProcess

pytest.importorskip("gevent")

FAST = {
    "CELERY_EXT_HEARTBEAT_INTERVAL": "0.25",
    "CELERY_EXT_DEAD_AFTER": "1.5",
    "CELERY_EXT_REAP_INTERVAL": "0.5",
}
KEYS = Keys(Settings.load({}, environ=FAST).namespace)
APP = "tests.apps.proj_pools"


@pytest.fixture
def app(broker_url: str, redis_client: redis.Redis) -> Any:
    proj.configure(broker_url)
    from tests.apps import proj_pools

    return proj_pools


def start_worker(factory: Any, **kw: Any) -> WorkerProcess:
    env = {**FAST, **kw.pop("env", {})}
    return factory(APP, pool="gevent", env=env, **kw).start()


def test_jobs_failing_together_all_reach_the_dead_set(app: Any, worker_factory: Any,
                                                      redis_client: redis.Redis) -> None:
    """200 greenlets fail in the same instant, each moving its job to the dead set from
    the main process: our clients must serve that many greenlets at once (Kombu sizes a
    channel's connections for 10), or a failed job is acked without its dead record."""
    w = start_worker(worker_factory, concurrency=200)
    n = 600
    for i in range(n):
        app.fail_after.delay(f"f{i}", 0.05)
    def settled() -> bool:
        return redis_client.zcard(KEYS.dead) >= n or "could not move" in w.log_tail(2000)

    wait_for(settled, 30, f"the {n} failed jobs in the dead set")
    assert "could not move" not in w.log_tail(2000)
    assert redis_client.zcard(KEYS.dead) == n
