"""What a process's counter flush costs Redis (issue 36): a cost per job, not per busy
process and second.

Every executing process sums its processed/failed counters, runtimes and history in
memory and writes them in one ``history`` script call (``HistoryWriter.flush``), when
due (``worker/flush_timer.py``): at most once a second, and only that often when
``STATS_FLUSH_JOBS`` jobs ended or one failed; a process running a job now and then
waits up to ``STATS_FLUSH_MAX_INTERVAL`` or the end of the count's minute. Real server,
real ``celery worker -P solo`` pools; script calls counted with ``MONITOR``.
"""

from __future__ import annotations

import signal
import time
import uuid
from collections.abc import Callable

import pytest
import redis

from celery_ext.client import Client
from celery_ext.config import Settings
from celery_ext.store.history import ALL, NAME_PREFIX, HistoryReader, HistoryWriter, unpack
from celery_ext.store.keys import Keys
from celery_ext.testing.server import ClusterGroup, RedisServer
from celery_ext.worker.flush_timer import (
    STATS_FLUSH_INTERVAL,
    STATS_FLUSH_JOBS,
    STATS_FLUSH_MAX_INTERVAL,
)
from celery_ext.worker.observer import Observer
from tests.apps import proj
from tests.helpers import start_workers, wait_for
from tests.integration.test_gevent_batching import ScriptCalls
from tests.workers import WorkerProcess

K = Keys("celery_ext")
#: The script a counter flush calls (its counters went in a ``stats`` call of their own
#: before the flush was one call).
FLUSH_SCRIPTS = ("history",)


def _processed(client: redis.Redis) -> int:
    return int(client.hget(K.stats, "processed") or 0)


def _history_processed(client: redis.Redis) -> int:
    """Processed jobs of every minute hash (the test's jobs fall in one or two)."""
    return sum(unpack(client.hget(key, ALL))[0][0]
               for key in client.scan_iter(K.history_minute(0)[:-1] + "*"))


def _at_start_of_minute(obs: Observer) -> None:
    """Make the observer's Redis clock read the first second of a minute: its end is a
    minute away, so only the job rules decide when a flush is due."""
    obs.clock_offset = -(time.time() % 60) + 0.5


@pytest.mark.parametrize("pool", ["solo", "threads"])
@pytest.mark.parametrize("mode", ["install", "dropin"])
def test_a_trickle_over_several_pools_flushes_per_job_not_per_pool_and_second(
        broker_url: str, redis_server: RedisServer, redis_client: redis.Redis,
        rec: redis.Redis, worker_factory: Callable[..., WorkerProcess], mode: str,
        pool: str) -> None:
    """Three solo pools share 10 jobs a second for 6 s. Flushing every busy process every
    second wrote a stats, a runtime and a history call per pool and second (about 50
    calls for 60 jobs here; 0.46 history + 0.94 stats calls per job at 200 pools in
    bench.pools). Now each pool writes its first counts at once, then once per
    ``STATS_FLUSH_MAX_INTERVAL`` (or minute end): a few calls per pool. Every count is
    written all the same, the last ones when the pools stop."""
    proj.configure(broker_url)
    env = {"CELERY_EXT_NO_INSTALL": "1"} if mode == "dropin" else {}
    workers = start_workers(worker_factory, 3, "tests.apps.proj", pool=pool, concurrency=1,
                            env=env)
    jobs = 60
    with ScriptCalls(redis_server, FLUSH_SCRIPTS) as calls:
        for _ in range(jobs):
            # (a drop-in worker consumes Celery's default queue)
            proj.record.apply_async(("trickle",), queue="celery" if mode == "dropin" else None)
            time.sleep(0.1)
        wait_for(lambda: rec.llen("runs:trickle") >= jobs, 30, "the trickle run")
        time.sleep(STATS_FLUSH_INTERVAL)  # (a flush due now is counted)
    flushes = sum(calls.calls.values())
    print(f"flush calls for {jobs} jobs over 3 pools: {calls.calls}")
    assert rec.llen("runs:trickle") == jobs
    # 3 pools: at most a first write, one per STATS_FLUSH_MAX_INTERVAL and one at a
    # minute's end each over these 7 s: 12; per pool and second it was 3 x 3 x 7.
    assert flushes <= jobs // 5, (flushes, calls.calls)

    for worker in workers:  # a pool's stop writes what its process holds (all at once)
        worker.send(signal.SIGTERM)
    for worker in workers:
        worker.stop(signal.SIGTERM)
    assert _processed(redis_client) == jobs
    assert _history_processed(redis_client) == jobs


def test_one_flush_writes_counters_runtimes_and_history_in_one_call(
        redis_server: RedisServer, redis_client: redis.Redis) -> None:
    """Stats, runtime fields and the history go in one script call (and one TIME), not
    three; the queue of a per-queue counter joins the known queues (a reader that forgot it
    forgets its fields again)."""
    obs = Observer(redis_client, Settings(), "pool-flush")
    _at_start_of_minute(obs)
    obs.job_finished("j0", "t.0", "processed", name="t.0")
    obs.flush()  # (a process's first counts go at once: the next wait, as the thread does)
    redis_client.delete(K.stats, K.queues)
    obs.job_started(type("T", (), {"name": "t.a", "stall_after": 0})(), "j1", (), {},
                    [("0.01:t.a", 1), ("wait_sum_us:t.a", 5000)])
    obs.job_finished("j1", "t.a", "processed", name="t.a")
    obs.job_finished("j2", "t.b", "failed", name="t.b")
    redis_client.config_resetstat()
    obs.flush(force_stats=True)
    evalsha = redis_client.info("commandstats").get("cmdstat_evalsha", {})
    assert evalsha.get("calls") == 1
    stats = {k.decode(): int(v) for k, v in redis_client.hgetall(K.stats).items()}
    assert stats == {"processed": 1, "processed:t.a": 1, "failed": 1, "failed:t.b": 1}
    runtime = {k.decode(): int(v) for k, v in redis_client.hgetall(K.runtime).items()}
    assert runtime["0.01:t.a"] == 1 and runtime["wait_sum_us:t.a"] == 5000
    assert "sum_us:t.a" in runtime and "sum_us:t.b" not in runtime  # (t.b never started here)
    assert redis_client.smembers(K.queues) == {b"t.a", b"t.b"}
    assert _history_processed(redis_client) == 2
    obs.stop()


def test_few_jobs_wait_longer_many_jobs_or_a_failure_go_within_a_second(
        redis_client: redis.Redis) -> None:
    """The flush policy, read from ``flush()``'s answer (seconds until something is due)
    on a real server: a lone count after a write waits ``STATS_FLUSH_MAX_INTERVAL``;
    ``STATS_FLUSH_JOBS`` counts, or one failure, are due a second after the last write."""
    obs = Observer(redis_client, Settings(), "pool-policy")
    _at_start_of_minute(obs)
    obs.job_finished("first", "q", "processed")
    obs.flush()  # a process's first counts go at once
    assert _processed(redis_client) == 1

    obs.job_finished("second", "q", "processed")
    wait = obs.flush()
    assert _processed(redis_client) == 1  # not yet
    assert STATS_FLUSH_MAX_INTERVAL - 0.5 < wait <= STATS_FLUSH_MAX_INTERVAL

    for i in range(STATS_FLUSH_JOBS - 1):
        obs.job_finished(f"many-{i}", "q", "processed")
    assert obs.flush() <= STATS_FLUSH_INTERVAL

    obs.flush(force_stats=True)
    obs.job_finished("bad", "q", "failed")
    assert obs.flush() <= STATS_FLUSH_INTERVAL
    obs.stop()
    assert _processed(redis_client) == 1 + 1 + STATS_FLUSH_JOBS - 1
    assert int(redis_client.hget(K.stats, "failed") or 0) == 1


def test_counts_go_at_the_end_of_their_minute(redis_client: redis.Redis) -> None:
    """A count waiting for ``STATS_FLUSH_MAX_INTERVAL`` would land in the next minute of
    the history: it is due when its minute ends on the Redis clock instead."""
    obs = Observer(redis_client, Settings(), "pool-minute")
    obs.job_finished("first", "q", "processed")
    obs.flush()
    obs.clock_offset = 60 - (time.time() % 60) - 2.0  # the Redis minute ends in 2 s
    obs.job_finished("second", "q", "processed")
    wait = obs.flush()
    assert 1.5 < wait < 2.5
    obs.stop()


def _away_from_a_minute_end(client: redis.Redis) -> str:
    """The current minute hash of the Redis clock, with at least 3 s of the minute left
    (waits for the next minute otherwise)."""
    seconds, _ = client.time()
    if seconds % 60 > 57:
        time.sleep(60 - seconds % 60 + 0.1)
        seconds, _ = client.time()
    return K.history_minute(seconds // 60)


def test_history_fields_merge_in_place(redis_client: redis.Redis) -> None:
    """history.lua adds to a stored field with string matches (new buckets at the end):
    what the readers get back is the exact sum, whatever order the buckets are in; a
    value that is not of the format is replaced."""
    writer = HistoryWriter(redis_client, Settings())
    minute = _away_from_a_minute_end(redis_client)
    for runtime in (0.01, 0.01, 0.0005):
        writer.add("t.x", "processed", runtime)
    writer.flush()
    for outcome, runtime in (("failed", 0.01), ("processed", 3.0), ("retried", None),
                             ("processed", 0.0005)):
        writer.add("t.x", outcome, runtime)
    redis_client.hset(minute, NAME_PREFIX + "t.y", "junk")
    writer.add("t.y", "processed", 0.01)
    writer.flush()
    assert redis_client.hget(minute, NAME_PREFIX + "t.x") == b"5 1 1 0:2 4:3 12:1"
    assert unpack(redis_client.hget(minute, ALL)) == ([6, 1, 1], {0: 2, 4: 4, 12: 1})
    assert redis_client.hget(minute, NAME_PREFIX + "t.y") == b"1 0 0 4:1"
    seconds, _ = redis_client.time()
    rows = HistoryReader(redis_client, Settings()).runtimes("1h", float(seconds))
    assert [(r["name"], r["processed"], r["failed"], r["retried"]) for r in rows] == [
        ("t.x", 5, 1, 1), ("t.y", 1, 0, 0)]


#: Job names in one flush of ``test_a_flush_of_many_job_names_...``: more than a chunk of
#: the runtime fields (four per name), so the chunking is crossed too.
MANY = 300


def _inner_calls(client: redis.Redis) -> dict[str, int]:
    """Calls per command since the last CONFIG RESETSTAT, the scripts' own left out."""
    return {k.removeprefix("cmdstat_"): int(v["calls"])
            for k, v in client.info("commandstats").items()
            if k not in ("cmdstat_evalsha", "cmdstat_info", "cmdstat_config|resetstat")}


def test_a_flush_of_many_job_names_runs_a_few_commands_not_some_per_name(
        redis_client: redis.Redis) -> None:
    """A flush carries a field per job name that ran in each of the stats, the runtime
    and the two history hashes (seven per name with the waits): history.lua reads and
    writes each hash's fields in one HMGET and one HSET per thousand, not a HINCRBY or
    an HGET and HSET per field (issue 36: at 10,000 job names that was most of what the
    names added to Redis's work per job). The sums are the same: counters on top of what
    was there, history fields merged."""
    names = [f"t.{i}" for i in range(MANY)]
    obs = Observer(redis_client, Settings(), "pool-many")
    _at_start_of_minute(obs)
    minute = _away_from_a_minute_end(redis_client)
    redis_client.hset(K.stats, mapping={"processed:t.0": 41, "processed": 41})
    redis_client.hset(K.runtime, "sum_us:t.1", 2**53 + 1)  # past a double: still exact
    redis_client.hset(minute, NAME_PREFIX + "t.2", "1 0 0 4:1")
    for i, name in enumerate(names):
        obs.job_started(type("T", (), {"name": name, "stall_after": 0})(), f"j{i}", (), {},
                        [(f"0.01:{name}", 1), (f"wait_sum_us:{name}", 5000 + i)])
        obs.job_finished(f"j{i}", name, "processed", name=name)
    scripts, sent = obs.history.scripts, []

    def counted(name: str, keys: list[str], args: list[object]) -> object:
        sent.append(len(args))
        return scripts(name, keys, args)

    obs.history.scripts = counted  # type: ignore[assignment]
    redis_client.config_resetstat()
    obs.flush(force_stats=True)
    calls = _inner_calls(redis_client)
    assert sum(calls.values()) <= 16, calls  # (before: 2,707, one per field)
    # Arguments: a queue's seven fields go as three (its name, its stats and its runtime
    # increments) and its history field as two, not two per field: 13 per name before.
    assert len(sent) == 1 and sent[0] <= 5 * MANY + 16, sent
    assert calls.get("hincrby") == 1 and "hget" not in calls, calls  # (the one past 2**53)
    stats = {k.decode(): int(v) for k, v in redis_client.hgetall(K.stats).items()}
    assert stats == {"processed": 41 + MANY, "processed:t.0": 42,
                     **{f"processed:{n}": 1 for n in names[1:]}}
    runtime = {k.decode(): int(v) for k, v in redis_client.hgetall(K.runtime).items()}
    assert len(runtime) == 4 * MANY
    assert runtime["sum_us:t.1"] > 2**53 + 1 and runtime["wait_sum_us:t.7"] == 5007
    assert all(runtime[f"0.01:{n}"] == 1 for n in names)
    assert redis_client.scard(K.queues) == MANY
    assert unpack(redis_client.hget(minute, NAME_PREFIX + "t.2"))[0] == [2, 0, 0]
    assert unpack(redis_client.hget(minute, ALL))[0] == [MANY, 0, 0]
    obs.stop()


def test_a_counter_that_is_not_a_whole_number_stops_the_flush_as_hincrby_did(
        redis_client: redis.Redis) -> None:
    """The counters are added in Lua now, but a field that holds something else is
    refused as HINCRBY refused it, not overwritten: the flush fails and its counts wait
    for the next one."""
    writer = HistoryWriter(redis_client, Settings())
    redis_client.hset(K.stats, "processed:q", "1.5")
    with pytest.raises(redis.ResponseError):
        writer.flush({"processed": 1, "processed:q": 1})
    assert redis_client.hget(K.stats, "processed:q") == b"1.5"


def test_a_flush_on_a_cluster_writes_its_one_call_in_the_namespace_slot(
        cluster: ClusterGroup) -> None:
    """The flush's keys (stats, runtime, known queues, the minute and hour hashes) share
    the namespace's hash tag: one script call on a cluster, read back by the client."""
    cc = Client.from_url(cluster.url(), cluster=True, namespace=f"fl_{uuid.uuid4().hex[:8]}")
    try:
        obs = Observer(cc.client, cc.settings, "pool-cluster")
        for i in range(50):
            obs.job_finished(f"j{i}", f"t.{i % 5}", "failed" if i == 7 else "processed",
                             name=f"t.{i % 5}")
        obs.flush(force_stats=True)
        assert cc.totals() == {"processed": 49, "failed": 1, "retried": 0}
        rows = {r["name"]: (r["processed"], r["failed"]) for r in cc.runtimes("1h")}
        assert rows == {"t.0": (10, 0), "t.1": (10, 0), "t.2": (9, 1), "t.3": (10, 0),
                        "t.4": (10, 0)}
        obs.stop()
    finally:
        cc.client.close()
