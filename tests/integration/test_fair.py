"""Fair shares by key inside a job queue (issue 14): one key's backlog does not delay
another key's jobs; every move keeps a job in its key's sub-queue; per-key
concurrency limits hold across pools; nothing is left behind once drained.

End-to-end tests run ``tests.apps.proj_fair`` workers (``install(app)`` and drop-in: the
``mode`` fixture); the rest call the plugin's parts in-process on the real server.
"""

from __future__ import annotations

import json
import logging
import time
import warnings
from typing import Any

import pytest
import redis
from celery import Celery

from celery_ext.admin.web import create_app
from celery_ext.client import Client
from celery_ext.config import Settings
from celery_ext.options.fair import clean_key, job_fair_limits, payload_fair_key
from celery_ext.store.dead_set import dead_letter
from celery_ext.store.keys import Keys
from celery_ext.store.scripts import Scripts
from celery_ext.worker.heartbeater import Heartbeater
from celery_ext.worker.inflight import InflightRecord
from celery_ext.worker.reaper import Reaper
from celery_ext.worker.requeuer import Requeuer
from tests.apps import proj
from tests.helpers import Factory, Mode, celery_cli, start_workers, wait_for
from tests.helpers import mode_fixture as mode_fixture  # the `mode` fixture: both modes

#: Nothing reads what this module's pools write at a warm stop: teardown SIGKILLs
#: them (worker_factory in tests/conftest.py).
pytestmark = pytest.mark.kill_workers_at_teardown

K = Keys("celery_ext")
APP = "tests.apps.proj_fair"
STEPS = (0, 3, 6, 9)


@pytest.fixture
def tasks(mode: Mode) -> Any:
    from tests.apps import proj_fair

    return proj_fair


@pytest.fixture
def installed(broker_url: str, redis_client: redis.Redis) -> Any:
    """The test app's tasks, sent with ``install(app)`` (a test for one mode only)."""
    proj.configure(broker_url)
    from tests.apps import proj_fair

    return proj_fair


def order(rec: redis.Redis, key: str = "fair:order") -> list[str]:
    return [v.decode() for v in rec.lrange(key, 0, -1)]


def fair_leftovers(client: redis.Redis) -> list[bytes]:
    """Ring and sub-queue keys, and per-key in-flight counts, still in Redis."""
    return ([k for k in client.scan_iter(match="*queue:*\x06\x17*")]
            + [f for f in client.hkeys(K.running) if b"\n" in f])


def test_the_key_is_computed_whichever_app_is_current(installed: Any,
                                                      redis_client: redis.Redis) -> None:
    """The publish signal does not say which app publishes: the task is found in the
    app that declares it even when another app is the current one (several apps in one
    process)."""
    other = Celery("another-app")
    other.set_current()
    try:
        installed.work.apply_async(("T", 1))
    finally:
        proj.app.set_current()
    assert redis_client.llen(K.fair_queue("tests.apps.proj_fair.work", "T")) == 1


# -- end to end ----------------------------------------------------------------------------------


def test_a_small_tenant_is_not_delayed_by_a_big_one(
        tasks: Any, mode: Mode, rec: redis.Redis, redis_client: redis.Redis,
        worker_factory: Factory) -> None:
    """Tenant A enqueues 2,000 jobs, then tenant B 10: all of B's start before A's
    100th (one pool, threads -c 4). The producer computes the key with the task's
    fair_by in both modes."""
    work, queue = tasks.work, mode.queue(tasks.work)
    for i in range(2000):
        mode.send(work, "A", i)
    for i in range(10):
        mode.send(work, "B", i)
    assert redis_client.llen(K.fair_queue(queue, "A")) == 2000
    assert redis_client.llen(K.fair_queue(queue, "B")) == 10
    assert redis_client.lrange(K.fair_ring(queue), 0, -1) == [b"A", b"B"]
    info = {q["name"]: q for q in Client(redis_client).job_queues()}[queue]
    assert info["size"] == 2010
    assert info["fair"] == {"active_keys": 2, "top_keys": [("A", 2000), ("B", 10)],
                            "rate_limit": None, "not_due": []}

    worker_factory(APP, pool="threads", concurrency=4, env=mode.env()).start(timeout=60)
    wait_for(lambda: sum(1 for v in order(rec) if v.startswith("A")) >= 100
             and sum(1 for v in order(rec) if v.startswith("B")) == 10, 60,
             "B's 10 jobs and A's 100th")
    ran = order(rec)
    hundredth_a = [i for i, v in enumerate(ran) if v.startswith("A")][99]
    assert max(i for i, v in enumerate(ran) if v.startswith("B")) < hundredth_a, ran[:120]


def test_drained_queue_leaves_no_key_priority_is_fifo_inside_a_key(
        installed: Any, rec: redis.Redis, redis_client: redis.Redis,
        worker_factory: Factory) -> None:
    """Round-robin between keys, FIFO within a key whatever the priority (fair queues
    ignore it), unkeyed jobs of the queue first; once drained no ring, sub-queue or
    per-key count is left, and the queue is not in the ready set."""
    work, queue = installed.work, installed.work.name
    for i in range(3):
        work.apply_async(("x", i), priority=9 - 3 * i)   # 9, 6, 3: still FIFO
    for i in range(3):
        work.apply_async(("y", i))
    work.apply_async(("z", 0), fair_key=None)             # fair_by still gives "z"
    work.apply_async(("u", 0), fair_key="y")       # per call: wins over fair_by
    installed.again.apply_async((0,), fair_key="r")  # per call; its retry keeps it
    assert redis_client.llen(K.fair_queue(queue, "y")) == 4
    worker_factory(APP, pool="solo", concurrency=1,
                   extra_args=["--prefetch-multiplier", "1"]).start(timeout=60)
    wait_for(lambda: any(b'"fair_key": "r"}' in v
                         for v in redis_client.hvals(K.scheduled_jobs)), 30, "the retry")
    wait_for(lambda: len(order(rec)) == 9, 30, "9 jobs run")
    assert [v for v in order(rec) if v != "again0"] == [
        "x0", "y0", "z0", "x1", "y1", "x2", "y2", "u0"]
    # Every job's ack, ``again``'s retry included: it records its run before its ack,
    # which may land after the work queue's last one.
    wait_for(lambda: all(v == b"0" for v in redis_client.hvals(K.running)), 10,
             "the last acks")
    assert fair_leftovers(redis_client) == []
    assert not redis_client.sismember(K.ready, queue)


def test_killed_pools_jobs_return_to_their_keys_sub_queue(
        tasks: Any, mode: Mode, rec: redis.Redis, redis_client: redis.Redis,
        worker_factory: Factory) -> None:
    """A SIGKILLed pool's jobs of key X go back to X's sub-queue (the reaper's
    recovery), ahead of X's waiting jobs, and X's in-flight count is released."""
    held, queue = tasks.held, mode.queue(tasks.held)
    for i in range(3):
        mode.send(held, "X", i)
    mode.send(held, "Y", 0)
    worker = worker_factory(APP, pool="threads", concurrency=2,
                            env=mode.env(acks_late=True, CELERY_EXT_DEAD_AFTER="1.5",
                                         CELERY_EXT_HEARTBEAT_INTERVAL="0.5"),
                            extra_args=["--prefetch-multiplier", "1"]).start(timeout=60)
    wait_for(lambda: len(order(rec, "fair:started")) == 2, 30, "two jobs started")
    assert sorted(order(rec, "fair:started")) == ["X0", "Y0"]
    if not mode.dropin:  # (drop-in: the limit is the task's queue's, not "celery"'s)
        assert redis_client.hget(K.running, f"{queue}\nX") == b"1"
    worker.kill()
    settings = Settings(dead_after=1.5, heartbeat_interval=0.5)
    wait_for(lambda: Reaper(redis_client, settings).reap().requeued, 10, "the reaper")
    sub_x = K.fair_queue(queue, "X")
    assert [json.loads(p)["headers"]["argsrepr"] for p in
            redis_client.lrange(sub_x, 0, -1)] == ["('X', 2)", "('X', 1)", "('X', 0)"]
    assert redis_client.llen(K.fair_queue(queue, "Y")) == 1
    assert set(redis_client.lrange(K.fair_ring(queue), 0, -1)) == {b"X", b"Y"}
    assert not [f for f in redis_client.hkeys(K.running) if b"\n" in f]


@pytest.mark.parametrize(("pool", "concurrency"), [("threads", 4), ("gevent", 50)])
def test_per_key_limit_holds_across_two_pools(
        installed: Any, pool: str, concurrency: int, rec: redis.Redis,
        redis_client: redis.Redis, worker_factory: Factory) -> None:
    """fair_max_concurrency=2: at most 2 jobs of one key run at once in 2 pools of 4
    threads (or 50 greenlets), while the free slots serve the other keys."""
    limited = installed.limited
    start_workers(worker_factory, 2, APP, pool=pool, concurrency=concurrency)
    assert redis_client.hget(K.limits, f"{limited.name}\n") == b"2"
    for i in range(12):
        limited.apply_async(("A", i))
    for i in range(4):
        limited.apply_async(("B", i))
    wait_for(lambda: len(order(rec)) == 16, 60, "16 jobs run")
    seen_a = [int(v) for v in rec.lrange("fair:seen:A", 0, -1)]
    assert max(seen_a) == 2 and len(seen_a) == 12
    assert max(int(v) for v in rec.lrange("fair:seen:B", 0, -1)) == 2
    ran = order(rec)
    assert ran.index("B3") < ran.index("A11")  # B was not waiting behind A's backlog
    wait_for(lambda: not fair_leftovers(redis_client), 10, "no fair key left")


def test_a_per_key_limit_set_while_jobs_run_counts_the_jobs_already_in_flight(
        installed: Any, rec: redis.Redis, redis_client: redis.Redis,
        worker_factory: Factory) -> None:
    """A per-key limit written while jobs of the key run (a pool started with a release
    that declares it, beside pools whose release does not) admits no more jobs than
    the limit: the jobs fetched before it count. Pool A runs 4 jobs of key X with no
    limit in Redis; pool B starts and writes fair_max_concurrency=5: B takes 1 more,
    not 4."""
    held, queue = installed.held, installed.held.name
    options = {"pool": "threads", "concurrency": 4,
               "extra_args": ["--prefetch-multiplier", "1"]}
    worker_factory(APP, **options).start(timeout=60)
    assert redis_client.hdel(K.limits, f"{queue}\n") == 1  # as pool A's release has none
    for i in range(8):
        held.apply_async(("X", i))
    wait_for(lambda: len(order(rec, "fair:started")) == 4, 30, "pool A's 4 jobs running")
    worker_factory(APP, **options).start(timeout=60)  # writes the limit
    assert redis_client.hget(K.limits, f"{queue}\n") == b"5"
    try:
        wait_for(lambda: len(order(rec, "fair:started")) >= 5, 30, "pool B's first job")
        time.sleep(1.5)  # what pool B would take beyond the limit, it takes by now
        assert len(order(rec, "fair:started")) == 5
        assert redis_client.hget(K.running, f"{queue}\nX") == b"5"
    finally:
        rec.set("fair:open", 1)
    wait_for(lambda: len(order(rec, "fair:started")) == 8, 30, "the other 3 jobs")
    wait_for(lambda: not fair_leftovers(redis_client), 10, "no count left")


# -- in-process ------------------------------------------------------------------------------


def test_keys_are_cleaned_and_a_failing_fair_by_enqueues_unkeyed(
        broker_url: str, redis_client: redis.Redis, caplog: pytest.LogCaptureFixture) -> None:
    assert clean_key("tenant-7") == "tenant-7" and clean_key(7) == "7"
    assert clean_key(None) is None
    for bad in ("", 'a"b', "a\\b", "é", "x" * 129, "a\nb"):
        cleaned = clean_key(bad)
        assert cleaned is not None and cleaned.startswith("#") and len(cleaned) == 25
    assert clean_key("é") != clean_key("è")
    app = Celery("fair", broker=broker_url)
    try:
        @app.task(name="f", shared=False, fair_by=lambda a: {"k": 1}[a])
        def f(a: str) -> None: ...

        with caplog.at_level(logging.WARNING, logger="celery_ext.options.fair"):
            f.delay("nope")
        assert "fair_by of f raised KeyError" in caplog.text
        assert redis_client.llen(K.queue("celery")) == 1  # enqueued, unkeyed
        f.delay("k")
        assert redis_client.llen(K.fair_queue("celery", "1")) == 1
        @app.task(name="g", shared=False, fair_max_concurrency=0)
        def g() -> None: ...

        with pytest.raises(ValueError, match="task 'g' has fair_max_concurrency=0"):
            job_fair_limits(app)
        f.apply_async(("k",), fair_key='bad"key', priority=9)
        cleaned = clean_key('bad"key')
        assert cleaned is not None
        assert payload_fair_key(redis_client.lindex(K.fair_queue("celery", cleaned), 0)) \
            == cleaned
    finally:
        app.close()


def keyed(tag: str, key: str | None, priority: int = 0) -> bytes:
    props: dict[str, Any] = {"delivery_tag": tag, "priority": priority}
    if key is not None:
        props["fair_key"] = key
    return json.dumps({"headers": {"task": "t", "id": tag}, "properties": props}).encode()


def fetch(client: redis.Redis, pool_id: str, queue: str, n: int = 1) -> list[str]:
    """Fetch up to ``n`` jobs of ``queue`` into ``pool_id``'s record; their tags."""
    keys = K.fetch(pool_id, [queue] * n, STEPS)
    status, jobs, *_ = Scripts(client)("fetch", keys, [pool_id, "1" * n, *[queue] * n, 0])
    assert status == 1
    return [str(job[1].decode()) for job in jobs]


def test_every_move_keeps_the_key_and_readers_see_it(redis_client: redis.Redis) -> None:
    """Requeue, dead-set retry and promotion put a keyed job back into its key's
    sub-queue (the scripts read the key from the payload); a key at its limit is
    skipped by fetch without taking a slot; a dead job shows its key."""
    settings = Settings(dead_after=2.0, heartbeat_interval=1.0)
    pool = Heartbeater(redis_client, settings, "host:1:fair")
    pool.register()
    scripts = Scripts(redis_client)
    for tag, key in (("a1", "a"), ("a2", "a"), ("a3", "a"), ("b1", "b")):
        scripts("enqueue", [K.queue("q"), K.ready, K.queues],
                [keyed(tag, key), "q", K.wake_channel, 0])
    redis_client.hset(K.limits, "q\n", 1)
    # a1, then b1; a is at its limit: the queue is blocked, nothing else taken.
    assert fetch(redis_client, pool.pool_id, "q", 3) == ["a1", "b1"]
    assert redis_client.hget(K.running, "q\na") == b"1"
    record = InflightRecord(redis_client, K, pool.pool_id, STEPS)
    assert record.ack(["b1"]) == 1 and redis_client.hget(K.running, "q\nb") is None
    # Requeued: to the front of a's sub-queue; the limit is free again.
    assert record.requeue(["a1"]) == ["a1"]
    assert redis_client.lrange(K.fair_queue("q", "a"), 0, -1)[-1] == keyed("a1", "a")
    assert redis_client.hget(K.running, "q\na") is None
    assert fetch(redis_client, pool.pool_id, "q") == ["a1"]
    # Dead, then retried by hand: back to a's sub-queue, and the dead job showed its key.
    assert dead_letter(redis_client, settings, pool.pool_id, "a1", reason="failed", error="x")
    client = Client(redis_client, settings)
    assert [j["fair_key"] for j in client.dead()["items"]] == ["a"]
    assert client.retry_dead("a1")
    assert redis_client.lrange(K.fair_queue("q", "a"), 0, -1)[-1] != keyed("a2", "a")
    assert redis_client.llen(K.fair_queue("q", "a")) == 3
    # A scheduled keyed job is promoted into its key's sub-queue (its priority ignored).
    redis_client.zadd(K.scheduled, {"s1": 0})
    redis_client.hset(K.scheduled_jobs, "s1", b'{"priority": 6}\nq\n' + keyed("s1", "c", 6))
    assert Requeuer(redis_client, settings).promote().moved == 1
    assert redis_client.lrange(K.fair_queue("q", "c"), 0, -1) == [keyed("s1", "c", 6)]
    assert redis_client.lrange(K.fair_ring("q"), 0, -1) == [b"a", b"c"]


def test_cli_and_dashboard_show_active_keys_and_a_dead_jobs_key(
        broker_url: str, redis_client: redis.Redis) -> None:
    for i in range(5):
        redis_client.lpush(K.fair_queue("q", "big"), keyed(f"b{i}", "big"))
    redis_client.lpush(K.fair_queue("q", "small"), keyed("s", "small"))
    redis_client.rpush(K.fair_ring("q"), "small", "big")
    redis_client.sadd(K.queues, "q")
    assert dead_letter(redis_client, Settings(), "-", "d1", reason="failed", error="x",
                       fallback=b"q\n" + keyed("d1", "small"))
    out = celery_cli("-A", "tests.apps.proj", "ext", "queues", broker_url=broker_url)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[1].split()[-4:] == ["2", "keys:", "big=5", "small=1"]
    out = celery_cli("-A", "tests.apps.proj", "ext", "dead", "show", "d1", broker_url=broker_url)
    assert "fair_key        small" in out.stdout, out.stdout + out.stderr
    with warnings.catch_warnings():  # Starlette >= 1.x would rather use httpx2
        warnings.simplefilter("ignore")
        from starlette.testclient import TestClient
    with TestClient(create_app(Client(redis_client), sample_interval=0.2)) as api:
        queue = api.get("/api/queues").json()["items"][0]
        assert queue["size"] == 6
        assert queue["fair"] == {"active_keys": 2, "top_keys": [["big", 5], ["small", 1]],
                                 "rate_limit": None, "not_due": []}
        assert api.get("/api/dead").json()["items"][0]["fair_key"] == "small"
        assert "Fair key" in api.get("/dead/d1").text


def test_kombu_size_purge_and_delete_cover_sub_queues(
        broker_url: str, redis_client: redis.Redis) -> None:
    app = Celery("fair-purge", broker=broker_url, set_as_current=False)
    try:
        app.send_task("t", queue="q", fair_key="a")
        app.send_task("t", queue="q", fair_key="a")
        app.send_task("t", queue="q", fair_key="b")
        app.send_task("t", queue="q", priority=6)
        with app.connection_for_write() as conn:
            channel = conn.default_channel
            assert channel._size("q") == 4
            assert channel.queue_purge("q") == 4
            assert fair_leftovers(redis_client) == [] and not channel._has_queue("q")
            app.send_task("t", queue="q", fair_key="c")
            assert channel._has_queue("q")
            channel._delete("q", "", "q", "")
            assert fair_leftovers(redis_client) == [] and not channel._has_queue("q")
    finally:
        app.close()


def test_unique_job_goes_to_its_keys_sub_queue(broker_url: str,
                                               redis_client: redis.Redis) -> None:
    proj.configure(broker_url)
    from tests.apps import proj_sets

    proj_sets.unique_job.apply_async(("u",), fair_key="k")
    proj_sets.unique_job.apply_async(("u",), fair_key="k")  # pending: nothing enqueued
    assert redis_client.llen(K.fair_queue(proj_sets.unique_job.name, "k")) == 1
    assert redis_client.lrange(K.fair_ring(proj_sets.unique_job.name), 0, -1) == [b"k"]
