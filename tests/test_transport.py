"""The celery-ext:// transport end to end (issue 2): real server, real ``celery worker``.

Workers run ``tests.proj`` (``install(app)`` active) as subprocesses; this process
enqueues through the same app (re-pointed at the session server with
``proj.configure``) and looks at Redis directly through the key names of
:class:`celery_ext.keys.Keys`.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery

from celery_ext.keys import Keys
from celery_ext.server import RedisServer
from tests import proj
from tests.workers import REPO_ROOT, WorkerProcess

K = Keys("celery_ext")
Factory = Callable[..., WorkerProcess]


# -- helpers -----------------------------------------------------------------------------


def wait_until(predicate: Callable[[], Any], timeout: float, what: str,
               interval: float = 0.02) -> Any:
    """Poll ``predicate`` until it returns something truthy; fail with ``what``."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


def node_name(worker: WorkerProcess) -> str:
    return worker.hostname.replace("%h", socket.gethostname())


def queued_ids(client: redis.Redis, queue: str) -> list[str]:
    """Task ids in a job queue, next-to-be-fetched first (fetch pops the right end)."""
    raw = client.lrange(K.queue(queue), 0, -1)
    return [json.loads(m)["headers"]["id"] for m in reversed(raw)]


def inflight(client: redis.Redis, pool_id: str) -> dict[str, tuple[str, dict[str, Any]]]:
    """A pool's in-flight record: delivery tag -> (queue, message)."""
    out = {}
    for tag, rec in client.hgetall(K.inflight(pool_id)).items():
        queue, payload = rec.decode().split("\n", 1)
        out[tag.decode()] = (queue, json.loads(payload))
    return out


def running_count(client: redis.Redis, queue: str) -> int:
    return int(client.hget(K.running, queue) or 0)


def only_pool(client: redis.Redis, timeout: float = 10) -> str:
    """The id of the one registered worker pool."""
    pools = wait_until(lambda: client.zrange(K.pools, 0, -1), timeout, "a registered pool")
    assert len(pools) == 1, pools
    return str(pools[0].decode())


def runs(rec: redis.Redis, key: str) -> list[str]:
    return [r.decode() for r in rec.lrange(f"runs:{key}", 0, -1)]


@pytest.fixture
def app(broker_url: str, redis_client: redis.Redis) -> Celery:
    """``tests.proj``'s app on the session server (empty: ``redis_client`` flushed it)."""
    proj.configure(broker_url)
    return proj.app


@pytest.fixture
def rec(redis_server: RedisServer) -> redis.Redis:
    """db 2, where the test tasks record their runs."""
    return redis_server.client(db=2)


# -- pools, results, remote control ------------------------------------------------------------


@pytest.mark.parametrize(
    ("pool", "concurrency"), [("prefork", 2), ("threads", 4), ("solo", 1)],
    ids=["prefork-2", "threads-4", "solo"],
)
def test_pool_runs_jobs_returns_results_and_answers_ping(
    app: Celery, redis_client: redis.Redis, worker_factory: Factory, pool: str,
    concurrency: int,
) -> None:
    worker = worker_factory("tests.proj", pool=pool, concurrency=concurrency).start()
    results = [proj.add.delay(i, 100) for i in range(20)]
    assert [r.get(timeout=20) for r in results] == [i + 100 for i in range(20)]
    assert proj.noop.delay().get(timeout=10) is None

    replies = app.control.inspect(timeout=3).ping() or {}
    assert replies.get(node_name(worker)) == {"ok": "pong"}, replies

    # The jobs went through our job queue and the pool's in-flight record, now empty.
    assert redis_client.sismember(K.queues, "tests.proj.add")
    pool_id = only_pool(redis_client)
    wait_until(lambda: redis_client.hlen(K.inflight(pool_id)) == 0, 5, "in-flight record empty")
    assert running_count(redis_client, "tests.proj.add") == 0
    assert redis_client.llen(K.queue("tests.proj.add")) == 0
    assert not redis_client.exists("celery")  # nothing went to the stock default queue


# -- one job queue per job name ----------------------------------------------------------------


def test_each_job_name_gets_its_own_job_queue(app: Celery, redis_client: redis.Redis) -> None:
    """No worker: enqueued jobs sit in the job queue named after their task."""
    add = proj.add.delay(1, 2)
    proj.add.delay(3, 4)
    noop = proj.noop.delay()
    explicit = proj.explicit.delay(5)  # queue="explicit_q" on the task wins
    on_call = proj.add.apply_async((6, 7), queue="chosen_on_call")  # so does one per call

    assert queued_ids(redis_client, "tests.proj.add")[0] == add.id
    assert redis_client.llen(K.queue("tests.proj.add")) == 2
    assert queued_ids(redis_client, "tests.proj.noop") == [noop.id]
    assert queued_ids(redis_client, "explicit_q") == [explicit.id]
    assert queued_ids(redis_client, "chosen_on_call") == [on_call.id]
    assert not redis_client.exists(K.queue("celery"), K.queue("tests.proj.explicit"), "celery")
    names = {n.decode() for n in redis_client.smembers(K.ready)}
    assert names == {"tests.proj.add", "tests.proj.noop", "explicit_q", "chosen_on_call"}
    message = json.loads(redis_client.lindex(K.queue("tests.proj.noop"), 0))
    assert message["headers"]["task"] == "tests.proj.noop"


def test_worker_consumes_explicit_and_later_registered_job_queues(
    app: Celery, redis_client: redis.Redis, worker_factory: Factory,
) -> None:
    """A worker without -Q consumes every task's queue: explicit ones, and the queue of
    a task in a module imported by the worker after install(app) ran (include=)."""
    late = app.send_task("tests.proj_late_tasks.late_add", (20, 22))
    explicit = proj.explicit.delay(4)
    add = proj.add.delay(1, 1)
    assert queued_ids(redis_client, "tests.proj_late_tasks.late_add") == [late.id]

    worker_factory("tests.proj_late", pool="solo", concurrency=1).start()
    assert late.get(timeout=15) == 42
    assert explicit.get(timeout=15) == 40
    assert add.get(timeout=15) == 2
    replies = app.control.inspect(timeout=3).active_queues() or {}
    (queues,) = replies.values()
    consumed = {q["name"] for q in queues}
    assert {"tests.proj_late_tasks.late_add", "explicit_q", "tests.proj.add",
            "tests.proj.heavy_weight"} <= consumed
    assert "tests.proj.explicit" not in consumed  # the explicit queue replaces the name
