"""The producer's short path (``apply_async`` at a fraction of Kombu's cost) keeps every
promise of the long one: the job written once, its properties and headers as Kombu
would send them, the publish signals, and a fallback when the kept connection is busy
or broken."""

from __future__ import annotations

import base64
import json
import sys
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from celery import Celery
from celery.signals import after_task_publish, before_task_publish
from kombu import Connection

import celery_ext
from celery_ext.producer.publish import Producer, Producers
from celery_ext.producer.publish_line import NOT_SENT
from celery_ext.store.compact import unpack
from celery_ext.store.keys import Keys
from celery_ext.store.scripts import pack_evalsha

K = Keys("celery_ext")


@pytest.mark.parametrize("args", [
    ["payload", "queue", 0],
    ["ünïcode ✓", b"\x00raw\r\nbytes", 12345678901234, -1],
    [],
])
def test_pack_evalsha_matches_redis_py(args: list[Any]) -> None:
    keys = ["{celery_ext}:queue:a", "{celery_ext}:ready"]
    conn = redis.Connection()
    expected = b"".join(conn.pack_command("EVALSHA", "f" * 40, len(keys), *keys, *args))
    assert pack_evalsha("f" * 40, keys, args) == expected


def test_pack_evalsha_refuses_what_redis_py_refuses() -> None:
    with pytest.raises(redis.exceptions.DataError):
        pack_evalsha("f" * 40, [], [None])
    with pytest.raises(redis.exceptions.DataError):
        pack_evalsha("f" * 40, [], [True])


def _stored(client: redis.Redis, queue: str) -> list[dict[str, Any]]:
    return [unpack(raw, queue) for raw in client.lrange(K.queue(queue), 0, -1)]


def test_a_busy_or_broken_kept_connection_falls_back_to_the_client(
        broker_url: str, redis_client: redis.Redis) -> None:
    with Connection(broker_url) as conn:
        channel = conn.default_channel
        producer = conn.Producer()
        producer.publish({"n": 1}, routing_key="fallback_q", retry=True)
        line = channel.enqueuer._line
        kept = line._conn
        assert kept is not None and kept._sock is not None  # the first write used it

        # Another thread holds it: this publish goes through the channel's client.
        assert line._lock.acquire()
        try:
            assert line.send([]) is NOT_SENT
            producer.publish({"n": 2}, routing_key="fallback_q", retry=True)
        finally:
            line._lock.release()

        # Its socket dies under it: the write goes through the client (no publish retry
        # here: the fallback, not Kombu, saves it), the next one through the same
        # connection object, reconnected.
        kept._sock.shutdown(2)
        producer.publish({"n": 3}, routing_key="fallback_q", retry=False)
        producer.publish({"n": 4}, routing_key="fallback_q", retry=True)
        assert line._conn is kept and kept._sock is not None
    bodies = [json.loads(base64.b64decode(m["body"]))
              for m in reversed(_stored(redis_client, "fallback_q"))]
    assert bodies == [{"n": 1}, {"n": 2}, {"n": 3}, {"n": 4}]  # each once, in order


@pytest.fixture
def app(broker_url: str) -> Iterator[Celery]:
    app = Celery("enqueue_path", broker=broker_url, set_as_current=False)
    app.conf.update(broker_connection_retry_on_startup=True, task_ignore_result=True)

    @app.task(name="enqueue_path.job", shared=False)
    def job(x: int) -> int:
        return x

    celery_ext.install(app)
    try:
        yield app
    finally:
        app.close()


def test_install_publishes_through_kept_producers_with_kombus_message(
        app: Celery, redis_client: redis.Redis) -> None:
    pool = app.amqp.producer_pool
    assert isinstance(pool, Producers)
    seen: list[tuple[str, Any]] = []

    def before(sender: Any = None, routing_key: Any = None, headers: Any = None,
               **kw: Any) -> None:
        seen.append(("before", (sender, routing_key, headers["id"])))

    def after(sender: Any = None, routing_key: Any = None, headers: Any = None,
              **kw: Any) -> None:
        seen.append(("after", (sender, routing_key, headers["id"])))

    before_task_publish.connect(before, weak=False)
    after_task_publish.connect(after, weak=False)
    try:
        job = app.tasks["enqueue_path.job"]
        results = [job.apply_async((i,), priority=i % 3, headers={"custom": "h"},
                                   compression="zlib" if i == 4 else None)
                   for i in range(5)]
        with pool.acquire(block=True) as p1:
            channel, connection = p1._channel, p1.__connection__
        with pool.acquire(block=True) as p2:
            # A released producer keeps its connection and channel (not re-bound).
            assert p2 is p1 and p2._channel is channel and p2.__connection__ is connection
            assert isinstance(p2, Producer)
    finally:
        before_task_publish.disconnect(before)
        after_task_publish.disconnect(after)
    ids = [r.id for r in results]
    assert seen == [(when, ("enqueue_path.job", "enqueue_path.job", i))
                    for i in ids for when in ("before", "after")]
    stored = list(reversed(_stored(redis_client, "enqueue_path.job")))
    assert [m["headers"]["id"] for m in stored] == ids  # each job once
    for i, m in enumerate(stored):
        props = m["properties"]
        assert props["priority"] == i % 3  # the message's priority reaches the transport
        assert props["delivery_info"] == {"exchange": "", "routing_key": "enqueue_path.job"}
        assert props["delivery_mode"] == 2 and props["body_encoding"] == "base64"
        assert m["headers"]["custom"] == "h"
        assert m["content-type"] == "application/json"
        assert ("compression" in m["headers"]) == (i == 4)
        assert "celery_ext_publish_id" not in props


def test_producers_of_several_threads_each_write_their_jobs(app: Celery,
                                                            redis_client: redis.Redis) -> None:
    job = app.tasks["enqueue_path.job"]
    ids: list[str] = []
    lock = threading.Lock()

    def send() -> None:
        for i in range(30):
            r = job.apply_async((i,))
            with lock:
                ids.append(r.id)

    threads = [threading.Thread(target=send) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    stored = [m["headers"]["id"] for m in _stored(redis_client, "enqueue_path.job")]
    assert len(ids) == 120 and sorted(stored) == sorted(ids)


def test_a_kept_producer_whose_channel_closed_gets_a_new_one(
        app: Celery, redis_client: redis.Redis) -> None:
    job = app.tasks["enqueue_path.job"]
    first = job.apply_async((1,))
    with app.amqp.producer_pool.acquire(block=True) as p:
        old = p.channel
        old.close()  # (as a failed or closed connection closes it)
    second = job.apply_async((2,))
    with app.amqp.producer_pool.acquire(block=True) as p:
        assert p.channel is not old and p.channel.connection is not None
    stored = [m["headers"]["id"] for m in _stored(redis_client, "enqueue_path.job")]
    assert stored == [second.id, first.id]


def test_apps_on_one_url_do_not_starve_each_other_of_connections(
        broker_url: str, redis_client: redis.Redis) -> None:
    """Kept producers hold connections of their pool's own connection pool: two apps
    on the same URL, each past its limit of 2 producers, both publish."""
    apps = []
    for name in ("starve_a", "starve_b"):
        a = Celery(name, broker=broker_url, set_as_current=False)
        a.conf.update(broker_pool_limit=2, task_ignore_result=True)

        def job() -> None:
            return None

        a.task(name=f"{name}.job", shared=False)(job)
        apps.append(celery_ext.install(a))
    done: list[str] = []

    def send(a: Celery, name: str) -> None:
        held = [a.amqp.producer_pool.acquire(block=True) for _ in range(2)]
        for p in held:
            p.release()
        for _ in range(3):
            done.append(a.tasks[f"{name}.job"].apply_async().id)

    try:
        for a, name in zip(apps, ("starve_a", "starve_b"), strict=True):
            t = threading.Thread(target=send, args=(a, name), daemon=True)
            t.start()
            t.join(20)
            assert not t.is_alive(), f"{name} waits for a connection"
    finally:
        for a in apps:
            a.close()
    assert len(done) == 6
    assert redis_client.llen(K.queue("starve_a.job")) == 3
    assert redis_client.llen(K.queue("starve_b.job")) == 3


def test_a_job_is_stored_compact_and_fetched_as_celery_sent_it(
        app: Celery, broker_url: str, redis_client: redis.Redis) -> None:
    """The memory per queued job (issue 36): a job's message is stored compact
    (``store/compact.py``: about 340 bytes here, 950 whole), and
    the fetch hands Kombu the message Celery sent, headers, properties and body."""
    sent: dict[str, tuple[dict[str, Any], Any]] = {}

    def before(headers: Any = None, body: Any = None, **kw: Any) -> None:
        sent[headers["id"]] = (dict(headers), json.loads(json.dumps(body)))

    before_task_publish.connect(before, weak=False)
    try:
        job = app.tasks["enqueue_path.job"]
        plain = job.apply_async((0,))
        rich = job.apply_async((), {"x": "h\u00e9llo \u2603 \"q\""}, countdown=0,
                               priority=3, headers={"custom": ["h", None]},
                               link=job.si(2), group_id="g-1", group_index=2, shadow="nick")
    finally:
        before_task_publish.disconnect(before)
    stored = {unpack(raw, "enqueue_path.job")["headers"]["id"]: raw
              for raw in redis_client.lrange(K.queue("enqueue_path.job"), 0, -1)}
    stored.update({unpack(raw, "enqueue_path.job")["headers"]["id"]: raw
                   for raw in redis_client.lrange(K.queue_level("enqueue_path.job", 3), 0, -1)})
    assert len(stored[plain.id]) < 400
    assert len(json.dumps(unpack(stored[plain.id], "enqueue_path.job"))) > 900
    with Connection(broker_url) as conn:
        queue = conn.SimpleQueue("enqueue_path.job", no_ack=True)
        got = {}
        for _ in range(2):
            message = queue.get(timeout=10)
            got[message.headers["id"]] = message
        queue.close()
    for task_id in (plain.id, rich.id):
        headers, body = sent[task_id]
        message = got[task_id]
        assert message.headers == headers
        assert json.loads(message.body) == body
        assert message.properties["correlation_id"] == task_id
        assert message.delivery_info["routing_key"] == "enqueue_path.job"
        assert message.content_type == "application/json"
    assert got[rich.id].properties["priority"] == 3


def test_a_publish_runs_no_import_statement(app: Celery) -> None:
    """Nothing on the publish path imports per call: an ``import`` inside a function
    runs Python's import machinery each time (the fair-key handler of
    ``before_task_publish`` did, once per ``apply_async``: 10 calls here before)."""
    job = app.tasks["enqueue_path.job"]
    job.apply_async((0,))
    calls: list[str] = []

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event == "call" and "importlib" in frame.f_code.co_filename:
            calls.append(f"{frame.f_back.f_code.co_filename}:{frame.f_back.f_code.co_name}")

    sys.setprofile(profile)
    try:
        for i in range(10):
            job.apply_async((i,))
    finally:
        sys.setprofile(None)
    assert calls == []
