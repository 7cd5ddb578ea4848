"""Per-message priority inside a job queue (issue 14): Celery's ``priority`` as Kombu's
Redis transport means it (lower runs first, rounded down to ``priority_steps``), FIFO
within a level, kept by every move back to a queue.

End-to-end tests run ``tests.apps.proj_priority`` workers, once with ``install(app)`` and
once drop-in (the ``mode`` fixture); the rest call the plugin's parts in-process on the
real server.
"""

from __future__ import annotations

import json
import os
import signal
from types import SimpleNamespace
from typing import Any

import pytest
import redis
from celery import Celery
from kombu.transport import redis as kredis
from kombu.transport import virtual

from celery_ext.client import Client
from celery_ext.config import ConfigError, Settings
from celery_ext.options.priority import level
from celery_ext.store.dead_set import dead_letter
from celery_ext.store.keys import Keys
from celery_ext.store.scripts import Scripts
from celery_ext.worker.heartbeater import Heartbeater
from celery_ext.worker.inflight import InflightRecord
from celery_ext.worker.reaper import Reaper
from tests.apps import proj
from tests.helpers import Factory, Mode, wait_for
from tests.helpers import mode_fixture as mode_fixture  # the `mode` fixture: both modes

#: Nothing reads what this module's pools write at a warm stop: teardown SIGKILLs
#: them (worker_factory in tests/conftest.py).
pytestmark = pytest.mark.kill_workers_at_teardown

K = Keys("celery_ext")
APP = "tests.apps.proj_priority"
STEPS = (0, 3, 6, 9)


@pytest.fixture
def tasks(mode: Mode) -> Any:
    from tests.apps import proj_priority

    return proj_priority


def order(rec: redis.Redis, key: str) -> list[str]:
    return [v.decode() for v in rec.lrange(f"order:{key}", 0, -1)]


def inflight_tags(client: redis.Redis) -> list[bytes]:
    """The delivery tags in every pool's in-flight record."""
    return [tag for pool in client.zrange(K.pools, 0, -1)
            for tag in client.hkeys(K.inflight(pool.decode()))]


def solo_worker(factory: Factory, mode: Mode, prefetch: int = 1, pool: str = "solo") -> Any:
    return factory(APP, pool=pool, concurrency=1, env=mode.env(),
                   extra_args=["--prefetch-multiplier", str(prefetch)]).start(timeout=60)


# -- end to end ----------------------------------------------------------------------------------


@pytest.mark.parametrize(("mode", "pool"), [
    ("install", "solo"), ("dropin", "solo"),
    ("install", "gevent")],
    indirect=["mode"])
def test_lower_priority_runs_first_fifo_within_a_level_scheduled_and_retried_keep_it(
        tasks: Any, mode: Mode, pool: str, rec: redis.Redis, redis_client: redis.Redis,
        worker_factory: Factory) -> None:
    """One slot (a gevent pool of one greenlet too), so the order the jobs start in is
    the order the pool fetched them in."""
    mark, queue = tasks.mark, mode.queue(tasks.mark)
    # No worker yet: 200 jobs at priority 9, then 20 at priority 0.
    for i in range(200):
        mode.send(mark, "a", f"low{i}", priority=9)
    for i in range(20):
        mode.send(mark, "a", f"high{i}", priority=0)
    assert redis_client.llen(K.queue_level(queue, 9)) == 200
    sizes = {q["name"]: q["size"] for q in Client(redis_client).job_queues()}
    assert sizes[queue] == 220  # every level counted

    worker = solo_worker(worker_factory, mode, pool=pool)
    wait_for(lambda: len(order(rec, "a")) == 220, 20, "all 220 jobs to run")
    assert order(rec, "a") == [f"high{i}" for i in range(20)] + [f"low{i}" for i in range(200)]

    # A retry and a countdown job at priority 0 go ahead of jobs at 9 queued before them.
    client = Client(redis_client)
    retried = mode.send(mark, "b", "retried", 30.0, priority=0)
    wait_for(lambda: client.retries()["items"], 20, "the retry in the retry set")
    mode.send(mark, "b", "gate", 0.0, True, priority=3)  # holds the solo worker
    wait_for(lambda: order(rec, "b") == ["gate"], 20, "the gate job to start")
    for i in range(5):
        mode.send(mark, "b", f"low{i}", priority=9)
    counted = mode.send(mark, "b", "countdown", countdown=30, priority=1)
    waiting = [*client.retries()["items"], *client.scheduled()["items"]]
    assert sorted(job["task_id"] for job in waiting) == sorted([retried.id, counted.id])
    assert all(client.run_scheduled_now(job["id"]) for job in waiting)
    wait_for(lambda: redis_client.llen(K.queue(queue)) == 2, 20, "both promoted to level 0")
    rec.set("open:b", 1)
    wait_for(lambda: len(order(rec, "b")) == 8, 30, "the rest to run")
    # The retry went to the front of its level, the countdown job to the back.
    assert order(rec, "b") == ["gate", "retried", "countdown"] + [f"low{i}" for i in range(5)]
    worker.stop()


def test_jobs_returned_at_shutdown_keep_their_priority_ahead_of_their_equals(
        tasks: Any, mode: Mode, rec: redis.Redis, redis_client: redis.Redis,
        worker_factory: Factory) -> None:
    mark, queue = tasks.mark, mode.queue(tasks.mark)
    # A prefork pool of one child that reserves up to 3 jobs, acked when they end.
    first = worker_factory(APP, concurrency=1, env=mode.env(acks_late=True),
                           extra_args=["--prefetch-multiplier", "3"]).start(timeout=60)
    mode.send(mark, "c", "gate", 0.0, True, priority=0)
    wait_for(lambda: order(rec, "c") == ["gate"], 20, "the gate job to start")
    mode.send(mark, "c", "six0", priority=6)
    mode.send(mark, "c", "six1", priority=6)
    wait_for(lambda: len(inflight_tags(redis_client)) == 3, 20, "the pool to reserve both")
    mode.send(mark, "c", "six2", priority=6)
    mode.send(mark, "c", "zero", priority=0)
    # Warm shutdown: the two reserved jobs go back to the front of level 6.
    os.kill(first.pid, signal.SIGTERM)
    first.wait_for_log("Warm shutdown", timeout=20)
    rec.set("open:c", 1)
    wait_for(lambda: not first.alive, 30, "the first pool to exit")
    assert redis_client.llen(K.queue_level(queue, 6)) == 3
    assert redis_client.llen(K.queue(queue)) == 1

    worker_factory(APP, concurrency=1, env=mode.env(acks_late=True)).start(timeout=60)
    wait_for(lambda: len(order(rec, "c")) == 5, 30, "the returned jobs to run")
    assert order(rec, "c") == ["gate", "zero", "six0", "six1", "six2"]


# -- in-process ----------------------------------------------------------------------------------


def test_levels_round_as_kombus_redis_transport_does() -> None:
    """Clamped to 0-9, unreadable = 0, rounded down to a step: Kombu's own functions."""
    kombu_chan = SimpleNamespace(min_priority=0, max_priority=9, default_priority=0)
    for steps in (STEPS, (0,), (0, 1, 2, 3, 4, 5, 6, 7, 8, 9), (0, 5)):
        for value in (*range(-2, 13), None, "4", "x", 3.7):
            clamped = virtual.Channel._get_message_priority(
                kombu_chan, {"properties": {"priority": value}})
            expected = kredis.Channel.priority(SimpleNamespace(priority_steps=list(steps)),
                                               clamped)
            assert level(value, steps) == expected, (steps, value)


def test_priority_steps_setting() -> None:
    assert Settings().priority_steps == STEPS
    assert Settings.load({"priority_steps": [0, 5]}).priority_steps == (0, 5)
    assert Settings.load({}, environ={"CELERY_EXT_PRIORITY_STEPS": "0,4,8"}).priority_steps \
        == (0, 4, 8)
    for bad in ([], [3, 6], [0, 6, 3], [0, 3, 3], [0, 12], "0,x", [0, 1.5]):
        with pytest.raises(ConfigError, match="priority_steps"):
            Settings.load({"priority_steps": bad})


def test_producer_levels_queue_sizes_and_purge_cover_every_level(
        broker_url: str, redis_client: redis.Redis) -> None:
    """task_default_priority and the priority option pick the level list, with the
    configured steps; sizes, purge and delete see every level."""
    app = Celery("prio", broker=broker_url, set_as_current=False)
    app.conf.update(task_default_priority=9, broker_transport_options={"priority_steps": [0, 5]})

    @app.task(name="t", shared=False)
    def task() -> None: ...

    try:
        task.apply_async(queue="q")                   # default 9 -> level 5
        task.apply_async(queue="q", priority=4)       # -> level 0
        app.send_task("u", queue="q", priority=7)     # -> level 5
        app.send_task("u", queue="q")                 # none -> level 0
        assert redis_client.llen(K.queue("q")) == 2
        assert redis_client.llen(K.queue_level("q", 5)) == 2
        client = Client(redis_client, Settings(priority_steps=(0, 5)))
        assert [(q["name"], q["size"]) for q in client.job_queues()] == [("q", 4)]
        with app.connection_for_write() as conn:
            channel = conn.default_channel
            assert channel._size("q") == 4
            assert channel.queue_purge("q") == 4
            assert not redis_client.exists(K.queue("q"), K.queue_level("q", 5))
            app.send_task("t", queue="q", priority=7)
            assert channel._has_queue("q")
            channel._delete("q", "", "q", "")
            assert not redis_client.exists(K.queue_level("q", 5))
    finally:
        app.close()


def test_unique_job_goes_to_its_level(broker_url: str, redis_client: redis.Redis) -> None:
    proj.configure(broker_url)
    from tests.apps import proj_sets

    proj_sets.unique_job.apply_async(("u",), priority=6)
    proj_sets.unique_job.apply_async(("u",), priority=6)  # pending: nothing enqueued
    assert redis_client.llen(K.queue_level(proj_sets.unique_job.name, 6)) == 1


def payload(tag: str, priority: int | None) -> bytes:
    props: dict[str, Any] = {"delivery_tag": tag}
    if priority is not None:
        props["priority"] = priority
    return json.dumps({"headers": {"task": "t", "id": tag}, "properties": props}).encode()


def fetch_one(client: redis.Redis, pool_id: str, queue: str) -> str:
    """Fetch one job of ``queue`` into ``pool_id``'s record (as a pool does); its tag."""
    status, jobs, *_ = Scripts(client)("fetch", K.fetch(pool_id, [queue], STEPS),
                                       [pool_id, "1", queue, 0])
    assert status == 1 and len(jobs) == 1
    return str(jobs[0][1].decode())


def test_a_fetch_checks_whether_a_queue_is_left_empty_with_one_command(
        redis_client: redis.Redis) -> None:
    """After each pop the fetch asks whether the job's queue has any job left, in its
    later levels or its fair keys, with one EXISTS of those lists, not an LLEN per level:
    at 10,000 job names of two jobs each, every other job empties its queue (issue 36).
    The answer is the same: a queue with a job left at a later level or under a fair key
    is not reported empty, and stays in the ready set."""
    pool = Heartbeater(redis_client, Settings(), "host:1:levels")
    pool.register()
    redis_client.lpush(K.queue_level("last", 0), payload("l0", None))
    redis_client.lpush(K.queue_level("later", 0), payload("a0", None))
    redis_client.lpush(K.queue_level("later", 9), payload("a9", 9))
    redis_client.lpush(K.queue_level("keyed", 0), payload("k0", None))
    redis_client.lpush(K.fair_ring("keyed"), "user1")
    redis_client.lpush(K.fair_queue("keyed", "user1"), payload("k1", None))
    redis_client.lpush(K.queue_level("two", 0), payload("t0", None), payload("t1", None))
    queues = ["last", "later", "keyed", "two"]
    redis_client.sadd(K.ready, *queues)
    redis_client.config_resetstat()
    status, jobs, empties, *_ = Scripts(redis_client)(
        "fetch", K.fetch(pool.pool_id, queues, STEPS), [pool.pool_id, "1111", *queues, 0])
    stats = redis_client.info("commandstats")
    checks = sum(int(stats.get(f"cmdstat_{c}", {}).get("calls", 0)) for c in ("llen", "exists"))
    assert status == 1 and [j[1] for j in jobs] == [b"l0", b"a0", b"k0", b"t0"]
    assert empties == [b"last"] and redis_client.smembers(K.ready) == {b"later", b"keyed", b"two"}
    # One per job, and the call's one look at the revoked ids (before: 16, an LLEN per
    # level left after the popped one and the ring's EXISTS).
    assert checks == len(jobs) + 1


def test_requeued_recovered_and_dead_retried_jobs_go_to_the_front_of_their_level(
        redis_client: redis.Redis) -> None:
    settings = Settings(dead_after=2.0, heartbeat_interval=1.0)
    pool = Heartbeater(redis_client, settings, "host:1:prio")
    pool.register()
    six = K.queue_level("q", 6)
    for tag, pri in (("a", 6), ("b", 6), ("c", 7), ("z", None)):
        redis_client.lpush(K.queue_level("q", level(pri, STEPS)), payload(tag, pri))
    redis_client.sadd(K.ready, "q")
    # The default level first (FIFO), then level 6 in enqueue order.
    assert [fetch_one(redis_client, pool.pool_id, "q") for _ in range(2)] == ["z", "a"]
    record = InflightRecord(redis_client, K, pool.pool_id, STEPS)
    record.ack(["z"])

    def front() -> str:  # the tag of the job fetched next from level 6
        return str(json.loads(redis_client.lindex(six, -1))["properties"]["delivery_tag"])

    # Requeue (reject with requeue, return at shutdown, reconcile): ahead of b and c.
    assert record.requeue(["a"]) == ["a"] and front() == "a" and redis_client.llen(six) == 3

    # The reaper recovers a dead pool's job: ahead of its equals too.
    assert fetch_one(redis_client, pool.pool_id, "q") == "a"
    redis_client.zadd(K.pools, {pool.pool_id: 0})  # its heartbeat, long ago
    result = Reaper(redis_client, settings).reap()
    assert result.requeued == ["a"] and front() == "a"
    assert int(redis_client.hget(K.redelivery, "a")) == 1

    # A dead job retried by hand goes back to the front of its level.
    redis_client.delete(six)
    redis_client.lpush(six, payload("b", 6))
    assert dead_letter(redis_client, settings, "-", "d", reason="failed", error="x",
                       fallback=b"q\n" + payload("d", 8))
    assert Client(redis_client, settings).retry_dead("d") and front() == "d"
    assert redis_client.llen(six) == 2
