"""AckSender: acks written without waiting for their replies, resent when they failed."""

from __future__ import annotations

import redis

from celery_ext import scripts
from celery_ext.acks import MAX_UNREAD, AckSender
from celery_ext.keys import Keys

K = Keys("celery_ext")
POOL = "pool-acks"


def _fill(client: redis.Redis, tags: list[str]) -> None:
    for tag in tags:
        client.hset(K.inflight(POOL), tag, "q\n{}")
        client.hincrby(K.running, "q", 1)


def _send(sender: AckSender, tags: list[str]) -> None:
    sender.ack([K.inflight(POOL), K.redelivery, K.running, K.limits, K.ready, K.job_index,
                K.job_index_done], [K.wake_channel, 0, *tags], tags)


def test_acks_apply_without_waiting_and_close_reads_every_reply(
        redis_client: redis.Redis) -> None:
    scripts.Scripts(redis_client).load_all()
    tags = [f"t{i}" for i in range(3 * MAX_UNREAD)]
    _fill(redis_client, tags)
    resent: list[str] = []
    sender = AckSender(redis_client.connection_pool, resent.extend)
    for tag in tags:
        _send(sender, [tag])
    assert len(sender._unread) <= MAX_UNREAD  # replies are read as they pile up
    sender.close()
    assert not sender._unread and resent == []
    assert redis_client.hlen(K.inflight(POOL)) == 0
    assert int(redis_client.hget(K.running, "q") or 0) == 0


def test_failed_acks_go_to_the_fallback(redis_client: redis.Redis) -> None:
    _fill(redis_client, ["a", "b", "c"])
    resent: list[str] = []
    sender = AckSender(redis_client.connection_pool, resent.extend)
    redis_client.script_flush()
    _send(sender, ["a"])  # NOSCRIPT: its reply is an error, read at close
    sender.close()
    assert resent == ["a"]
    scripts.Scripts(redis_client).load_all()
    _send(sender, ["b"])  # a new connection after close
    conn = sender._conn
    assert conn is not None
    conn._sock.close()  # the connection breaks before the reply is read
    _send(sender, ["c"])
    sender.close()
    # "b" may or may not have been applied: it is resent with "c" (acks are idempotent).
    assert sorted(resent) == ["a", "b", "c"]
