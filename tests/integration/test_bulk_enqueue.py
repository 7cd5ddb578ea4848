"""Bulk publishing (``producer/bulk.py``) against a real server and real workers: a group
under ``install(app)``, ``apply_many`` and ``celery_ext.bulk`` write their jobs
``BULK_PIPELINE_SIZE`` per round trip, and every promise of a single publish holds.

How many round trips a bulk makes is read by counting the calls of ``Enqueuer.write``,
the one method every job is written through (a spy: the real method runs)."""

from __future__ import annotations

import base64
import json
from collections.abc import Callable
from typing import Any

import pytest
import redis
from celery import Celery, group
from celery.signals import after_task_publish, before_task_publish
from kombu import Connection, Queue

import celery_ext
from celery_ext.config import BULK_PIPELINE_SIZE, DEFAULT_PRIORITY_STEPS
from celery_ext.options.priority import level as priority_level
from celery_ext.producer.publish import Enqueuer
from celery_ext.store import scripts
from celery_ext.store.compact import unpack
from celery_ext.store.keys import Keys
from celery_ext.testing.node import RedisServer
from tests.apps import proj, proj_bulk
from tests.faults.proxy import Proxy
from tests.helpers import wait_for
from tests.integration import test_publish_retry as publish_retry
from tests.workers import WorkerProcess

#: Nothing reads what this module's pools write at a warm stop: teardown SIGKILLs
#: them (worker_factory in tests/conftest.py).
pytestmark = pytest.mark.kill_workers_at_teardown

K = Keys("celery_ext")
TALLY = "tests.apps.proj_bulk.tally"


@pytest.fixture
def writes(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The size of each round trip of ``Enqueuer.write`` made during the test."""
    sizes: list[int] = []
    real = getattr(Enqueuer, "write", None)

    def write(self: Enqueuer, batch: Any, **kwargs: Any) -> list[Any]:
        sizes.append(len(batch))
        assert real is not None
        return real(self, batch, **kwargs)

    monkeypatch.setattr(Enqueuer, "write", write, raising=False)
    return sizes


def runs(rec: redis.Redis, key: str) -> dict[str, int]:
    return {k.decode(): int(v) for k, v in rec.hgetall(f"bulk:{key}").items()}


def drained(rec: redis.Redis, key: str, n: int) -> Callable[[], bool]:
    return lambda: rec.hlen(f"bulk:{key}") >= n


def test_a_group_of_10000_is_written_in_bounded_round_trips_and_each_job_runs_once(
        broker_url: str, rec: redis.Redis, redis_client: redis.Redis, writes: list[int],
        worker_factory: Callable[..., WorkerProcess]) -> None:
    proj.configure(broker_url)
    rec.delete("bulk:group")
    n = 10_000
    result = group(proj_bulk.tally.s("group", i) for i in range(n)).apply_async()
    assert writes == [BULK_PIPELINE_SIZE] * (n // BULK_PIPELINE_SIZE)
    assert redis_client.llen(K.queue(TALLY)) == n
    ids = [r.id for r in result.results]
    assert len(set(ids)) == n
    stored = [json.loads(p)["headers"]["id"] for p in redis_client.lrange(K.queue(TALLY), 0, -1)]
    assert sorted(stored) == sorted(ids)  # the results name the jobs written
    worker_factory("tests.apps.proj_bulk", pool="threads", concurrency=8).start()
    wait_for(drained(rec, "group", n), 240, "the group's jobs to run")
    assert runs(rec, "group") == {str(i): 1 for i in range(n)}


def test_apply_many_keeps_priority_fair_keys_unique_and_countdown(
        broker_url: str, rec: redis.Redis, redis_client: redis.Redis, writes: list[int],
        worker_factory: Callable[..., WorkerProcess]) -> None:
    proj.configure(broker_url)
    rec.delete("bulk:opts")
    tally_results = proj_bulk.tally.apply_many([("opts", i) for i in range(2500)], priority=9)
    assert writes == [1000, 1000, 500]
    urgent = K.queue_level(TALLY, priority_level(9, DEFAULT_PRIORITY_STEPS))
    assert urgent != K.queue(TALLY) and redis_client.llen(urgent) == 2500
    assert [r.id for r in tally_results] == [  # in order: pushed at the head, popped at the tail
        json.loads(p)["headers"]["id"] for p in redis_client.lrange(urgent, 0, -1)][::-1]

    fair = "tests.apps.proj_bulk.tenant_tally"
    celery_ext.apply_many(proj_bulk.tenant_tally,
                          [{"key": "opts", "tenant": t, "i": i} for t in "ab" for i in range(3)])
    assert redis_client.llen(K.fair_queue(fair, "a")) == 3
    assert redis_client.llen(K.fair_queue(fair, "b")) == 3

    unique = proj_bulk.unique_tally.apply_many(
        [("opts", "u1"), ("opts", "u2"), ("opts", "u1"), ("opts", "u2"), ("opts", "u3")])
    assert [r.id for r in unique][2:4] == [unique[0].id, unique[1].id]  # the pending jobs
    assert len({r.id for r in unique}) == 3
    assert redis_client.llen(K.queue("tests.apps.proj_bulk.unique_tally")) == 3

    later = proj_bulk.tally.apply_many([("later", i) for i in range(1500)], countdown=600)
    assert redis_client.zcard(K.scheduled) == 1500
    assert redis_client.hlen(K.scheduled_jobs) == 1500
    assert len(later) == 1500 and redis_client.llen(K.queue(TALLY)) == 0

    worker_factory("tests.apps.proj_bulk", pool="threads", concurrency=8).start()
    wait_for(drained(rec, "opts", 2500 + 6 + 3), 120, "the jobs to run")
    done = runs(rec, "opts")
    assert set(done.values()) == {1} and len(done) == 2509
    assert {k for k in done if k.startswith("u")} == {"u1", "u2", "u3"}


def test_publish_signals_fire_once_per_message_in_a_bulk(
        broker_url: str, redis_client: redis.Redis, writes: list[int]) -> None:
    proj.configure(broker_url)
    before: list[str] = []
    after: list[str] = []

    def on_before(headers: Any = None, **kw: Any) -> None:
        before.append(headers["id"])

    def on_after(headers: Any = None, **kw: Any) -> None:
        after.append(headers["id"])

    before_task_publish.connect(on_before, weak=False)
    after_task_publish.connect(on_after, weak=False)
    try:
        with celery_ext.bulk(proj.app):
            results = [proj_bulk.tally.delay("signals", i) for i in range(1200)]
            results.append(proj_bulk.tally.apply_async(("signals", -1), countdown=60))
            assert writes == [1000]  # the first round trip is full; the rest wait
    finally:
        before_task_publish.disconnect(on_before)
        after_task_publish.disconnect(on_after)
    assert writes == [1000, 201]
    ids = [r.id for r in results]
    assert before == ids and after == ids
    assert redis_client.llen(K.queue(TALLY)) == 1200
    assert redis_client.zcard(K.scheduled) == 1


#: A proxy in front of the session server (test_publish_retry's fixture).
proxy = publish_retry.proxy


def _bulk_through(proxy: Proxy, rec: redis.Redis, redis_client: redis.Redis,
                  writes: list[int], tag: str) -> str:
    """The app's broker behind ``proxy``, connected and its scripts loaded, with the job
    queue, the tally of ``tag`` and the recorded writes empty; returns the broker URL."""
    url = f"celery-ext://127.0.0.1:{proxy.port}/0"
    proj.configure(url)
    rec.delete(f"bulk:{tag}")
    proj_bulk.tally.delay("warm-up", 0)  # connected, scripts loaded
    redis_client.delete(K.queue(TALLY))
    writes.clear()
    return url


def _stored_once_and_run_once(rec: redis.Redis, redis_client: redis.Redis,
                              worker_factory: Callable[..., WorkerProcess], url: str,
                              tag: str, jobs: int, results: list[Any]) -> None:
    """Each of the bulk's ``jobs`` is stored once (the ids ``apply_many`` returned, no
    other), and a worker then runs each one once."""
    stored = [json.loads(p)["headers"]["id"] for p in redis_client.lrange(K.queue(TALLY), 0, -1)]
    assert len(stored) == jobs and set(stored) == {r.id for r in results}
    worker_factory("tests.apps.proj_bulk", broker_url=url, pool="threads",
                   concurrency=8).start()
    wait_for(drained(rec, tag, jobs), 120, "the jobs to run")
    assert runs(rec, tag) == {str(i): 1 for i in range(jobs)}


def test_a_reply_lost_inside_a_round_trip_mid_bulk_loses_and_duplicates_nothing(
        proxy: Proxy, rec: redis.Redis, redis_client: redis.Redis, writes: list[int],
        worker_factory: Callable[..., WorkerProcess]) -> None:
    url = _bulk_through(proxy, rec, redis_client, writes, "cut")
    # The reply of the round trip carrying job 1500 (the second of three) is lost.
    proxy.cut_on_reply(b"('cut', 1500)")  # (its argsrepr header)
    results = proj_bulk.tally.apply_many([("cut", i) for i in range(3000)])
    assert proxy.replies_cut == 1
    # Three round trips; the second's reply was lost and the same jobs were sent again
    # (through the client: the kept connection failed), the written ones no-ops.
    assert writes == [1000, 1000, 1000]
    _stored_once_and_run_once(rec, redis_client, worker_factory, url, "cut", 3000, results)


def test_a_kombu_publish_batch_whose_reply_was_lost_writes_each_message_once(
        proxy: Proxy, redis_client: redis.Redis) -> None:
    """Kombu's ``Producer.batch()`` is a bulk: its messages carry publish markers, and a
    flush whose reply was lost is sent again (Kombu's own batch raises
    ``BatchPublishError``, "delivery is uncertain", and its messages have no marker)."""
    url = f"celery-ext://127.0.0.1:{proxy.port}/0"
    with Connection(url) as conn:
        channel = conn.default_channel
        Queue("batched")(channel).declare()
        producer = conn.Producer()
        producer.publish({"n": -1}, routing_key="batched")  # connected, scripts loaded
        redis_client.delete(K.queue("batched"))
        proxy.cut_on_reply(scripts.sha("enqueue").encode())
        with producer.batch(max_size=100):
            for i in range(250):
                producer.publish({"n": i}, routing_key="batched")
    assert proxy.replies_cut == 1
    bodies = sorted(json.loads(base64.b64decode(unpack(p, "batched")["body"]))["n"]
                    for p in redis_client.lrange(K.queue("batched"), 0, -1))
    assert bodies == list(range(250))


def test_drop_in_bulk_writes_in_round_trips_and_a_group_publishes_as_before(
        broker_url: str, rec: redis.Redis, redis_client: redis.Redis, writes: list[int],
        worker_factory: Callable[..., WorkerProcess]) -> None:
    """Without ``install(app)`` a group publishes one job per round trip, as stock Celery
    does; inside ``celery_ext.bulk`` (the transport buffers) in round trips of 1,000."""
    app = Celery("dropin_bulk", broker=broker_url, set_as_current=False)
    app.conf.task_routes = {TALLY: {"queue": TALLY}}
    rec.delete("bulk:dropin")
    try:
        group(app.signature(TALLY, ("dropin", i)) for i in range(5)).apply_async()
        assert writes == [1] * 5
        with celery_ext.bulk(app):
            group(app.signature(TALLY, ("dropin", i)) for i in range(5, 2005)).apply_async()
        assert writes == [1] * 5 + [1000, 1000]
    finally:
        app.close()
    assert redis_client.llen(K.queue(TALLY)) == 2005
    worker_factory("tests.apps.proj_bulk", pool="threads", concurrency=8).start()
    wait_for(drained(rec, "dropin", 2005), 120, "the jobs to run")
    assert runs(rec, "dropin") == {str(i): 1 for i in range(2005)}


def test_unique_until_finished_and_debounce_in_a_bulk(
        broker_url: str, rec: redis.Redis, redis_client: redis.Redis, writes: list[int],
        worker_factory: Callable[..., WorkerProcess]) -> None:
    """In one bulk: a job locked until finished is published once per key (the others'
    results name it), and debounced publishes of one key leave one job, the latest."""
    from tests.apps import proj_unique

    proj.configure(broker_url)
    rec.delete("runs:bk1", "runs:bk2", "runs:bdeb", "start:bk1", "start:bk2")
    with celery_ext.bulk(proj.app):
        held = [proj_unique.held.delay(key) for key in ("bk1", "bk1", "bk2", "bk1")]
        debounced = [proj_unique.debounced.delay("bdeb", n) for n in (1, 2, 3)]
    assert writes == [7]
    assert [r.id for r in held] == [held[0].id, held[0].id, held[2].id, held[0].id]
    assert redis_client.llen(K.queue("tests.apps.proj_unique.held")) == 2
    assert redis_client.zcard(K.scheduled) == 1  # the debounced job: the latest replaced the others
    assert len({r.id for r in debounced}) == 3
    worker_factory("tests.apps.proj_unique", pool="solo", concurrency=1).start()
    wait_for(lambda: rec.llen("runs:bk1") and rec.llen("runs:bk2") and rec.llen("runs:bdeb"),
             30, "the jobs to run")
    assert [r.decode().split(":")[1] for r in rec.lrange("runs:bk1", 0, -1)] == [held[0].id]
    assert [r.decode().split(":")[1] for r in rec.lrange("runs:bk2", 0, -1)] == [held[2].id]
    assert rec.lrange("runs:bdeb", 0, -1) == [b"3"]


#: A primary and one replica in sync (test_publish_retry's fixture, used here too).
replicated = publish_retry.replicated


def test_wait_replicas_waits_once_per_round_trip_of_a_bulk(
        replicated: tuple[RedisServer, RedisServer]) -> None:
    """With ``wait_replicas=1`` each round trip of a bulk ends with one ``WAIT``: when
    ``apply_many`` returns, the replica has every job."""
    primary, replica = replicated
    app = Celery("bulk_replicated", broker=primary.url(scheme="celery-ext"),
                 set_as_current=False)
    app.conf.broker_transport_options = {"wait_replicas": 1, "wait_timeout_ms": 2000}
    app.conf.task_ignore_result = True
    celery_ext.install(app)

    @app.task(name="bulk.replicated", shared=False)
    def plain(n: int) -> None: ...

    with primary.client() as p:
        p.config_resetstat()
    try:
        plain.apply_many([(i,) for i in range(2500)])
    finally:
        app.close()
    with primary.client() as p, replica.client() as r:
        assert r.llen(K.queue("bulk.replicated")) == 2500
        assert p.info("commandstats")["cmdstat_wait"]["calls"] == 3


def test_apply_many_retries_its_round_trips_under_the_calls_retry_options(
        proxy: Proxy, redis_client: redis.Redis, writes: list[int]) -> None:
    """``retry`` and ``retry_policy`` given to ``apply_many`` are its round trips' policy
    (over the app's), as a single publish's are its write's: with ``max_retries=1`` a
    round trip whose replies never come is sent twice, then the call raises; with
    ``retry=False`` once."""
    url = f"celery-ext://127.0.0.1:{proxy.port}/0"
    proj.configure(url)
    proj_bulk.tally.delay("warm-up", 0)  # connected, scripts loaded
    redis_client.delete(K.queue(TALLY))
    writes.clear()
    proxy.cut_on_reply(b"('policy', 0)", times=100)
    try:
        with pytest.raises(redis.exceptions.ConnectionError):
            proj_bulk.tally.apply_many([("policy", 0)], retry_policy={
                "max_retries": 1, "interval_start": 0, "interval_step": 0})
        assert writes == [1, 1]
        writes.clear()
        with pytest.raises(redis.exceptions.ConnectionError):
            proj_bulk.tally.apply_many([("policy", 0)], retry=False)
        assert writes == [1]
    finally:
        proxy.disarm()
    # Every attempt reached Redis, and its marker kept each call's job single.
    assert redis_client.llen(K.queue(TALLY)) == 2


def test_a_round_trip_in_flight_whose_replies_never_come_is_sent_again_whole(
        proxy: Proxy, rec: redis.Redis, redis_client: redis.Redis, writes: list[int],
        worker_factory: Callable[..., WorkerProcess]) -> None:
    """``apply_many`` sends a full round trip and builds the next while Redis runs it.
    When the replies of the one in flight are lost, and those of its resend through the
    channel's client too, the bulk sends it again under its retry policy: each job is
    stored once."""
    url = _bulk_through(proxy, rec, redis_client, writes, "flight")
    proxy.cut_on_reply(b"('flight', 500)", times=2)  # the first round trip, twice
    results = proj_bulk.tally.apply_many([("flight", i) for i in range(2500)])
    assert proxy.replies_cut == 2
    assert writes[0] == 1000 and sorted(writes) == [500, 1000, 1000, 1000]
    _stored_once_and_run_once(rec, redis_client, worker_factory, url, "flight", 2500, results)
