"""Exactly-once enqueue across an outage (DESIGN.md promise 7: a fault inside a round trip).

A producer reaches Redis through a TCP proxy that forwards one enqueue to Redis, which
runs it, and then closes the connection instead of passing the reply on; with
``install(app)`` and drop-in (only the URL changed: Kombu's own producer). Celery's
publish retry policy (``kombu.Connection.ensure``) reconnects and publishes again: the
job must be stored once and run once.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis
from celery import Celery
from kombu import Connection, Exchange, Queue

from celery_ext.config import DEFAULT_PUBLISH_IDEMPOTENCY_TTL
from celery_ext.producer.publish import PUBLISH_ID
from celery_ext.store import scripts
from celery_ext.store.keys import Keys
from celery_ext.testing.server import RedisServer
from tests.apps import proj, proj_sets
from tests.faults.proxy import Proxy
from tests.helpers import wait_for
from tests.workers import WorkerProcess

K = Keys("celery_ext")
RETRY = {"retry": True,
         "retry_policy": {"max_retries": 3, "interval_start": 0.1, "interval_step": 0.1}}


@pytest.fixture
def proxy(redis_server: RedisServer, redis_client: redis.Redis) -> Iterator[Proxy]:
    """A proxy in front of the (flushed) session server."""
    p = Proxy(("127.0.0.1", redis_server.port)).start()
    try:
        yield p
    finally:
        p.stop()


def stored_payloads(client: redis.Redis, queue: str) -> list[dict[str, Any]]:
    """Jobs of ``queue`` in its job queue and in the scheduled set."""
    jobs = [json.loads(raw) for raw in client.lrange(K.queue(queue), 0, -1)]
    for rec in client.hvals(K.scheduled_jobs):
        _meta, name, payload = rec.decode().split("\n", 2)
        if name == queue:
            jobs.append(json.loads(payload))
    return jobs


#: case -> (the script whose reply is lost, how the job is sent, its job queue)
CASES: dict[str, tuple[str, Callable[[], Any], str]] = {
    "queued": ("enqueue", lambda: proj.record.apply_async(("once", 7), **RETRY),
               "tests.apps.proj.record"),
    "scheduled": ("schedule",
                  lambda: proj.record.apply_async(("once", 7), countdown=1.0, **RETRY),
                  "tests.apps.proj.record"),
    # A retry of a unique job is written even while its lock is held (by itself here).
    "unique-retry": ("enqueue_unique",
                     lambda: proj_sets.unique_job.apply_async(("once",), retries=1, **RETRY),
                     "tests.apps.proj_sets.unique_job"),
}


def drop_in_app(url: str) -> Celery:
    """A producer app as a drop-in user has it: only the URL is ours, no install(app);
    the job name is routed to its own queue, where the worker below consumes it."""
    app = Celery("dropin_producer", broker=url, set_as_current=False)
    app.conf.task_routes = {"tests.apps.proj.record": {"queue": "tests.apps.proj.record"}}
    return app


#: Drop-in cases: (the script whose reply is lost, apply_async options beyond RETRY).
DROP_IN_CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "queued": ("enqueue", {}),
    "scheduled": ("schedule", {"countdown": 1.0}),
}


@pytest.mark.parametrize(("mode", "case"), [("install", c) for c in CASES]
                         + [("drop-in", c) for c in DROP_IN_CASES])
def test_a_publish_retried_after_its_write_landed_stores_and_runs_one_job(
        proxy: Proxy, redis_client: redis.Redis, rec: redis.Redis,
        worker_factory: Callable[..., WorkerProcess], mode: str, case: str) -> None:
    url = f"celery-ext://127.0.0.1:{proxy.port}/0"
    proj.configure(url)
    rec.delete("runs:once")
    proj.record.delay("warm-up", 0)  # connected, scripts loaded
    dropin = drop_in_app(url) if mode == "drop-in" else None
    if dropin is None:
        script, send, queue = CASES[case]
    else:
        script, options = DROP_IN_CASES[case]
        queue = "tests.apps.proj.record"
        dropin.send_task(queue, ("warm-up", 0), **RETRY)  # its connection is made

        def send() -> Any:
            assert dropin is not None
            return dropin.send_task(queue, ("once", 7), **options, **RETRY)
    redis_client.delete(K.queue("tests.apps.proj.record"),
                        *redis_client.scan_iter(K.published("*")))

    proxy.cut_on_reply(scripts.sha(script).encode())
    try:
        result = send()
    finally:
        if dropin is not None:
            dropin.close()
    assert proxy.replies_cut == 1  # the fault happened inside the round trip

    jobs = stored_payloads(redis_client, queue)
    assert [j["headers"]["id"] for j in jobs] == [result.id]  # one job, not two
    assert PUBLISH_ID not in jobs[0]["properties"]  # the publish id is not stored
    markers = list(redis_client.scan_iter(K.published("*")))
    assert len(markers) == 1
    assert 0 < redis_client.pttl(markers[0]) <= DEFAULT_PUBLISH_IDEMPOTENCY_TTL * 1000

    worker_factory("tests.apps.proj_sets", broker_url=url, pool="solo", concurrency=1).start()
    wait_for(lambda: rec.llen("runs:once"), 20, "the job to run")
    time.sleep(0.5)
    assert rec.llen("runs:once") == 1


def test_one_publish_to_two_queues_stores_a_job_in_each(
        broker_url: str, redis_client: redis.Redis) -> None:
    """A publish delivered to several queues (one exchange, two bindings) has one
    marker per job queue: the second queue's job is not taken for a retry. A message
    dict published again after a publish that succeeded is a new publish."""
    ex = Exchange("fan_direct", type="direct")
    queues = [Queue(name, ex, routing_key="k") for name in ("twin_a", "twin_b")]
    with Connection(broker_url) as conn:
        channel = conn.default_channel
        for q in queues:
            q(channel).declare()
        conn.Producer().publish({"x": 1}, exchange=ex, routing_key="k", retry=True)
        assert redis_client.llen(K.queue("twin_a")) == 1
        assert redis_client.llen(K.queue("twin_b")) == 1
        assert len(list(redis_client.scan_iter(K.published("*")))) == 2
        again = channel.prepare_message("body", headers={"task": "t"})
        for _ in range(2):
            channel.basic_publish(again, exchange="fan_direct", routing_key="k")
    assert redis_client.llen(K.queue("twin_a")) == 3
    assert redis_client.llen(K.queue("twin_b")) == 3
    assert len(list(redis_client.scan_iter(K.published("*")))) == 6
