"""The job queue listing (issue 12): ``{ns}:queues`` holds job queues, not every name
ever pushed to, and reading a queue's latency does not ship its oldest job.

Against a real server and, where Kombu's remote control or a drain is involved, a
real ``celery worker`` (``tests.apps.proj``, with ``install(app)``).
"""

from __future__ import annotations

import json
from collections.abc import Callable

import pytest
import redis
from kombu import Connection

from celery_ext.client import Client
from celery_ext.config import DEFAULT_PRIORITY_STEPS, Settings
from celery_ext.store.dead_set import dead_letter
from celery_ext.store.keys import Keys
from celery_ext.store.scripts import Scripts
from tests.apps import proj
from tests.helpers import node_name, push, wait_for
from tests.workers import WorkerProcess

#: Nothing reads what this module's pools write at a warm stop: teardown SIGKILLs
#: them (worker_factory in tests/conftest.py).
pytestmark = pytest.mark.kill_workers_at_teardown

K = Keys("celery_ext")
Factory = Callable[..., WorkerProcess]


def listed(client: Client) -> set[str]:
    return {q["name"] for q in client.job_queues()}


def known(redis_client: redis.Redis) -> set[str]:
    return {n.decode() for n in redis_client.smembers(K.queues)}


def stamped(tag: str, enqueued_at: float, body_size: int = 10) -> str:
    """A job in our producers' byte layout, ``enqueued_at`` last."""
    return json.dumps({
        "body": "A" * body_size, "content-encoding": "utf-8",
        "content-type": "application/json", "headers": {"task": "t", "id": tag},
        "properties": {"correlation_id": tag, "delivery_info": {"exchange": "",
                                                                "routing_key": "q"},
                       "priority": 0, "body_encoding": "base64", "delivery_tag": tag,
                       "enqueued_at": enqueued_at}})


def test_remote_control_replies_are_not_job_queues(
        broker_url: str, redis_client: redis.Redis, worker_factory: Factory) -> None:
    """``celery inspect ping`` makes each worker push its reply into a Kombu reply
    queue (``<id>.reply.celery.pidbox``): that is not recorded as a job queue, and a
    reply queue name left in the set by an older version is dropped when read."""
    proj.configure(broker_url)
    worker = worker_factory("tests.apps.proj", pool="solo", concurrency=1).start()
    assert proj.add.delay(1, 2).get(timeout=15) == 3
    for _ in range(3):
        replies = proj.app.control.inspect(timeout=10, limit=1).ping() or {}
        assert replies.get(node_name(worker)) == {"ok": "pong"}, replies
    assert not [n for n in known(redis_client) if n.endswith(".pidbox")], known(redis_client)
    assert "tests.apps.proj.add" in known(redis_client)

    redis_client.sadd(K.queues, "0f3c.reply.celery.pidbox")  # as an older version left it
    push(redis_client, "1a2b.reply.celery.pidbox", stamped("r1", 1.0))  # an unread reply
    client = Client(redis_client)
    assert not [n for n in listed(client) if n.endswith(".pidbox")]
    assert not [n for n in known(redis_client) if n.endswith(".pidbox")]
    assert redis_client.llen(K.queue("1a2b.reply.celery.pidbox")) == 1  # only unlisted
    assert redis_client.sismember(K.ready, "1a2b.reply.celery.pidbox")


def test_drained_and_purged_queues_leave_the_listing_configured_ones_stay(
        broker_url: str, redis_client: redis.Redis, worker_factory: Factory) -> None:
    """A queue drained by a worker, once no live pool consumes it, and one purged with
    jobs in it are no longer listed (nor kept in the set); an empty queue that is
    paused, limited, weighted or consumed by a live worker pool stays; a pruned name
    comes back with its next job."""
    proj.configure(broker_url)
    worker = worker_factory("tests.apps.proj", pool="solo", concurrency=1, queues=["adhoc"])
    worker.start()
    result = proj.app.send_task("tests.apps.proj.add", (2, 3), queue="adhoc")
    assert result.get(timeout=15) == 5
    push(redis_client, "purged", stamped("d1", 1.0))
    with Connection(broker_url) as conn:
        assert conn.default_channel.queue_purge("purged") == 1  # as `celery purge` does
    for name in ("held", "capped", "weighted"):
        push(redis_client, name, stamped(f"x-{name}", 1.0))
        redis_client.delete(K.queue(name))  # emptied (as an expiring queue would be)
    client = Client(redis_client)
    client.pause("held")
    client.set_max_concurrency("capped", 2)
    redis_client.hset(K.weights, "weighted", 3)  # as a pool consuming it writes
    wait_for(lambda: not int(redis_client.hget(K.running, "adhoc") or 0), 5, "the ack")

    assert "adhoc" in listed(client)  # drained, but a live pool consumes it
    worker.stop()
    names = listed(client)
    assert {"held", "capped", "weighted"} <= names
    assert not names & {"adhoc", "purged"}, names
    assert not known(redis_client) & {"adhoc", "purged"}
    assert client.queue_count() == len(names)

    push(redis_client, "purged", stamped("p2", 1.0))  # back with its next job
    assert "purged" in listed(client)
    redis_client.delete(K.queue("purged"))  # gone without a fetch: still in the ready set
    assert "purged" not in listed(client)
    push(redis_client, "purged", stamped("p3", 1.0))
    assert "purged" in listed(client)


def test_latency_is_read_without_shipping_the_oldest_job(redis_client: redis.Redis) -> None:
    """A 500 kB job at the head of a queue: reading every queue's size and latency
    sends a few bytes per queue, not the job, and the latencies are right."""
    seconds, _ = redis_client.time()
    now = float(seconds)
    push(redis_client, "big", stamped("b1", now - 30, body_size=500_000))
    push(redis_client, "big", stamped("b2", now - 1))
    push(redis_client, "small", stamped("s1", now - 5))
    push(redis_client, "unstamped", json.dumps({"properties": {"delivery_tag": "u1"}}))
    push(redis_client, "empty", stamped("e1", now))
    redis_client.delete(K.queue("empty"))
    redis_client.hset(K.weights, "empty", 1)  # stays listed, empty
    client = Client(redis_client)

    before = redis_client.info("stats")["total_net_output_bytes"]
    queues = {q["name"]: q for q in client.job_queues()}
    shipped = redis_client.info("stats")["total_net_output_bytes"] - before
    assert shipped < 20_000, f"{shipped:,} bytes left Redis to read queue latencies"

    assert (queues["big"]["size"], queues["small"]["size"]) == (2, 1)
    assert 29 <= queues["big"]["latency"] <= 35  # type: ignore[operator]
    assert 4 <= queues["small"]["latency"] <= 10  # type: ignore[operator]
    assert queues["unstamped"]["latency"] is None
    assert (queues["empty"]["size"], queues["empty"]["latency"]) == (0, 0.0)
    page = client.job_queues(offset=1, limit=2)
    assert [q["name"] for q in page] == ["empty", "small"]


def test_a_manually_retried_dead_job_counts_as_enqueued_at_its_retry(
        redis_client: redis.Redis) -> None:
    """A job dead for an hour and retried from the dead set goes to the front of its
    queue: its queue's latency counts from the retry, not from its first enqueue."""
    seconds, _ = redis_client.time()
    push(redis_client, "retried", stamped("old-1", float(seconds) - 3600))
    keys = K.fetch("p", ["retried"], DEFAULT_PRIORITY_STEPS)
    redis_client.zadd(K.pools, {"p": 1})
    Scripts(redis_client)("fetch", keys, ["p", "1", "retried", 0])
    assert dead_letter(redis_client, Settings(), "p", "old-1", reason="failed", error="x")
    client = Client(redis_client)
    assert client.retry_dead("old-1")
    queue = next(q for q in client.job_queues() if q["name"] == "retried")
    assert queue["size"] == 1 and queue["latency"] is not None and queue["latency"] < 5, queue
