"""The job index (issue 15): a job found by its task id wherever it is, in one read, by
entries the scripts that move the job keep (``celery_ext/store/job_index.py``).

End-to-end tests run ``tests.apps.proj_index`` / ``tests.apps.proj`` workers, in both modes where
the path differs (``install(app)`` and drop-in); the window and expiry tests build their
jobs through the real producer and scripts on the real server.
"""

from __future__ import annotations

import signal
import time
from typing import Any

import pytest
import redis

from celery_ext.admin.job_status import DEAD_SCAN, SCHEDULED_SCAN_MAX, JobLookup, JobStatus
from celery_ext.config import Settings
from celery_ext.store.dead_set import dead_letter
from celery_ext.store.job_index import IndexEntry, lookup
from celery_ext.store.keys import Keys
from celery_ext.store.scripts import Scripts
from celery_ext.worker.heartbeater import Heartbeater
from celery_ext.worker.inflight import recover_tags
from celery_ext.worker.reaper import Reaper
from tests.apps import proj
from tests.helpers import Factory, Mode, start_workers, wait_for
from tests.helpers import mode_fixture as mode_fixture  # the `mode` fixture: both modes

#: Nothing reads what this module's pools write at a warm stop: teardown SIGKILLs
#: them (worker_factory in tests/conftest.py).
pytestmark = pytest.mark.kill_workers_at_teardown

K = Keys("celery_ext")
FAST = {"CELERY_EXT_HEARTBEAT_INTERVAL": "0.25", "CELERY_EXT_DEAD_AFTER": "1",
        "CELERY_EXT_REAP_INTERVAL": "0.5", "CELERY_EXT_PROMOTE_INTERVAL": "0.5"}


@pytest.fixture
def app(broker_url: str, redis_client: redis.Redis) -> Any:
    proj.configure(broker_url)
    from tests.apps import proj_index

    return proj_index


def entry(client: redis.Redis, job_id: str) -> IndexEntry | None:
    return lookup(client, K, job_id)


def until(look: JobLookup, job_id: str, state: str, timeout: float = 15) -> JobStatus:
    """The job's status once it says ``state`` (found by the index)."""
    def check() -> JobStatus | None:
        st = look.status(job_id)
        return st if st["state"] == state and st["indexed"] else None
    return wait_for(check, timeout, f"job {job_id} {state} (now {look.status(job_id)})")


def test_job_followed_from_enqueue_to_done(app: Any, mode: Mode, redis_client: redis.Redis,
                                          rec: redis.Redis, worker_factory: Factory) -> None:
    """scheduled -> promoted (queued) -> fetched, running -> retry -> dead -> dead-retried
    (queued) -> done, the index right at each step."""
    look = JobLookup(redis_client, Settings(), mode.app)
    queue = mode.queue(app.gated)
    rec.set("hold:j", 1)
    result = mode.send(app.gated, "j", countdown=1)
    st = look.status(result.id)
    e = entry(redis_client, result.id)
    assert st["state"] == "scheduled" and e and e["state"] == "scheduled"
    assert e["queue"] == queue and st["due_at"] and st["due_at"] > time.time()
    assert st["job_name"] == app.gated.name
    assert redis_client.zscore(K.scheduled, e["ref"]) is not None

    redis_client.sadd(K.paused, queue)  # promoted but not fetched: it stays queued
    (worker,) = start_workers(worker_factory, 1, app="tests.apps.proj_index",
                              env=mode.env(**FAST))
    st = until(look, result.id, "queued")
    assert (st["queue"], st["level"]) == (queue, 0)

    redis_client.srem(K.paused, queue)
    redis_client.publish(K.wake_channel, queue)
    st = until(look, result.id, "running")
    # Acked at start in drop-in mode: the ack is written within LOOP_ACK_DELAY.
    expected = "done" if mode.dropin else "inflight"
    e = wait_for(lambda: (lambda x: x if x and x["state"] == expected else None)(
        entry(redis_client, result.id)), 5, f"the entry saying {expected}")
    assert st["pool"] == e["detail"] and redis_client.zscore(K.pools, e["detail"])
    assert st["job_name"] == app.gated.name
    if not mode.dropin:
        assert redis_client.hexists(K.inflight(e["detail"]), e["ref"])
        # The fetch left the queued entry: its tag is the pool's record of the job.
        stored = fields(redis_client, result.id)
        assert (stored[0], stored[4]) == ("queued", e["ref"])

    rec.delete("hold:j")  # fails: retried once, then dead
    st = until(look, result.id, "retrying")
    e = entry(redis_client, result.id)
    assert e and e["state"] == "retry" and redis_client.zscore(K.retry, e["ref"])
    assert st["error"] == "ValueError: j is broken" and st["due_at"]
    st = until(look, result.id, "dead")
    e = entry(redis_client, result.id)
    assert e and st["dead_id"] == e["ref"] and redis_client.hexists(K.dead_jobs, e["ref"])
    assert "j is broken" in (st["error"] or "") and st["job_name"] == app.gated.name

    from celery_ext.client import Client
    client = Client(redis_client)
    redis_client.sadd(K.paused, queue)
    rec.set("heal:j", 1)
    assert client.retry_dead(st["dead_id"] or "")
    st = until(look, result.id, "queued")
    assert st["queue"] == queue and not redis_client.hexists(K.dead_jobs, e["ref"])
    client.resume(queue)
    st = until(look, result.id, "succeeded")
    e = entry(redis_client, result.id)
    assert e and e["state"] == "done" and st["pool"] == e["detail"] and st["result"]
    assert redis_client.zscore(K.job_index_done, result.id)
    worker.stop()


def test_sigkilled_pools_job_is_queued_again_after_the_reaper(
        app: Any, mode: Mode, redis_client: redis.Redis, rec: redis.Redis,
        worker_factory: Factory) -> None:
    look = JobLookup(redis_client, Settings(), mode.app)
    rec.set("hold:k", 1)
    (victim,) = start_workers(worker_factory, 1, app="tests.apps.proj_index",
                              env=mode.env(acks_late=True, **FAST))
    result = mode.send(app.gated, "k")
    st = until(look, result.id, "running")
    pool = st["pool"]
    redis_client.sadd(K.paused, mode.queue(app.gated))  # requeued, nobody takes it
    victim.stop(signal.SIGKILL)  # the host died: main process and children
    settings = Settings.load({}, environ=FAST)
    wait_for(lambda: Reaper(redis_client, settings).reap_now(force=True).dead_pools, 10,
             "the reaper to declare the pool dead")
    st = look.status(result.id)
    e = entry(redis_client, result.id)
    assert st["state"] == "queued" and e and e["state"] == "queued", (st, e)
    tag = e["detail"]  # the tag the job is recovered under, which its next fetch records
    assert tag and not redis_client.hexists(K.inflight(pool or ""), tag)
    (payload,) = redis_client.lrange(K.queue(mode.queue(app.gated)), 0, -1)
    assert f'"delivery_tag": "{tag}"'.encode() in payload


def fields(client: redis.Redis, job_id: str) -> list[str]:
    """The stored entry of ``job_id``, split: state, ms, queue, ref, detail."""
    raw = client.hget(K.job_index, job_id)
    assert raw is not None
    return raw.decode().split("\n")


def test_running_and_reserved_jobs_are_in_flight_and_a_warm_stop_queues_the_reserved_again(
        app: Any, mode: Mode, redis_client: redis.Redis, rec: redis.Redis,
        worker_factory: Factory) -> None:
    """prefork -c 1: one job runs (held), three wait in the pool's prefetch. The fetch
    left their entries as the enqueue wrote them, byte for byte; the status finds each
    in flight in the pool by its delivery tag (running; reserved). A warm shutdown
    returns the reserved ones to their queue: queued, under the tags they had."""
    look = JobLookup(redis_client, Settings(), mode.app)
    queue = mode.queue(app.gated)
    redis_client.sadd(K.paused, queue)  # all four enqueued before the pool fetches
    for key in "abcd":
        rec.set(f"heal:{key}", 1)
    rec.set("hold:a", 1)
    jobs = [mode.send(app.gated, key) for key in "abcd"]
    before = {j.id: redis_client.hget(K.job_index, j.id) for j in jobs}
    (worker,) = start_workers(worker_factory, 1, app="tests.apps.proj_index",
                              pool="prefork", concurrency=1, env=mode.env(**FAST))
    redis_client.srem(K.paused, queue)
    redis_client.publish(K.wake_channel, queue)
    st = until(look, jobs[0].id, "running")
    pool = st["pool"]
    assert pool and redis_client.zscore(K.pools, pool)
    wait_for(lambda: redis_client.hlen(K.inflight(pool)) == (3 if mode.dropin else 4), 10,
             "the prefetch")
    for job in jobs[1:]:
        st = look.status(job.id)
        assert (st["state"], st["pool"], st["queue"]) == ("reserved", pool, queue), st
        assert redis_client.hget(K.job_index, job.id) == before[job.id]
    if not mode.dropin:  # (drop-in acks a job when it starts: its entry says done)
        assert redis_client.hget(K.job_index, jobs[0].id) == before[jobs[0].id]

    worker.send(signal.SIGTERM)
    worker.wait_for_log("Warm shutdown", timeout=10)
    rec.delete("hold:a")
    assert worker.stop(signal.SIGTERM, timeout=20) == 0
    assert until(look, jobs[0].id, "succeeded")["pool"] == pool
    for job in jobs[1:]:
        st = look.status(job.id)
        assert (st["state"], st["queue"]) == ("queued", queue), st
        old, new = (before[job.id] or b"").decode().split("\n"), fields(redis_client, job.id)
        assert new[0] == "queued" and new[2:] == old[2:]  # same queue, level and tag
    assert redis_client.llen(K.queue(queue)) == 3


def test_an_ack_landing_seconds_after_the_stored_outcome_still_shows_it(
        app: Any, mode: Mode, redis_client: redis.Redis, worker_factory: Factory) -> None:
    """The job's result is stored ``ACK_AFTER`` seconds before its ack (late acks) writes
    the done entry, as a batched ack, a warm stop or a Redis outage can make it: the status
    still says succeeded, with the result, since the done entry keeps when the run was
    queued. Before, the outcome was checked against the ack's time with a second of slack,
    and the status said "finished" without the result (seen in a loaded test run, when a
    warm stop delayed an ack)."""
    look = JobLookup(redis_client, Settings(), mode.app)
    job = mode.send(app.acked_late, "k")
    queued = entry(redis_client, job.id)
    assert queued and queued["state"] == "queued"
    start_workers(worker_factory, 1, app="tests.apps.proj_index", pool="prefork",
                  concurrency=1, env=mode.env())
    done = wait_for(lambda: (e := entry(redis_client, job.id)) and e["state"] == "done" and e,
                    20, "the ack's done entry")
    # (drop-in acks at the start: the result comes after the done entry)
    st = until(look, job.id, "succeeded", timeout=10)
    assert st["result"] == "'k'", st
    assert queued["queued_at"] is None and done["queued_at"] == queued["at"]
    if not mode.dropin:  # late acks: the ack came ACK_AFTER after the result
        assert done["at"] - queued["at"] >= app.ACK_AFTER


def test_job_past_the_old_search_windows_is_found(broker_url: str,
                                                  redis_client: redis.Redis) -> None:
    """The oldest of more than SCHEDULED_SCAN_MAX scheduled jobs and of more than DEAD_SCAN
    dead jobs: the sets' search gave up on them ("queued"); the index finds them."""
    proj.configure(broker_url)
    settings = Settings()
    look = JobLookup(redis_client, settings, proj.app)
    first = proj.record.apply_async(("w",), countdown=3600)
    for _ in range(SCHEDULED_SCAN_MAX):
        proj.record.apply_async(("w",), countdown=3600)
    queue = "tests.apps.proj.noop"
    sent = [proj.noop.apply_async() for _ in range(DEAD_SCAN + 5)]
    for result in sent:  # each job fails for good, oldest first
        payload = redis_client.rpop(K.queue(queue))
        assert payload and result.id.encode() in payload
        assert dead_letter(redis_client, settings, "p", f"tag-{result.id}", reason="failed",
                           error="ValueError: no", fallback=f"{queue}\n".encode() + payload)

    st = look.status(first.id)
    assert st["state"] == "scheduled" and st["indexed"] and st["due_at"]
    st = look.status(sent[0].id)
    assert st["state"] == "dead" and st["dead_id"] == f"tag-{sent[0].id}"
    assert st["error"] == "ValueError: no"
    # Without their entries the search of the sets does not reach them.
    redis_client.hdel(K.job_index, first.id, sent[0].id)
    assert look.status(first.id)["state"] == "queued"
    assert look.status(sent[0].id)["state"] == "queued"
    assert look.status(sent[-1].id)["state"] == "dead"  # the newest: both ways


def test_entries_are_removed_with_their_jobs_and_finished_ones_expire(
        broker_url: str, redis_client: redis.Redis, worker_factory: Factory) -> None:
    """1,000 jobs done with job_index_ttl shrunk leave no entry behind once the TTL has
    passed; a job deleted from the scheduled set or trimmed from the dead set neither."""
    proj.configure(broker_url)
    from celery_ext.client import Client
    client = Client(redis_client)
    doomed = proj.record.apply_async(("x",), countdown=3600)
    tag = entry(redis_client, doomed.id)
    assert tag and client.delete_scheduled(tag["ref"])
    assert entry(redis_client, doomed.id) is None

    settings = Settings(dead_max_size=3)
    queue = "tests.apps.proj.noop"
    sent = [proj.noop.apply_async() for _ in range(6)]
    for result in sent:
        payload = redis_client.rpop(K.queue(queue))
        assert payload is not None
        dead_letter(redis_client, settings, "p", result.id, reason="failed",
                    fallback=f"{queue}\n".encode() + payload)
    assert [entry(redis_client, r.id) is None for r in sent] == [True] * 3 + [False] * 3

    ttl = 1.0
    start_workers(worker_factory, 1, app="tests.apps.proj",
                  env={"CELERY_EXT_JOB_INDEX_TTL": str(ttl)})
    ids = [proj.noop.apply_async().id for _ in range(1000)]

    def all_done(ids: list[str]) -> bool:
        raw = redis_client.hmget(K.job_index, ids)
        return all(r is None or r.startswith(b"done\n") for r in raw)
    wait_for(lambda: all_done(ids), 60, "1,000 jobs done")
    assert redis_client.zcard(K.job_index_done) > 0  # entries were written, not skipped
    time.sleep(ttl + 0.1)  # every entry of the 1,000 is past its TTL
    late = [proj.noop.apply_async().id for _ in range(60)]  # each finish trims up to 20
    wait_for(lambda: all_done(late) and redis_client.llen(K.queue(queue)) == 0, 30,
             "60 more jobs done")
    wait_for(lambda: not redis_client.hlen(K.inflight(worker_pool(redis_client))), 10,
             "the last acks")
    left = {k.decode() for k in redis_client.hkeys(K.job_index)}
    assert not left & set(ids) and left & set(late)  # the last finished is within its TTL
    assert left <= set(late) | {r.id for r in sent}, left - set(late)
    assert redis_client.zcard(K.job_index_done) <= len(late)


def test_purged_and_deleted_queues_take_their_jobs_entries_with_them(
        broker_url: str, redis_client: redis.Redis) -> None:
    """`celery purge` (Kombu's purge) and a queue delete remove the index entries of the
    jobs they drop, at every priority level and fair key; a job of another queue, or one
    whose entry says it is elsewhere, keeps its entry."""
    proj.configure(broker_url)
    queue = "tests.apps.proj.noop"
    plain = [proj.noop.apply_async().id for _ in range(3)]
    urgent = proj.noop.apply_async(priority=0).id
    low = proj.noop.apply_async(priority=9).id
    keyed = proj.noop.apply_async(fair_key="tenant-a").id
    other = proj.record.apply_async(("kept",)).id
    moved = proj.noop.apply_async().id
    redis_client.hset(K.job_index, moved, "dead\n1\ntests.proj.noop\nd1\nfailed")
    gone = [*plain, urgent, low, keyed]
    assert all(entry(redis_client, i) for i in gone)
    with proj.app.connection_for_write() as conn:
        assert conn.default_channel.queue_purge(queue) == len(gone) + 1
    assert [entry(redis_client, i) for i in gone] == [None] * len(gone)
    assert entry(redis_client, other) is not None
    assert (entry(redis_client, moved) or {}).get("state") == "dead"
    assert not redis_client.exists(K.queue(queue), K.fair_ring(queue))

    again = proj.noop.apply_async(fair_key="tenant-b").id
    with proj.app.connection_for_write() as conn:  # Kombu deletes the queues it bound
        channel = conn.default_channel
        channel.exchange_declare(queue, type="direct")
        channel.queue_declare(queue)
        channel.queue_bind(queue, exchange=queue, routing_key=queue)
        channel.queue_delete(queue)
    assert entry(redis_client, again) is None


def worker_pool(client: redis.Redis) -> str:
    (pool,) = client.zrange(K.pools, 0, -1)
    return str(pool.decode())


def test_purge_takes_the_recovery_counts_of_its_jobs_with_it(
        broker_url: str, redis_client: redis.Redis) -> None:
    """Jobs recovered from a lost pool carry a recovery count in ``{ns}:redelivery``
    (by delivery tag); purging their queue removes the counts with the jobs, at every
    priority level and fair key, and leaves another queue's job's count alone."""
    proj.configure(broker_url)
    settings = Settings()
    queue, other = "tests.apps.proj.noop", "tests.apps.proj.record"
    for _ in range(3):
        proj.noop.apply_async()
    proj.noop.apply_async(priority=9)
    proj.noop.apply_async(fair_key="tenant-a")
    proj.record.apply_async(("kept",))
    pool = Heartbeater(redis_client, settings, "host:1:purge")
    pool.register()
    steps = settings.priority_steps
    status, jobs, *_ = Scripts(redis_client)(
        "fetch", K.fetch(pool.pool_id, [queue] * 5 + [other], steps),
        [pool.pool_id, "1" * 6, *[queue] * 5, other, 0])
    assert status == 1 and len(jobs) == 6
    tags = [job[1].decode() for job in jobs]
    _, requeued, _ = recover_tags(redis_client, settings, pool.pool_id, tags, mode="job")
    assert sorted(requeued) == sorted(tags)
    assert redis_client.hlen(K.redelivery) == 6  # one recovery each
    with proj.app.connection_for_write() as conn:
        assert conn.default_channel.queue_purge(queue) == 5
    assert redis_client.hkeys(K.redelivery) == [tags[-1].encode()]


def test_finished_entries_expire_without_later_jobs_of_their_queue(
        broker_url: str, redis_client: redis.Redis, worker_factory: Factory) -> None:
    """100 jobs finish with job_index_ttl=1 s and nothing runs after them: the pool's
    periodic trim (its reaper's tick) removes their entries once the TTL has passed,
    without a later finish in that queue to trim them."""
    proj.configure(broker_url)
    ttl = 1.0
    start_workers(worker_factory, 1, app="tests.apps.proj",
                  env={"CELERY_EXT_JOB_INDEX_TTL": str(ttl), "CELERY_EXT_REAP_INTERVAL": "0.5"})
    ids = [proj.noop.apply_async().id for _ in range(100)]
    assert redis_client.hlen(K.job_index) == 100  # written at enqueue

    def finished() -> bool:  # done, or done and trimmed already
        return all(r is None or r.startswith(b"done\n")
                   for r in redis_client.hmget(K.job_index, ids))
    wait_for(finished, 60, "100 jobs done")
    assert redis_client.llen(K.queue(proj.noop.name)) == 0
    wait_for(lambda: not redis_client.hlen(K.job_index), ttl + 4,
             "the finished entries to expire")
    assert not redis_client.exists(K.job_index_done)


def test_the_periodic_trim_reaches_every_copy_of_a_cluster_in_bounded_steps(
        cluster_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """On a cluster each job queue's copy has its own index: the reaper's trim deletes
    the expired finished entries in every copy, at most TRIM_STEP per copy and call;
    a finished entry within its TTL stays, and an entry live again (a task id reused)
    only leaves the finished set."""
    from celery_ext.client import Client
    from celery_ext.store import job_index

    client = Client.from_url(cluster_url, cluster=True, namespace="cl_trim")
    r, keys = client.client, client.keys
    settings = Settings(cluster=True, namespace="cl_trim", job_index_ttl=1.0)
    queues = [f"trim.q{i}" for i in range(4)]
    monkeypatch.setattr(job_index, "TRIM_STEP", 2)
    try:
        r.sadd(keys.queues, *queues)
        now = int(r.time()[0]) * 1000
        for q in queues:
            k = keys.of(q)
            for n in range(3):
                r.hset(k.job_index, f"{q}:old{n}", f"done\n{now - 5000}\n{q}\nt\np")
                r.zadd(k.job_index_done, {f"{q}:old{n}": now - 4000 + n})
            r.hset(k.job_index, f"{q}:fresh", f"done\n{now}\n{q}\nt\np")
            r.zadd(k.job_index_done, {f"{q}:fresh": now + 60_000})
            r.hset(k.job_index, f"{q}:live", f"queued\n{now}\n{q}\n0\n")
            r.zadd(k.job_index_done, {f"{q}:live": now - 9000})
        reaper = Reaper(r, settings)
        assert reaper.trim_index() == 2 * len(queues)  # a bounded step in each copy
        assert reaper.trim_index() == 2 * len(queues)
        assert reaper.trim_index() == 0
        for q in queues:
            k = keys.of(q)
            assert sorted(x.decode() for x in r.hkeys(k.job_index)) == [f"{q}:fresh",
                                                                         f"{q}:live"]
            assert r.zrange(k.job_index_done, 0, -1) == [f"{q}:fresh".encode()]
    finally:
        for q in queues:
            r.delete(keys.of(q).job_index, keys.of(q).job_index_done)
        r.delete(keys.queues)
        r.close()
