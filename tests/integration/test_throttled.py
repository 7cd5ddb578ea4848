"""Throttling from a job (issue 37): ``raise celery_ext.Throttled(seconds)`` puts the job back
at the front of its queue and holds its fair key (or its whole job queue) in all pools,
while other keys and queues run on; the job runs once afterwards, and nothing counts it
as a retry or a recovery.

Real ``celery worker`` pools of ``tests.apps.proj_paced`` (threads and prefork; drop-in
with Celery's default ``acks_late`` off, so the job is pushed back from the message the
worker has, and ``install(app)`` with it on), runs stamped on the Redis clock.
"""

from __future__ import annotations

import json
import pickle
import uuid
from typing import Any

import pytest
import redis

import celery_ext
from celery_ext.admin.cli.queues import state_cell
from celery_ext.client import Client
from celery_ext.config import DEFAULT_PRIORITY_STEPS
from celery_ext.options.fair import write_fair_rates
from celery_ext.store.connections import cluster_client, cluster_config
from celery_ext.store.job_index import index_keys
from celery_ext.store.keys import Keys
from celery_ext.store.scripts import Scripts
from celery_ext.testing.server import ClusterGroup
from tests.helpers import Factory, Mode, push, start_workers, wait_for
from tests.helpers import mode_fixture as mode_fixture  # the `mode` fixture: both modes

#: Nothing reads what this module's pools write at a warm stop: teardown SIGKILLs
#: them (worker_factory in tests/conftest.py).
pytestmark = pytest.mark.kill_workers_at_teardown

K = Keys("celery_ext")
APP = "tests.apps.proj_paced"


def runs(rec: redis.Redis) -> list[tuple[str, int, list[str]]]:
    """(job, Redis time µs, the rest) of each run, in start order."""
    out = []
    for line in rec.lrange("throttle:runs", 0, -1):
        job, stamp, *rest = line.decode().split()
        out.append((job, int(stamp), rest))
    return out


def test_throttled_is_a_requeueing_reject_that_survives_pickling() -> None:
    """A prefork child sends it pickled; a bad hold is one line."""
    exc = pickle.loads(pickle.dumps(celery_ext.Throttled(2.5)))
    assert isinstance(exc, celery_ext.Throttled) and exc.seconds == 2.5 and exc.requeue
    for bad in (0, -1, "soon", None, True, 86_401, float("nan")):
        with pytest.raises(ValueError, match=r"Throttled\(.*\): the hold must be a number"):
            celery_ext.Throttled(bad)  # type: ignore[arg-type]


def test_the_script_puts_the_job_at_the_front_and_holds_its_key_or_queue(
        redis_client: redis.Redis) -> None:
    """throttle.lua on a job in a pool's record: back at the front of its key's sub-queue
    (or its queue), out of the record and its counts, not marked redelivered; fetch then
    passes the key over (other keys run) or skips the queue, with the wait."""
    scripts, pool = Scripts(redis_client), "p1"
    redis_client.zadd(K.pools, {pool: 1})

    def job(n: int, key: str | None) -> str:
        props = {"delivery_tag": f"t{n}", **({"fair_key": key} if key else {})}
        return json.dumps({"n": n, "properties": props})

    def fetch(*queues: str) -> tuple[list[Any], list[str], dict[str, int]]:
        _, jobs, _, blocked, waits = scripts("fetch", K.fetch(pool, queues, DEFAULT_PRIORITY_STEPS),
                                             [pool, "1" * len(queues), *queues])
        return ([j[1].decode() for j in jobs], [b.decode() for b in blocked],
                {q.decode(): int(us) for q, us in waits})

    def throttle(tag: str, queue: str, seconds: float) -> bytes:
        return scripts("throttle", [K.inflight(pool), K.ready, K.running, K.rate_tat,
                                    *index_keys(K), K.queue(queue)],
                       [K.wake_channel, K.queue(""), 0, tag, int(seconds * 1e6), ""])

    for n, key in ((0, "A"), (1, "A"), (2, "B")):
        push(redis_client, "q", job(n, key))
    assert fetch("q")[0] == ["t0"]
    assert throttle("t0", "q", 5) == b"key"
    assert redis_client.lrange(K.fair_queue("q", "A"), -1, -1) == [job(0, "A").encode()]
    assert redis_client.hlen(K.inflight(pool)) == 0 and redis_client.hlen(K.redelivery) == 0
    assert not [f for f in redis_client.hkeys(K.running) if b"\n" in f]
    assert 4000 < redis_client.pttl(K.fair_due("q", "A")) <= 5000
    assert throttle("t0", "q", 1) is None  # no longer in the record: nothing moves
    jobs, blocked, waits = fetch("q", "q")
    assert jobs == ["t2"] and blocked == ["q"] and 4_000_000 < waits["q"] <= 5_000_000
    # Without a key: the whole queue is held, other queues are not.
    push(redis_client, "u", job(3, None))
    push(redis_client, "u", job(4, None))
    push(redis_client, "v", job(5, None))
    assert fetch("u")[0] == ["t3"]
    assert throttle("t3", "u", 5) == b"queue"
    assert redis_client.lrange(K.queue("u"), -1, -1) == [job(3, None).encode()]
    jobs, blocked, waits = fetch("u", "v")
    assert jobs == ["t5"] and blocked == ["u"] and 4_000_000 < waits["u"] <= 5_000_000
    assert redis_client.hget(K.stats, "rate_limited") is None  # a hold is no rate limit
    # A hold that is over: the queue's next job is its throttled one, and the field goes.
    redis_client.hset(K.rate_tat, "u", 1)
    assert fetch("u")[0] == ["t3"] and redis_client.hget(K.rate_tat, "u") is None


@pytest.mark.parametrize(("pool", "concurrency"),
                         [("threads", 4), ("prefork", 2), ("solo", 1), ("gevent", 20)])
def test_a_throttled_key_is_held_while_other_keys_run_and_its_job_runs_once_after(
        mode: Mode, pool: str, concurrency: int, rec: redis.Redis,
        redis_client: redis.Redis, worker_factory: Factory) -> None:
    """Key "slow"'s first job raises Throttled(2) in one of two pools: key "fast"'s six
    jobs all run meanwhile; slow0 runs again (once) and slow1 runs, both at least 2 s
    after slow0's first start on the Redis clock; its rerun is no retry (retries 0) and
    not redelivered, and the stats count no failure, retry or recovery."""
    from tests.apps import proj_paced

    throttled, hold_us = proj_paced.throttled, int(proj_paced.HOLD * 1_000_000)
    start_workers(worker_factory, 2, APP, pool=pool, concurrency=concurrency,
                  queues=["throttled"], env=mode.env())
    mode.send(throttled, "slow", 0, queue="throttled")
    wait_for(lambda: redis_client.exists(K.fair_due("throttled", "slow")), 30,
             "slow0's first run to hold its key")
    mode.send(throttled, "slow", 1, queue="throttled")
    for i in range(6):
        mode.send(throttled, "fast", i, queue="throttled")
    wait_for(lambda: len(runs(rec)) == 9, 30, "9 runs")
    ran = runs(rec)
    names = [job for job, _, _ in ran]
    assert sorted(names) == sorted(["slow0", "slow0", "slow1", *(f"fast{i}" for i in range(6))])
    first, again = [(t, rest) for job, t, rest in ran if job == "slow0"]
    slow1 = next(t for job, t, _ in ran if job == "slow1")
    assert again[0] - first[0] >= hold_us and slow1 - first[0] >= hold_us, ran
    assert again[1] == ["0", "0"], ran  # retries 0, not redelivered
    # The other key ran while "slow" was held.
    assert max(t for job, t, _ in ran if job.startswith("fast")) < again[0], ran
    wait_for(lambda: int(redis_client.hget(K.stats, "processed") or 0) >= 8, 10,
             "the stats flush")
    stats = {k.decode(): v for k, v in redis_client.hgetall(K.stats).items()}
    assert not {k for k in stats if k.split(":")[0] in ("failed", "retried", "recovered")}, stats
    assert redis_client.hlen(K.redelivery) == 0 and redis_client.zcard(K.dead) == 0
    wait_for(lambda: not redis_client.exists(K.fair_due("throttled", "slow")), 5,
             "the key's hold to expire")


@pytest.mark.parametrize(("pool", "concurrency"), [("threads", 4), ("prefork", 2)])
def test_a_throttled_job_without_a_key_holds_its_queue_while_other_queues_run(
        pool: str, concurrency: int, broker_url: str, rec: redis.Redis,
        redis_client: redis.Redis, worker_factory: Factory) -> None:
    """q0 raises Throttled(2) (install(app), acks_late): its queue's jobs q1 and q2 wait,
    and q0's rerun, at least 2 s after its first start; another queue's jobs run
    meanwhile. Once the hold is over and the queue drained, nothing of it is left."""
    from tests.apps import proj, proj_paced

    proj.configure(broker_url)
    held, free = proj_paced.throttled_queue, proj_paced.free
    hold_us = int(proj_paced.HOLD * 1_000_000)
    start_workers(worker_factory, 2, APP, pool=pool, concurrency=concurrency,
                  queues=["throttled_queue", "free"])
    held.apply_async((0,))
    wait_for(lambda: redis_client.hget(K.rate_tat, "throttled_queue"), 30,
             "q0's first run to hold its queue")
    # The hold is shown where a person looks at the queue (Client, CLI, dashboard).
    shown = {q["name"]: q for q in Client(redis_client).job_queues()}["throttled_queue"]
    assert shown["not_due_for"] is not None, shown
    assert 0 < shown["not_due_for"] <= proj_paced.HOLD, shown
    assert "next in " in state_cell({**shown, "not_due_for": proj_paced.HOLD})
    for n in (1, 2):
        held.apply_async((n,))
    for n in range(4):
        free.apply_async((n,))
    wait_for(lambda: len(runs(rec)) == 8, 30, "8 runs")
    ran = runs(rec)
    assert sorted(job for job, _, _ in ran) == sorted(
        ["q0", "q0", "q1", "q2", "free0", "free1", "free2", "free3"])
    first = next(t for job, t, _ in ran if job == "q0")
    later = [(job, t, rest) for job, t, rest in ran if job.startswith("q")][1:]
    assert all(t - first >= hold_us and rest == ["0"] for _, t, rest in later), ran
    assert max(t for job, t, _ in ran if job.startswith("free")) < later[0][1], ran
    wait_for(lambda: redis_client.hget(K.rate_tat, "throttled_queue") is None, 10,
             "the queue's hold to go")
    assert redis_client.hlen(K.redelivery) == 0 and redis_client.zcard(K.dead) == 0


def test_hold_and_per_key_limit_on_a_cluster(cluster: ClusterGroup) -> None:
    """On a cluster, in a job queue's own copy of the layout: the throttle script and the
    fetch's per-key checks touch only that copy's slot (the key states are the queue key
    plus a suffix), and the queue's hold lives in that copy's rate_tat."""
    config = cluster_config([cluster.url()], {"cluster": True})
    assert config is not None
    rc = cluster_client(config, {"socket_timeout": 5.0})
    try:
        k = Keys("thr" + uuid.uuid4().hex[:8], cluster=True).of("q")
        scripts, pool = Scripts(rc), "p1"
        rc.zadd(k.pools, {pool: 1})
        for n, key in ((0, "A"), (1, "A"), (2, "B"), (3, None)):
            props = {"delivery_tag": f"t{n}", **({"fair_key": key} if key else {})}
            scripts("enqueue", [k.queue("q"), k.ready, k.queues],
                    [json.dumps({"n": n, "properties": props}), "q", k.wake_channel, 0])
        write_fair_rates(rc, k, {"q": 10_000_000}, ["q"])

        def fetch() -> tuple[list[str], dict[str, int]]:
            _, jobs, _, _, waits = scripts("fetch", k.fetch(pool, ["q"], DEFAULT_PRIORITY_STEPS),
                                           [pool, "1", "q"])
            return [j[1].decode() for j in jobs], {q.decode(): int(us) for q, us in waits}

        def throttle(tag: str) -> bytes:
            return scripts("throttle", [k.inflight(pool), k.ready, k.running, k.rate_tat,
                                        *index_keys(k), k.queue("q")],
                           [k.wake_channel, k.queue(""), 0, tag, 5_000_000, ""])

        assert fetch()[0] == ["t3"]  # unkeyed first
        assert throttle("t3") == b"queue" and rc.hget(k.rate_tat, "q")
        jobs, waits = fetch()
        assert jobs == [] and 4_000_000 < waits["q"] <= 5_000_000
        rc.hdel(k.rate_tat, "q")
        assert fetch()[0] == ["t3"]
        assert fetch()[0] == ["t0"]
        assert 9_000 < rc.pttl(k.fair_due("q", "A")) <= 10_000  # its per-key limit
        assert fetch()[0] == ["t2"]  # A is not due: B runs
        jobs, waits = fetch()
        assert jobs == [] and 0 < waits["q"] <= 10_000_000
    finally:
        rc.close()
