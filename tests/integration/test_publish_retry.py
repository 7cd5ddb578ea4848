"""Exactly-once enqueue across an outage (DESIGN.md promise 7: a fault inside a round trip).

A producer reaches Redis through a TCP proxy that forwards one enqueue to Redis, which
runs it, and then closes the connection instead of passing the reply on; with
``install(app)`` and drop-in (only the URL changed: Kombu's own producer). Celery's
publish retry policy (``kombu.Connection.ensure``) reconnects and publishes again: the
job must be stored once and run once.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis
from celery import Celery
from kombu import Connection, Exchange, Queue

import celery_ext
from celery_ext.config import DEFAULT_PUBLISH_IDEMPOTENCY_TTL
from celery_ext.errors import NotReplicated
from celery_ext.producer.periodic_run import PeriodicRun, publishing, run_id
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


# -- wait_replicas: a retried publish waits for the write it found --------------------------
@pytest.fixture(scope="module")
def replicated() -> Iterator[tuple[RedisServer, RedisServer]]:
    """A primary and one replica in sync (no sentinels: the test decides what fails)."""
    with RedisServer(appendonly=False) as primary:
        replica = RedisServer(appendonly=False,
                              extra_args=["--replicaof", primary.host, str(primary.port),
                                          "--repl-diskless-sync-delay", "0"])
        with replica:
            wait_for(lambda: in_sync(primary, replica), 15, "the replica to sync")
            yield primary, replica


def in_sync(primary: RedisServer, replica: RedisServer) -> bool:
    with replica.client() as r, primary.client() as p:
        link = r.info("replication").get("master_link_status") == "up"
        return link and p.info("replication").get("connected_slaves") == 1


def replicated_app(url: str) -> Celery:
    """A producer with ``wait_replicas=1`` and a plain and a unique job."""
    app = Celery("replicated_producer", broker=url, set_as_current=False)
    app.conf.broker_transport_options = {"wait_replicas": 1, "wait_timeout_ms": 300}
    app.conf.task_ignore_result = True
    celery_ext.install(app)

    @app.task(name="replicated.plain", shared=False)
    def plain(n: int) -> None: ...

    @app.task(name="replicated.unique", shared=False, unique=True)
    def unique(n: int) -> None: ...

    return app


#: case -> (the script whose reply is lost, job name, apply_async options beyond RETRY)
REPLICATED_CASES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "queued": ("enqueue", "replicated.plain", {}),
    "scheduled": ("schedule", "replicated.plain", {"countdown": 60.0}),
    "unique": ("enqueue_unique", "replicated.unique", {}),
}


@pytest.mark.parametrize("replica_state", ["up", "paused"])
@pytest.mark.parametrize("case", list(REPLICATED_CASES))
def test_a_retried_publish_waits_for_the_replication_of_the_write_it_found(
        replicated: tuple[RedisServer, RedisServer], case: str, replica_state: str) -> None:
    """wait_replicas=1: the first attempt's script runs and its reply is lost; Kombu's
    retry finds the publish marker and writes no job. Its WAIT, on a fresh connection,
    must still cover the first attempt's write: with the replica up the publish returns
    and the replica has the job; with the replica paused
    (SIGSTOP: the primary still counts it as connected) since before the first attempt,
    the retry raises NotReplicated instead of returning as if a replica had the job."""
    primary, replica = replicated
    with primary.client() as c, replica.client() as r:
        c.flushall()
        wait_for(lambda: r.dbsize() == 0, 10, "the flush to replicate")
    script, name, options = REPLICATED_CASES[case]
    proxy = Proxy(("127.0.0.1", primary.port)).start()
    app = replicated_app(f"celery-ext://127.0.0.1:{proxy.port}/0")
    try:
        task = app.tasks[name]
        task.apply_async((0,), **options, **RETRY)  # connected, scripts loaded
        proxy.cut_on_reply(scripts.sha(script).encode())
        if replica_state == "paused":
            os.kill(replica.pid or 0, signal.SIGSTOP)
        try:
            if replica_state == "paused":
                with pytest.raises(NotReplicated, match="0 of 1 replica"):
                    task.apply_async((1,), **options, **RETRY)
            else:
                task.apply_async((1,), **options, **RETRY)
        finally:
            if replica_state == "paused":
                os.kill(replica.pid or 0, signal.SIGCONT)
        assert proxy.replies_cut == 1  # the fault happened inside the round trip
    finally:
        app.close()
        proxy.stop()
    with primary.client() as c:
        assert len(stored_jobs(c, name)) == 2  # the warm-up and this one, not a third
    if replica_state == "up":
        with replica.client() as r:
            assert len(stored_jobs(r, name)) == 2



@pytest.mark.parametrize("options", [{}, {"countdown": 60.0}], ids=["queued", "scheduled"])
def test_a_periodic_run_waits_for_its_replica(
        replicated: tuple[RedisServer, RedisServer], options: dict[str, Any]) -> None:
    """wait_replicas holds for a periodic job's run as for any publish (one script, or the
    two steps of a run with a countdown): with the replica up the publish returns once it
    has the run; with the replica paused it raises NotReplicated (the run is on the
    primary) instead of returning as if a replica had it."""
    primary, replica = replicated
    with primary.client() as c, replica.client() as r:
        c.flushall()
        wait_for(lambda: r.dbsize() == 0, 10, "the flush to replicate")
    app = replicated_app(f"celery-ext://127.0.0.1:{primary.port}/0")
    task = app.tasks["replicated.plain"]
    try:
        for n, replica_state in enumerate(("up", "paused")):
            due = 1000 * (n + 1)
            run = PeriodicRun("tick", run_id("celery_ext", "tick", due), None, due, None)
            if replica_state == "paused":
                os.kill(replica.pid or 0, signal.SIGSTOP)
            try:
                with publishing(run):
                    if replica_state == "paused":
                        with pytest.raises(NotReplicated, match="0 of 1 replica"):
                            task.apply_async((n,), **options)
                    else:
                        task.apply_async((n,), **options)
                        assert run.outcome == 1
                        with replica.client() as r:
                            assert len(stored_jobs(r, task.name)) == 1
            finally:
                if replica_state == "paused":
                    os.kill(replica.pid or 0, signal.SIGCONT)
    finally:
        app.close()
    with primary.client() as c:
        assert len(stored_jobs(c, task.name)) == 2

def stored_jobs(client: redis.Redis, queue: str) -> list[bytes]:
    """Jobs of ``queue`` in its job queue and in the scheduled set."""
    jobs = client.lrange(K.queue(queue), 0, -1)
    return jobs + [rec for rec in client.hvals(K.scheduled_jobs)
                   if rec.split(b"\n", 2)[1] == queue.encode()]
