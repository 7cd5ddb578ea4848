"""AckSender: acks written without waiting for their replies, resent when they failed;
WorkerPool: acks coalesced per turn of the event loop."""

from __future__ import annotations

import os
import threading
import time

import pytest
import redis
from kombu import Connection, Queue
from kombu.asynchronous import Hub
from kombu.transport.virtual import Empty

from celery_ext.config import LOOP_ACKS_PER_CALL, Settings
from celery_ext.store import job_index, scripts
from celery_ext.store.keys import Keys
from celery_ext.testing.server import RedisServer
from celery_ext.worker import ack_batcher
from celery_ext.worker.ack_batcher import AckBatcher
from celery_ext.worker.acks import MAX_UNREAD, AckSender
from celery_ext.worker.worker_pool import WorkerPool
from tests.apps import proj
from tests.helpers import Factory, wait_for
from tests.integration.test_gevent_batching import ScriptCalls

#: Nothing reads what this module's pools write at a warm stop: teardown SIGKILLs
#: them (worker_factory in tests/conftest.py).
pytestmark = pytest.mark.kill_workers_at_teardown

K = Keys("celery_ext")
POOL = "pool-acks"


def _fill(client: redis.Redis, tags: list[str]) -> None:
    for tag in tags:
        client.hset(K.inflight(POOL), tag, "q\n{}")
        client.hincrby(K.running, "q", 1)


def _send(sender: AckSender, tags: list[str]) -> None:
    sender.ack([K.inflight(POOL), K.redelivery, K.running, K.limits, K.ready, K.job_index,
                K.job_index_done], [K.wake_channel, 0, K.cursor_prefix, POOL, *tags], tags)


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


def test_an_ack_is_packed_without_redis_pys_packer(
        redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each ack call's ``EVALSHA`` is packed by hiredis in one call (redis-py's packer took
    13 µs of a prefork main process per ack call against 1.6), and still applies."""
    scripts.Scripts(redis_client).load_all()
    tags = [f"p{i}" for i in range(6)]
    _fill(redis_client, tags)
    sender = AckSender(redis_client.connection_pool, [].extend)
    packer = type(sender._connection()._command_packer)
    packed: list[object] = []
    pack = packer.pack
    monkeypatch.setattr(packer, "pack", lambda self, *args: packed.append(args[0]) or pack(
        self, *args))
    for i in range(0, len(tags), 2):
        _send(sender, tags[i:i + 2])
    sender.close()
    assert "EVALSHA" not in packed, packed  # (the old code: one per ack call)
    assert redis_client.hlen(K.inflight(POOL)) == 0


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


def _processed(client: redis.Redis) -> int:
    """Jobs the pools counted as ended (written within a second while they drain)."""
    return int(client.hget(K.stats, "processed") or 0)


def _evalsha_calls(client: redis.Redis) -> int:
    return int(client.info("commandstats").get("cmdstat_evalsha", {}).get("calls", 0))


def test_acks_of_the_event_loop_thread_wait_for_its_fetch_or_timer_and_go_in_one_call(
        redis_server: RedisServer, redis_client: redis.Redis) -> None:
    """The loop's acks of several turns go in one call: the one its timer makes
    LOOP_ACK_DELAY after the first, or a flush (the fetch's); LOOP_ACKS_PER_CALL of them
    go at the next turn; a job starting in the loop's thread writes them first; another
    thread's ack goes at once; a closed loop writes what it left."""
    scripts.Scripts(redis_client).load_all()
    pool = WorkerPool(redis_server.client, Settings(), "server")
    hub = Hub()
    tags = [f"t{i}" for i in range(LOOP_ACKS_PER_CALL + 4)]
    for tag in tags:
        redis_client.hset(K.inflight(pool.pool_id), tag, "q\n{}")
    try:
        pool.on_loop_tick(hub)  # this thread is now the event loop's
        before = _evalsha_calls(redis_client)
        pool.ack(["t0"])
        pool.on_loop_tick(hub)
        pool.ack(["t1", "t2"])
        pool.on_loop_tick(hub)
        assert _evalsha_calls(redis_client) == before  # nothing written yet...
        assert pool.holdings.held() == {"t0", "t1", "t2"}  # ...but held, never returned
        assert len(hub.timer.queue) == 1  # the poll that follows wakes for them
        wait_for(lambda: hub.fire_timers() is not None
                 and _evalsha_calls(redis_client) == before + 1, 5, "the loop's ack timer")
        pool.acks.flush()
        assert _evalsha_calls(redis_client) == before + 1  # one call for three turns
        assert pool.holdings.held() == set()

        pool.ack(["t3"])  # a fetch to send: the acks go before it
        pool.flush_acks()
        pool.acks.flush()
        assert _evalsha_calls(redis_client) == before + 2
        assert not redis_client.hexists(K.inflight(pool.pool_id), "t3")

        many = tags[4:4 + LOOP_ACKS_PER_CALL]
        for tag in many:
            pool.ack([tag])
        pool.on_loop_tick(hub)  # enough wait: written at this turn, timer or not
        pool.acks.flush()
        assert _evalsha_calls(redis_client) == before + 3
        assert not any(redis_client.hexists(K.inflight(pool.pool_id), t) for t in many)

        pool.ack([tags[-4]])
        pool.before_job()  # a job starts in the loop's thread (a solo pool)
        pool.acks.flush()
        assert _evalsha_calls(redis_client) == before + 4

        other = threading.Thread(target=pool.ack, args=([tags[-3]],))  # a pool thread
        other.start()
        other.join()
        pool.acks.flush()
        assert _evalsha_calls(redis_client) == before + 5  # written at once

        pool.ack([tags[-2], tags[-1]])
        pool.event_loop_gone()  # the loop closed: what it left pending is written
        pool.acks.flush()
        assert redis_client.hlen(K.inflight(pool.pool_id)) == 0
        assert pool.holdings.held() == set()
    finally:
        pool.acks.close()


def test_an_idle_loop_writes_its_acks_at_its_next_turn(
        broker_url: str, redis_server: RedisServer, redis_client: redis.Redis) -> None:
    """A pool with nothing to fetch sends no fetch for the loop's acks to go before: the
    loop's next turn (``Fetcher.start``, idle) writes them, not its timer LOOP_ACK_DELAY
    later, when the next job's wake-up may be arriving (one job at a time to an idle
    pool: a fifth of the jobs met the previous one's ack on their way, issue 36)."""
    scripts.Scripts(redis_client).load_all()
    pool = WorkerPool(redis_server.client, Settings(), "server")
    hub = Hub()
    redis_client.hset(K.inflight(pool.pool_id), "t0", "q\n{}")
    queue = Queue("idle.acks", routing_key="idle.acks")
    try:
        with Connection(broker_url) as conn:
            channel = conn.default_channel
            consumer = conn.Consumer([queue], no_ack=True, callbacks=[])
            consumer.consume()
            conn.transport.cycle._register_BRPOP(channel)  # a fetch: the queue is empty
            assert channel.client.connection.can_read(timeout=5)
            with pytest.raises(Empty):
                channel._brpop_read()
            assert not channel._ready.has_active()  # idle
            channel._worker_pool = pool  # the loop's pool
            pool.on_loop_tick(hub)  # this thread is now the event loop's
            before = _evalsha_calls(redis_client)
            pool.ack(["t0"])
            assert _evalsha_calls(redis_client) == before  # left to a fetch or the timer
            channel.fetcher.start()  # the next turn: nothing to fetch
            pool.acks.flush()
            assert _evalsha_calls(redis_client) == before + 1
            assert not redis_client.hexists(K.inflight(pool.pool_id), "t0")
            assert not channel._in_poll  # and no fetch was sent
            consumer.cancel()
    finally:
        pool.acks.close()


def test_the_event_loops_turns_and_acks_make_no_system_call_to_know_their_process(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The batcher knows its process without ``os.getpid`` (a system call): it was one
    call per turn of the loop and one per ack made in the loop's thread, about three per
    job in a prefork pool's main process. A forked child's copy still knows it is not the
    loop's process: its acks are written at once."""
    written: list[list[str]] = []
    batcher = AckBatcher(written.append, green=False)
    calls = 0
    getpid = os.getpid

    def counting_getpid() -> int:
        nonlocal calls
        calls += 1
        return getpid()

    hub = Hub()
    try:
        monkeypatch.setattr(ack_batcher.os, "getpid", counting_getpid)
        for i in range(50):
            batcher.on_loop_tick(hub)
            batcher.add([f"t{i}"])  # the loop's thread: waits for the loop's write
        assert calls == 0  # (the old code: 100)
        monkeypatch.undo()
        assert [len(b) for b in written] == [16, 16, 16]  # (a turn finding 16 waiting)
        batcher.event_loop_gone()  # what it left is written
        assert [t for batch in written for t in batch] == [f"t{i}" for i in range(50)]
        batcher.on_loop_tick(hub)
        read_end, write_end = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: not the loop's process, whatever its thread
            try:
                before = len(written)
                batcher.add(["child"])
                os.write(write_end, b"1" if written[before:] == [["child"]] else b"0")
            finally:
                os._exit(0)
        os.close(write_end)
        assert os.read(read_end, 1) == b"1"
        os.waitpid(pid, 0)
        os.close(read_end)
    finally:
        hub.close()


def test_stopping_waits_for_an_ack_write_under_way_in_another_thread(
        redis_server: RedisServer, redis_client: redis.Redis) -> None:
    """An ack made while another thread writes goes in that thread's next call; a pool
    that stops (and then returns what is left in its record) waits for it."""
    scripts.Scripts(redis_client).load_all()
    pool = WorkerPool(redis_server.client, Settings(), "server")
    for tag in ("a", "b"):
        redis_client.hset(K.inflight(pool.pool_id), tag, "q\n{}")
    writing, release = threading.Event(), threading.Event()
    send = pool.acks.ack

    def slow_send(keys: list[str], args: list[object], tags: list[str]) -> None:
        writing.set()
        release.wait(10)
        send(keys, args, tags)

    pool.acks.ack = slow_send  # type: ignore[method-assign]
    writer = threading.Thread(target=pool.ack, args=(["a"],))
    writer.start()
    try:
        assert writing.wait(10)
        pool.ack(["b"])  # the writer thread is busy: "b" goes in its next call
        threading.Timer(0.3, release.set).start()
        pool.event_loop_gone()  # what stopping does before it returns what is left
        pool.acks.flush()
        assert redis_client.hlen(K.inflight(pool.pool_id)) == 0
    finally:
        release.set()
        writer.join(10)
        pool.acks.close()


def test_acks_of_many_greenlets_at_once_all_apply(broker_url: str, redis_client: redis.Redis,
                                                  rec: redis.Redis,
                                                  worker_factory: Factory) -> None:
    """A gevent pool of 100 greenlets acks (acks_late) from each job's greenlet, many in
    the same instant, through the pool's one ack connection: every ack is applied (the
    in-flight record and the running count return to 0), no job runs twice, and no
    ack is left for the fallback to resend."""
    proj.configure(broker_url)
    from tests.apps import proj_pools

    worker = worker_factory("tests.apps.proj_pools", pool="gevent", concurrency=100).start()
    n = 1000
    with proj.app.producer_or_acquire() as producer:
        for _ in range(n):
            proj_pools.slow.apply_async(("acks", 0.02), producer=producer)
    wait_for(lambda: rec.llen("runs:acks") >= n, 60, f"the {n} jobs")
    queue = proj_pools.slow.name
    wait_for(lambda: int(redis_client.hget(K.running, queue) or 0) == 0, 10,
             "the running count back to 0")
    pools = [p.decode() for p in redis_client.zrange(K.pools, 0, -1)]
    assert sum(redis_client.hlen(K.inflight(p)) for p in pools) == 0
    time.sleep(0.5)  # a job acked too late to count would run again now
    assert rec.llen("start:acks") == n and rec.llen("runs:acks") == n
    assert "could not" not in worker.log_text() and "Traceback" not in worker.log_text()


@pytest.mark.parametrize("mode", ["dropin", "install"])  # acks early / acks late
def test_a_prefork_pool_fetches_and_writes_the_acks_of_several_jobs_per_call(
        broker_url: str, redis_server: RedisServer, redis_client: redis.Redis,
        rec: redis.Redis, worker_factory: Factory, mode: str) -> None:
    """A prefork pool's main process sees each job's accept (acks early) or result (acks
    late) in a turn of its event loop of its own: written at each turn, its acks took
    about one call per job (0.91 in bench.profile). They wait for the next fetch or the
    loop's timer now, several per call; every one is written all the same, the last by
    the timer of a loop gone idle. A busy pool's fetch waits for half its prefetch window
    (-c 2, multiplier 4: 4 of 8 slots), not a pool's worth (2 of 8): 0.5 fetch calls
    per job before, about 0.25 now, and the acks written before each fetch fewer calls
    with them."""
    proj.configure(broker_url)
    jobs = 1000
    with proj.app.producer_or_acquire() as producer:
        for _ in range(jobs):
            # (a drop-in worker consumes Celery's default queue)
            proj.noop.apply_async(producer=producer,
                                  queue="celery" if mode == "dropin" else None)
    env = {"CELERY_EXT_NO_INSTALL": "1"} if mode == "dropin" else {}
    with ScriptCalls(redis_server, ("ack", "fetch")) as calls:
        worker_factory("tests.apps.proj", pool="prefork", concurrency=2, env=env).start()
        wait_for(lambda: _processed(redis_client) == jobs, 120, f"the {jobs} jobs")
        pools = [p.decode() for p in redis_client.zrange(K.pools, 0, -1)]
        wait_for(lambda: sum(redis_client.hlen(K.inflight(p)) for p in pools) == 0, 5,
                 "every ack written")
    print(f"ack and fetch calls for {jobs} jobs ({mode}): {calls.calls}")
    assert calls.calls["ack"] <= 0.85 * jobs, calls.calls
    assert calls.calls["fetch"] <= 0.35 * jobs, calls.calls


def test_a_solo_pool_writes_a_jobs_ack_before_the_next_job_runs(
        broker_url: str, redis_client: redis.Redis, worker_factory: Factory) -> None:
    """A solo pool runs its jobs in the event loop's thread. Two jobs fetched together:
    the first one's ack (acks late, install's default) is written before the second
    starts, not after its whole run (it waited for the loop's next turn, which comes
    when the second job ends)."""
    proj.configure(broker_url)
    first = proj.record.delay("solo-first")
    second = proj.record.delay("solo-second", sleep=6)
    worker_factory("tests.apps.proj", pool="solo", concurrency=1).start()
    wait_for(lambda: proj.app.AsyncResult(second.id).state == "STARTED", 30,
             "the second job running")
    entry = wait_for(lambda: (lambda e: e if e and e["state"] == "done" else None)(
        job_index.lookup(redis_client, K, first.id)), 3, "the first job's entry done")
    assert proj.app.AsyncResult(second.id).state == "STARTED", entry
