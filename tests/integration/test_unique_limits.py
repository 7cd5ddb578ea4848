"""Unique jobs, per-job concurrency limits, pause and resume (issue 4).

Real server, real ``celery worker`` subprocesses running ``tests.apps.proj_sets``. Pause and
resume run with ``install(app)`` and drop-in (the ``mode`` fixture); ``unique`` and
``max_concurrency`` are ``install(app)`` only: a unique job is enqueued through
install's ``send_task``, and a limit belongs to a task's own job queue, which a drop-in
producer does not route to (every task goes to the ``celery`` queue).
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import redis

from celery_ext.client import Client
from celery_ext.options.limits import write_limits
from celery_ext.store.keys import Keys
from tests.apps import proj
from tests.helpers import Factory, Mode, start_workers, wait_for
from tests.helpers import mode_fixture as mode_fixture  # the `mode` fixture: both modes

#: Nothing reads what this module's pools write at a warm stop: teardown SIGKILLs
#: them (worker_factory in tests/conftest.py).
pytestmark = pytest.mark.kill_workers_at_teardown

K = Keys("celery_ext")
FAST_REAPER = {
    "CELERY_EXT_HEARTBEAT_INTERVAL": "0.25",
    "CELERY_EXT_DEAD_AFTER": "1.5",
    "CELERY_EXT_REAP_INTERVAL": "0.5",
}


@pytest.fixture
def app(broker_url: str, redis_client: redis.Redis) -> Any:
    proj.configure(broker_url)
    from tests.apps import proj_sets

    return proj_sets


@pytest.fixture
def client(redis_client: redis.Redis) -> Client:
    return Client(redis_client)


def at_once(n: int, call: Callable[[], str]) -> list[str]:
    """Run ``call`` in ``n`` threads released together; return what each got."""
    barrier = threading.Barrier(n)
    got: list[str] = []

    def run() -> None:
        barrier.wait()
        got.append(call())

    threads = [threading.Thread(target=run) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return got


def pool_of(client: redis.Redis, worker: Any) -> str | None:
    """The registered pool id of a worker process (ids are host:pid:random)."""
    return next((p.decode() for p in client.zrange(K.pools, 0, -1)
                 if f":{worker.pid}:" in p.decode()), None)


def test_paused_job_queue_keeps_its_jobs_until_resumed(
        app: Any, mode: Mode, client: Client, redis_client: redis.Redis, rec: redis.Redis,
        worker_factory: Factory) -> None:
    """Pause holds a job queue's jobs (fetch skips it) and resume releases them at once,
    whichever queue it is: the task's own (``install(app)``) or ``celery`` (drop-in)."""
    start_workers(worker_factory, 1, env=mode.env())
    queue = mode.queue(proj.record)
    assert client.pause(queue) is True and client.pause(queue) is False
    sent = [mode.send(proj.record, "p", i) for i in range(3)]
    time.sleep(0.7)
    assert rec.llen("runs:p") == 0 and redis_client.llen(K.queue(queue)) == 3
    assert client.job_queues(prefix=queue)[0]["paused"]
    assert client.resume(queue) is True
    assert [r.get(timeout=5) for r in sent] == [0, 1, 2]
    # (A drained queue with no weight, as drop-in's ``celery``, leaves the listing.)
    assert not any(q["paused"] for q in client.job_queues(prefix=queue))


def test_unique_job_enqueued_once_while_pending(
        app: Any, client: Client, redis_client: redis.Redis, rec: redis.Redis,
        worker_factory: Factory) -> None:
    start_workers(worker_factory, 2)
    queue = "tests.apps.proj_sets.unique_job"

    # 100 concurrent enqueues while the queue is paused: one job, one id for all.
    assert client.pause(queue) is True and client.pause(queue) is False
    ids = at_once(100, lambda: app.unique_job.delay("u").id)
    assert len(set(ids)) == 1 and redis_client.llen(K.queue(queue)) == 1
    time.sleep(0.7)
    assert rec.llen("runs:u") == 0  # paused: skipped by fetch, job kept
    assert client.job_queues(prefix=queue)[0]["paused"]
    assert client.resume(queue) is True
    wait_for(lambda: rec.llen("runs:u"), 1, "the job to run right after resume")

    # Scheduled: 100 concurrent enqueues with a countdown, one runs. (The countdown
    # outlasts the enqueues on a loaded box: once the job starts, its lock is free.)
    ids = at_once(100, lambda: app.unique_job.apply_async(("s",), countdown=3).id)
    assert len(set(ids)) == 1 and client.counts()["scheduled"] == 1
    wait_for(lambda: rec.llen("runs:s"), 8, "the scheduled unique job")

    # The lock is released when the job starts: the same job may be enqueued again.
    again = app.unique_job.delay("u")
    assert again.id != ids[0]
    wait_for(lambda: rec.llen("runs:u") == 2, 5, "the second unique run")

    # A key function: same key, other args, still the same pending job.
    client.pause("tests.apps.proj_sets.unique_by_key")
    a1 = app.unique_by_key.delay("a", 1)
    assert app.unique_by_key.delay("a", 2).id == a1.id
    assert app.unique_by_key.delay("b", 1).id != a1.id
    client.resume("tests.apps.proj_sets.unique_by_key")
    wait_for(lambda: rec.llen("runs:a") and rec.llen("runs:b"), 5, "the keyed jobs")
    time.sleep(0.5)
    assert [rec.llen(f"runs:{k}") for k in ("u", "s", "a", "b")] == [2, 1, 1, 1]
    assert not list(redis_client.scan_iter(K.unique("*")))  # every lock released


def test_pool_start_writes_only_changed_limits_and_wakes_only_their_queues(
        redis_client: redis.Redis) -> None:
    """A pool's start sets its tasks' limits, removes undeclared ones, and leaves the
    rest alone: unchanged limits are neither rewritten nor published to idle pools."""
    sub = redis_client.pubsub()
    sub.subscribe(K.wake_channel)
    assert sub.get_message(timeout=1)["type"] == "subscribe"

    def woken() -> list[str]:
        names = []
        while (msg := sub.get_message(timeout=0.2)) is not None:
            names.append(msg["data"].decode())
        return sorted(names)

    redis_client.hset(K.limits, mapping={"stale": 3, "kept": 2, "changed": 1})
    consumed = ["kept", "changed", "stale", "free"]
    assert write_limits(redis_client, K, {"kept": 2, "changed": 4}, consumed) == \
        ["changed", "stale"]
    assert redis_client.hgetall(K.limits) == {b"kept": b"2", b"changed": b"4"}
    assert woken() == ["changed", "stale"]
    # The same pool starting again: nothing to write, nobody woken.
    assert write_limits(redis_client, K, {"kept": 2, "changed": 4}, consumed) == []
    assert woken() == []
    # A limit set by hand (Client.set_max_concurrency) lasts until a pool starts.
    Client(redis_client).set_max_concurrency("free", 5)
    woken()
    assert write_limits(redis_client, K, {}, ["free"]) == ["free"]
    assert redis_client.hget(K.limits, "free") is None and woken() == ["free"]
    sub.close()


@pytest.mark.parametrize(("pool", "pools", "concurrency"),
                         [("threads", 4, 4), ("gevent", 2, 50)])
def test_max_concurrency_holds_across_pools(
        app: Any, client: Client, pool: str, pools: int, concurrency: int,
        redis_client: redis.Redis, rec: redis.Redis, worker_factory: Factory) -> None:
    """``max_concurrency=2``, 4 pools x 4 threads (2 x 50 greenlets): never more than 2
    running at once, observed from inside the task; the in-flight count returns to 0."""
    start_workers(worker_factory, pools, pool=pool, concurrency=concurrency)
    queue = "tests.apps.proj_sets.limited"
    assert client.limits() == {queue: 2}
    for _ in range(16):
        app.limited.delay("m", 0.25)
    wait_for(lambda: rec.llen("runs:m") >= 16, 20, "16 runs")
    assert int(rec.get("max:m") or 0) == 2
    assert len({r for r in rec.lrange("runs:m", 0, -1)}) >= 2  # spread over pools
    wait_for(lambda: int(redis_client.hget(K.running, queue) or 0) == 0, 5, "running back to 0")


def test_max_concurrency_count_returns_to_zero_after_killed_pools(
        app: Any, redis_client: redis.Redis, rec: redis.Redis, worker_factory: Factory) -> None:
    """Pools killed while they hold limited jobs: the reaper releases their share, so
    the count never drifts and the pool started last runs every job."""
    queue = "tests.apps.proj_sets.limited"
    for _ in range(20):
        app.limited.delay("k", 0.8)
    # Each victim starts alone, so it (not a faster-acking rival) takes the free slots;
    # the second one gets them only once its reaper has released the first one's share.
    for _ in range(2):
        victim, = start_workers(worker_factory, 1, pool="threads", concurrency=4,
                                env=FAST_REAPER)
        pool_id = wait_for(lambda v=victim: pool_of(redis_client, v), 5, "the victim's pool")
        wait_for(lambda p=pool_id: redis_client.hlen(K.inflight(p)), 10,
                 "the victim holding a job")
        victim.stop(signal.SIGKILL)
        assert int(redis_client.hget(K.running, queue) or 0) <= 2
    survivor, = start_workers(worker_factory, 1, pool="threads", concurrency=4, env=FAST_REAPER)
    wait_for(lambda: rec.llen("runs:k") >= 20, 30, "every job to run")
    wait_for(lambda: int(redis_client.hget(K.running, queue) or 0) == 0, 10, "running back to 0")
    assert survivor.alive


def test_deleting_a_unique_job_releases_its_lock(
        app: Any, client: Client, redis_client: redis.Redis, rec: redis.Redis,
        worker_factory: Factory) -> None:
    """A deleted scheduled or dead unique job no longer holds its lock: an identical
    job is accepted at once (a new id) and runs, through the client and the JSON API."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from starlette.testclient import TestClient

    from celery_ext.admin.web import create_app

    queue = "tests.apps.proj_sets.unique_job"
    # A pool that does not know the task dead-letters it (unknown_task) before it
    # starts, so its lock stays taken.
    stranger = worker_factory("tests.apps.proj", queues=[queue]).start()
    dead = app.unique_job.delay("x")
    (dead_id,) = wait_for(lambda: [j["id"] for j in client.dead()["items"]], 10,
                          "the job in the dead set")
    assert client.dead()["items"][0]["reason"] == "unknown_task"
    assert app.unique_job.delay("x").id == dead.id  # its lock is still held
    stranger.stop()
    assert client.delete_dead(dead_id) and not client.delete_dead(dead_id)

    start_workers(worker_factory, 1)
    again = app.unique_job.delay("x")
    assert again.id != dead.id
    wait_for(lambda: rec.llen("runs:x") == 1, 10, "the identical job after the dead one")

    # Scheduled, deleted through the client.
    first = app.unique_job.apply_async(("s",), countdown=300)
    assert app.unique_job.apply_async(("s",), countdown=300).id == first.id
    (sched_id,) = [j["id"] for j in client.scheduled()["items"]]
    assert client.delete_scheduled(sched_id) and not client.delete_scheduled(sched_id)
    second = app.unique_job.delay("s")
    assert second.id != first.id
    wait_for(lambda: rec.llen("runs:s") == 1, 10, "the identical job after the deleted one")

    # Scheduled, deleted through the JSON API.
    third = app.unique_job.apply_async(("w",), countdown=300)
    (sched_id,) = [j["id"] for j in client.scheduled()["items"]]
    with TestClient(create_app(client)) as api:
        token = api.get("/api/csrf").json()["csrf_token"]
        r = api.post("/api/scheduled/delete", json={"id": sched_id},
                     headers={"X-CSRF-Token": token})
        assert r.status_code == 200
    fourth = app.unique_job.delay("w")
    assert fourth.id != third.id
    wait_for(lambda: rec.llen("runs:w") == 1, 10, "the identical job after the API delete")
    assert client.counts() == {"scheduled": 0, "retry": 0, "dead": 0}
    assert not list(redis_client.scan_iter(K.unique("*")))
