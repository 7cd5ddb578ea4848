"""Large jobs at fetch (issue 12): the fetch script's cost does not grow with the
payload beyond moving it, and a job over ``max_payload_bytes`` found in a job queue
(an old producer, another client, a limit lowered since) goes to the dead set
without being shipped to the worker, while everything else keeps running.

Costs are Redis-side (``INFO commandstats``), compared with a bare script that does
only what any fetch must do with the same bytes, so the check holds on a slow or
busy machine: the old fetch scanned the whole payload for the delivery tag and cost
about six times that bare move for 0.9 MB jobs.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable

import pytest
import redis
from kombu import Connection

from celery_ext.client import Client
from celery_ext.config import DEFAULT_PRIORITY_STEPS
from celery_ext.store.keys import Keys
from celery_ext.store.scripts import Scripts
from celery_ext.testing.server import RedisServer
from celery_ext.transport.fetch import Fetcher
from tests.apps import proj
from tests.helpers import only_pool, push, wait_for
from tests.workers import READY_PATTERN, WorkerProcess

#: Nothing reads what this module's pools write at a warm stop: teardown SIGKILLs
#: them (worker_factory in tests/conftest.py).
pytestmark = pytest.mark.kill_workers_at_teardown

K = Keys("celery_ext")
Factory = Callable[..., WorkerProcess]
POOL = "large-pool"
QUEUE = "tests.apps.proj.add"

#: The moves every fetch makes with a job's bytes (pop it, record it in flight, reply
#: with it), and nothing else: the yardstick for the fetch script's cost.
BARE_MOVE = """
local jobs = {}
for i = 1, tonumber(ARGV[1]) do
  local payload = redis.call('RPOP', KEYS[1])
  redis.call('HSETNX', KEYS[2], 'tag-' .. i, 'q\\n' .. payload)
  jobs[i] = payload
end
return jobs
"""


def message(tag: str, body_size: int) -> str:
    """A job in the byte layout Kombu and our producers write (properties last, the
    delivery tag then ``enqueued_at`` at the very end)."""
    return json.dumps({
        "body": "A" * body_size, "content-encoding": "utf-8",
        "content-type": "application/json",
        "headers": {"task": QUEUE, "id": f"id-{tag}", "delivery_tag": "a-header-not-the-tag"},
        "properties": {"correlation_id": f"id-{tag}", "reply_to": "", "delivery_mode": 2,
                       "delivery_info": {"exchange": "", "routing_key": "q"}, "priority": 0,
                       "body_encoding": "base64", "delivery_tag": tag,
                       "enqueued_at": 1795383625.41}})


def fetch_keys(n: int) -> list[str]:
    return K.fetch(POOL, ["q"] * n, DEFAULT_PRIORITY_STEPS)


def script_usec(client: redis.Redis, command: str) -> int:
    return int(client.info("commandstats")[f"cmdstat_{command}"]["usec"])


def fill(client: redis.Redis, n: int, body_size: int, round_: int) -> None:
    client.flushdb()
    client.zadd(K.pools, {POOL: 1})
    scripts = Scripts(client)
    for i in range(n):
        scripts("enqueue", [K.queue("q"), K.ready, K.queues],
                [message(f"t{round_}-{i}", body_size), "q", K.wake_channel, 0])
    client.config_resetstat()


def test_fetch_cost_does_not_grow_with_the_payload_beyond_moving_it(
        redis_client: redis.Redis) -> None:
    """16 jobs of 0.9 MB in one fetch: Redis spends no more than twice what the bare
    moves of those bytes cost (the old whole-payload tag scan: about six times), and
    each job's own delivery tag is still found (not the header of the same name)."""
    n, big = 16, 900_000
    scripts = Scripts(redis_client)
    fetch_big, fetch_small, bare_big = [], [], []
    for round_ in range(3):  # the minimum of three: a busy machine only adds time
        fill(redis_client, n, big, round_)
        jobs = scripts("fetch", fetch_keys(n), [POOL, "1" * n, *["q"] * n, 0])[1]
        assert [j[1].decode() for j in jobs] == [f"t{round_}-{i}" for i in range(n)]
        fetch_big.append(script_usec(redis_client, "evalsha"))

        fill(redis_client, n, 1000, round_)
        scripts("fetch", fetch_keys(n), [POOL, "1" * n, *["q"] * n, 0])
        fetch_small.append(script_usec(redis_client, "evalsha"))

        fill(redis_client, n, big, round_)
        assert len(redis_client.eval(BARE_MOVE, 2, K.queue("q"), K.inflight(POOL), n)) == n
        bare_big.append(script_usec(redis_client, "eval"))
    fetch_us, bare_us, small_us = min(fetch_big), min(bare_big), min(fetch_small)
    print(f"fetch of {n} x {big:,} B: {fetch_us} us; bare move: {bare_us} us; "
          f"fetch of {n} x 1 kB: {small_us} us")
    assert fetch_us <= 2 * bare_us, (
        f"a fetch of {n} jobs of {big:,} bytes cost Redis {fetch_us} us, "
        f"{fetch_us / bare_us:.1f} times the bare move of their bytes ({bare_us} us)")


def test_a_job_without_its_tag_at_the_end_gets_a_stable_tag_and_runs_its_course(
        redis_client: redis.Redis) -> None:
    """Another client's layout (the tag first, a large body after it): the tag is not
    searched for in the whole payload; the job is delivered under ``untagged-<digest>``,
    the same each time it is fetched, so its recovery count survives a requeue."""
    payload = json.dumps({"properties": {"delivery_tag": "front"}, "body": "B" * 50_000})
    redis_client.zadd(K.pools, {POOL: 1})
    scripts = Scripts(redis_client)
    scripts("enqueue", [K.queue("q"), K.ready, K.queues], [payload, "q", K.wake_channel, 0])
    jobs = scripts("fetch", fetch_keys(1), [POOL, "1", "q", 0])[1]
    tag = jobs[0][1].decode()
    assert re.fullmatch(r"untagged-[0-9a-f]{40}", tag), tag
    assert jobs[0][2].decode() == payload and jobs[0][3] == -1
    # The reaper's recovery: counted under that tag, back at the front of the queue.
    redis_client.hset(K.redelivery, tag, 1)
    redis_client.rpush(K.queue("q"), redis_client.hget(K.inflight(POOL), tag).split(b"\n", 1)[1])
    redis_client.hdel(K.inflight(POOL), tag)
    jobs = scripts("fetch", fetch_keys(1), [POOL, "1", "q", 0])[1]
    assert (jobs[0][1].decode(), jobs[0][3]) == (tag, 1)


def test_an_oversized_job_at_fetch_is_dead_with_its_reason_and_not_shipped(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A 200 kB job in a queue of a consumer whose limit is 100 kB: the fetch leaves its
    bytes in Redis (the reply carries only its size), the job goes to the dead set,
    reason ``too_large``, payload kept byte for byte, and the next job is delivered.

    What the reply carried is read where the transport decodes it (the real ``decode``,
    wrapped): a count of the bytes the server sent counts other clients' too (a
    background thread an earlier test left in this process, on a port since reused)."""
    replies: list[object] = []
    decode = Fetcher.decode

    def recording_decode(self: Fetcher, qname: object, tag: object, payload: object,
                         *args: object, **kwargs: object) -> object:
        replies.append(payload)
        return decode(self, qname, tag, payload, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(Fetcher, "decode", recording_decode)
    with RedisServer() as server:
        _oversized_fetch(server.url(scheme="celery-ext"), server.client(), replies)


def _oversized_fetch(broker_url: str, redis_client: redis.Redis,
                     replies: list[object]) -> None:
    big = message("big-1", 200_000)
    push(redis_client, QUEUE, big)
    push(redis_client, QUEUE, message("small-1", 100))
    with Connection(broker_url, transport_options={"max_payload_bytes": 100_000}) as conn:
        channel = conn.default_channel
        assert channel.basic_get(QUEUE) is None
        assert replies == [len(big)], "the fetch's reply carried more than the job's size"
        small = channel.basic_get(QUEUE)
        assert small is not None and small.delivery_tag == "small-1"
        small.ack()
    client = Client(redis_client)
    dead = client.dead()["items"]
    assert [(d["id"], d["reason"]) for d in dead] == [("big-1", "too_large")]
    assert f"is {len(big):,} bytes, over max_payload_bytes (100,000)" in dead[0]["error"]
    assert client.dead_job("big-1")["payload"] == big  # type: ignore[index]
    assert redis_client.llen(K.queue(QUEUE)) == 0
    wait_for(lambda: all(redis_client.hlen(K.inflight(p)) == 0
                           for p in redis_client.zrange(K.pools, 0, -1)),
               5, "empty in-flight records")


def test_worker_dead_letters_a_job_over_its_limit_and_runs_the_others(
        broker_url: str, redis_client: redis.Redis, worker_factory: Factory) -> None:
    """The limit was lowered after a job was enqueued: the worker (prefork) moves that
    job to the dead set with its reason and one log line, stays up, and runs the jobs
    fetched with it and after it."""
    proj.configure(broker_url)
    # Queued before the worker starts, so its first fetch takes the big job with others.
    before = [proj.add.delay(i, 1) for i in range(3)]
    big = proj.add.delay("x" * 200_000, "y")  # under the producer's own limit (1 MiB)
    after = [proj.add.delay(i, 2) for i in range(3)]
    worker = worker_factory("tests.apps.proj", pool="prefork", concurrency=2,
                            env={"CELERY_EXT_MAX_PAYLOAD_BYTES": "100000"}).start()
    pool = only_pool(redis_client)
    assert [r.get(timeout=15) for r in before + after] == [1, 2, 3, 2, 3, 4]
    assert proj.add.delay(5, 5).get(timeout=15) == 10
    client = Client(redis_client)
    page = wait_for(lambda: (p := client.dead())["total"] and p, 10, "the dead job")
    job = page["items"][0]
    assert (page["total"], job["reason"], job["task_id"]) == (1, "too_large", big.id)
    assert "bytes, over max_payload_bytes (100,000)" in job["error"]
    assert worker.alive and only_pool(redis_client) == pool
    wait_for(lambda: redis_client.hlen(K.inflight(pool)) == 0, 5, "an empty in-flight record")
    log = worker.log_text()
    assert len(re.findall(READY_PATTERN, log)) == 1 and "Traceback" not in log
    assert len([ln for ln in log.splitlines() if "too large" in ln]) == 1, worker.log_tail(40)


def test_a_no_ack_consumer_dead_letters_an_oversized_job_instead_of_losing_it(
        broker_url: str, redis_client: redis.Redis) -> None:
    """A no-ack fetch records nothing in flight: the job over the limit is written to
    the dead set from the payload in hand (before, it would have been delivered; an
    undecodable one was popped and recorded nowhere)."""
    big = message("big-2", 200_000)
    push(redis_client, QUEUE, big)
    push(redis_client, QUEUE, "not json")
    with Connection(broker_url, transport_options={"max_payload_bytes": 100_000}) as conn:
        channel = conn.default_channel
        assert channel.basic_get(QUEUE, no_ack=True) is None
        assert channel.basic_get(QUEUE, no_ack=True) is None
    client = Client(redis_client)
    dead = {d["reason"]: d for d in client.dead()["items"]}
    assert set(dead) == {"too_large", "undecodable"}
    assert dead["too_large"]["id"] == "big-2"
    assert client.dead_job("big-2")["payload"] == big  # type: ignore[index]
    assert client.dead_job(dead["undecodable"]["id"])["payload"] == "not json"  # type: ignore[index]
    assert redis_client.llen(K.queue(QUEUE)) == 0
