"""A worker pool's stop and reconcile finish their work on every redis-py the package
accepts, and a stop whose one step raises still runs the others (issue 33, item 2).

redis-py below 8 has no ``read_response(timeout=...)``: the ack connection's replies
still unread at a stop or a reconcile raised ``TypeError`` there, and the stop gave up
before returning the jobs and deregistering. ``./dev test-lowest`` runs this file with
the lowest redis-py the package accepts, ``./dev test`` with the newest.
"""

from __future__ import annotations

import signal
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis

from celery_ext.config import Settings
from celery_ext.store import scripts
from celery_ext.store.keys import Keys
from celery_ext.testing.server import RedisServer
from celery_ext.worker.worker_pool import WorkerPool
from tests.apps import proj
from tests.helpers import wait_for
from tests.workers import WorkerProcess

K = Keys("celery_ext")
FAST = {
    "CELERY_EXT_HEARTBEAT_INTERVAL": "0.25",
    "CELERY_EXT_DEAD_AFTER": "1.5",
    "CELERY_EXT_REAP_INTERVAL": "0.5",
}
#: Short jobs in the stream the worker is stopped in (each sleeps ``JOB_SECONDS``).
STREAM = 400
JOB_SECONDS = 0.005


class Boom(Exception):
    """What the failing step raises: not a Redis error, as redis-py's TypeError was not."""


def _message() -> Any:
    """Something a delivered message can be (Holdings keeps a weak reference to it)."""
    return type("Message", (), {})()


@pytest.fixture
def pool(redis_server: RedisServer, redis_client: redis.Redis) -> Iterator[WorkerPool]:
    """A started pool of this process on the session server, holding jobs "a" to "e"
    of queue "q", delivered and not finished."""
    scripts.Scripts(redis_client).load_all()
    p = WorkerPool(redis_server.client, Settings(), "server")
    p.start()
    messages = []
    for tag in "abcde":
        redis_client.hset(K.inflight(p.pool_id), tag, "q\n{}")
        messages.append(_message())
        p.delivered(tag, messages[-1])
    try:
        yield p
    finally:
        p.stop()
        del messages


def _registered(client: redis.Redis, pool_id: str) -> bool:
    return client.zscore(K.pools, pool_id) is not None


@pytest.mark.parametrize("step", ["periodic", "requeuer", "reaper", "ack replies",
                                  "ack connection", "leave"])
def test_stop_runs_every_step_when_one_raises(pool: WorkerPool, redis_client: redis.Redis,
                                              step: str) -> None:
    """Each step of ``stop`` that raises is logged and the next steps still run: the
    acks made are applied, the jobs left go back to their queue, the pool deregisters."""
    failing: dict[str, tuple[Any, str]] = {
        "periodic": (pool, "periodic"),
        "requeuer": (pool.requeuer, "stop"),
        "reaper": (pool.reaper, "stop"),
        "ack replies": (pool.acks, "flush"),
        "ack connection": (pool.acks, "close"),
        "leave": (pool.record, "leave"),
    }
    owner, name = failing[step]

    def boom(*_: Any, **__: Any) -> None:
        raise Boom(step)

    if step == "periodic":
        pool.periodic = type("Leader", (), {"stop": staticmethod(boom)})()  # type: ignore[assignment]
    else:
        setattr(owner, name, boom)
    pool.ack(["a", "b"])  # written, replies unread
    try:
        pool.stop()
        assert not _registered(redis_client, pool.pool_id)
        assert not redis_client.exists(K.inflight(pool.pool_id))
        # The acked jobs are done; the three others wait at the front of their queue.
        assert sorted(redis_client.lrange(K.queue("q"), 0, -1)) == [b"{}", b"{}", b"{}"]
        assert int(redis_client.hget(K.running, "q") or 0) <= 0
    finally:
        if step in ("requeuer", "reaper"):  # its thread still runs: stop it for real
            delattr(owner, name)
            owner.stop()


def test_reconcile_with_ack_replies_unread_applies_them_and_returns_the_rest(
        pool: WorkerPool, redis_client: redis.Redis) -> None:
    """A reconcile (after a lost fetch connection) reads the ack replies still unread:
    the acked jobs are not returned, a job no longer held is, a held one stays."""
    pool.ack(["a", "b"])
    pool.holdings.released(["c"])  # Celery dropped it with the lost connection
    pool.needs_reconcile()
    assert pool.reconcile() == ["c"]
    assert sorted(redis_client.hkeys(K.inflight(pool.pool_id))) == [b"d", b"e"]
    assert redis_client.llen(K.queue("q")) == 1


@pytest.fixture
def start_threads_worker(broker_url: str, redis_client: redis.Redis,
                         worker_factory: Callable[..., WorkerProcess]
                         ) -> Callable[[], WorkerProcess]:
    proj.configure(broker_url)

    def start() -> WorkerProcess:
        return worker_factory("tests.apps.proj_pools", pool="threads", concurrency=4,
                              env=FAST).start()

    return start


def test_threads_worker_stopped_mid_stream_deregisters_and_returns_every_job(
        start_threads_worker: Callable[[], WorkerProcess], redis_client: redis.Redis,
        rec: redis.Redis) -> None:
    """SIGTERM while a threads pool runs a stream of short jobs (acks under way, their
    replies unread): the pool deregisters, nothing stays in flight, every job not run
    waits in its queue, and none ran twice."""
    from tests.apps import proj_pools

    worker = start_threads_worker()
    with proj.app.producer_or_acquire() as producer:
        for i in range(STREAM):
            proj_pools.slow.apply_async((f"s{i}", JOB_SECONDS), producer=producer)
    queue = proj_pools.slow.name
    wait_for(lambda: rec.llen(f"start:s{STREAM // 4}"), 30, "a quarter of the stream run")
    pool_id = next(iter(redis_client.zrange(K.pools, 0, -1))).decode()
    assert worker.stop(signal.SIGTERM, timeout=20) == 0
    log = worker.log_text()
    assert "failed" not in log and "Traceback" not in log, log[-3000:]
    assert not _registered(redis_client, pool_id)
    assert not redis_client.exists(K.inflight(pool_id))
    started = [i for i in range(STREAM) if rec.llen(f"start:s{i}")]
    assert all(rec.llen(f"start:s{i}") == 1 for i in started)
    waiting = sum(redis_client.llen(k) for k in K.queue_levels(queue, Settings().priority_steps))
    assert waiting == STREAM - len(started)
