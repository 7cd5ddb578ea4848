"""Every promise in every configuration: drop-in or ``install(app)``; prefork, threads, solo;
and faults that strike inside a round trip (the command ran, its reply was lost).

Real server, real ``celery worker`` subprocesses; the faults come from a TCP proxy
between the worker and Redis (``tests/faults/proxy.py``). The jobs record their runs
on the server directly (``CELERY_EXT_RECORD_URL``), so cutting the worker's
connections never cuts the record of what ran.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Iterator
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import pytest
import redis
from celery import Celery

from celery_ext.store import scripts
from celery_ext.store.keys import Keys
from celery_ext.testing.server import RedisServer
from tests.faults.proxy import Proxy
from tests.helpers import MODES, Mode, recorded, wait_for
from tests.workers import WorkerProcess

#: Nothing reads what this module's pools write at a warm stop: teardown SIGKILLs
#: them (worker_factory in tests/conftest.py).
pytestmark = pytest.mark.kill_workers_at_teardown

FAST = {
    "CELERY_EXT_HEARTBEAT_INTERVAL": "0.25",
    "CELERY_EXT_DEAD_AFTER": "1.5",
    "CELERY_EXT_REAP_INTERVAL": "0.5",
    "CELERY_EXT_PROMOTE_INTERVAL": "1.0",
}
KEYS = Keys("celery_ext")
APP = "tests.apps.proj_pools"
Factory = Callable[..., WorkerProcess]


@pytest.fixture
def sender(broker_url: str, redis_client: redis.Redis) -> Iterator[Callable[[str], Mode]]:
    """``sender(name)``: the producer and worker settings of that mode (``Mode``)."""
    made: dict[str, Mode] = {}

    def for_mode(name: str) -> Mode:
        if name not in made:
            made[name] = Mode(name, broker_url)
        return made[name]

    yield for_mode
    for mode in made.values():
        mode.close()


@pytest.fixture
def proxy(redis_server: RedisServer) -> Iterator[Proxy]:
    p = Proxy(("127.0.0.1", redis_server.port)).start()
    yield p
    p.stop()


def via(proxy: Proxy, broker_url: str) -> str:
    """The broker URL with the proxy's port in place of the server's."""
    parts = urlsplit(broker_url)
    return urlunsplit(parts._replace(netloc=f"{parts.hostname}:{proxy.port}"))


def start_worker(factory: Factory, mode: Mode, broker_url: str, *, proxy: Proxy | None = None,
                 env: dict[str, str] | None = None, **kw: Any) -> WorkerProcess:
    env = {**FAST, **mode.env(), **(env or {})}
    url = broker_url
    if proxy is not None:
        env["CELERY_EXT_RECORD_URL"] = broker_url
        url = via(proxy, broker_url)
    return factory(APP, broker_url=url, env=env, **kw).start()


def inflight(client: redis.Redis) -> int:
    return sum(client.hlen(KEYS.inflight(p.decode())) for p in client.zrange(KEYS.pools, 0, -1))


def concurrency(pool: str) -> int:
    """Slots per pool: gevent runs as many greenlets as a user of it would give it."""
    return 50 if pool == "gevent" else 2


def send(mode: Mode, name: str, *args: Any, **options: Any) -> Any:
    return mode.app.send_task(f"tests.apps.proj_pools.{name}", args=args, **options)


# -- drop-in keeps the promises that need no routing ------------------------------------
@pytest.mark.parametrize(("mode", "pool"), [("install", "threads"), ("dropin", "threads"),
                                            ("dropin", "gevent")])
def test_countdown_and_retry_run_from_redis(mode: str, pool: str,
                                            sender: Callable[[str], Mode],
                                            worker_factory: Factory, broker_url: str,
                                            redis_client: redis.Redis,
                                            rec: redis.Redis) -> None:
    """A countdown job and a retry with a countdown wait in the scheduled and retry
    sets and run when due: the requeuer runs in every pool, installed or not."""
    start_worker(worker_factory, sender(mode), broker_url, pool=pool,
                 concurrency=concurrency(pool))
    producer = sender(mode)
    sent_at = time.time()
    later = send(producer, "slow", "countdown", 0.0, countdown=1.5)
    wait_for(lambda: redis_client.zcard(KEYS.scheduled), 5, "the job in the scheduled set")
    retried = send(producer, "retry_once", "retry", 1.0)
    assert later.get(timeout=15) == "countdown"
    assert retried.get(timeout=15) == 1
    (run,) = recorded(rec, "runs", "countdown")
    assert float(run.split(":")[1]) - sent_at >= 1.4
    assert [r.split(":")[2] for r in recorded(rec, "runs", "retry")] == ["0", "1"]
    assert redis_client.zcard(KEYS.scheduled) == 0 and redis_client.zcard(KEYS.retry) == 0


@pytest.mark.parametrize(("mode", "pool"), [("install", "prefork"), ("dropin", "prefork"),
                                            ("install", "gevent")])
def test_sigkilled_pool_is_reaped_and_its_jobs_run_elsewhere(
        mode: str, pool: str, sender: Callable[[str], Mode], worker_factory: Factory,
        broker_url: str, redis_client: redis.Redis, rec: redis.Redis) -> None:
    """No visibility timeout and no install(app): the reaper that every pool runs
    requeues a SIGKILLed pool's jobs, reserved and (acks_late) running. (A gevent pool
    of 2 greenlets, so it too holds jobs it has not started.)"""
    victim = start_worker(worker_factory, sender(mode), broker_url, pool=pool, concurrency=2,
                          hostname="victim@%h")
    producer = sender(mode)
    keys = [f"k{i}" for i in range(6)]
    for k in keys:
        send(producer, "slow_late", k, 1.5)
    wait_for(lambda: sum(len(recorded(rec, "start", k)) for k in keys) >= 2, 10,
             "the victim running two jobs")
    children = victim.child_pids()
    victim.kill()
    for pid in children:
        os.kill(pid, signal.SIGKILL)
    killed_at = time.monotonic()
    start_worker(worker_factory, sender(mode), broker_url, pool="threads", concurrency=6,
                 hostname="survivor@%h")
    wait_for(lambda: all(recorded(rec, "runs", k) for k in keys), 20, "every job to run")
    print(f"kill -> all jobs done in {time.monotonic() - killed_at:.2f}s")
    wait_for(lambda: inflight(redis_client) == 0, 5, "the survivor's acks")


# -- faults inside a round trip ---------------------------------------------------------
@pytest.mark.parametrize(("mode", "pool"), [("install", "prefork"), ("dropin", "threads"),
                                            ("install", "solo"), ("dropin", "prefork"),
                                            ("install", "gevent")])
def test_a_lost_fetch_reply_strands_nothing(mode: str, pool: str,
                                            sender: Callable[[str], Mode],
                                            worker_factory: Factory, broker_url: str,
                                            proxy: Proxy, redis_client: redis.Redis,
                                            rec: redis.Redis) -> None:
    """Redis runs the fetch script and moves jobs into the pool's in-flight record;
    the connection dies before the reply is read. The pool notices, reconnects,
    returns the jobs it never received and fetches again: every job runs once."""
    producer = sender(mode)
    keys = [f"j{i}" for i in range(40)]
    for k in keys:
        send(producer, "slow", k, 0.01)
    proxy.cut_on_reply(scripts.sha("fetch").encode())  # the first fetch, which finds jobs
    worker = start_worker(worker_factory, sender(mode), broker_url, proxy=proxy, pool=pool,
                          concurrency=concurrency(pool))
    wait_for(lambda: proxy.replies_cut, 10, "a fetch reply cut")
    wait_for(lambda: all(recorded(rec, "runs", k) for k in keys), 20,
             "every job to run after the lost reply")
    assert {k: len(recorded(rec, "runs", k)) for k in keys} == dict.fromkeys(keys, 1)
    wait_for(lambda: inflight(redis_client) == 0, 5, "an empty in-flight record")
    assert worker.alive


@pytest.mark.parametrize(("mode", "pool"), [("install", "threads"), ("install", "prefork"),
                                            ("install", "solo"), ("dropin", "gevent")])
def test_a_connection_cut_runs_nothing_twice_and_loses_nothing(
        mode: str, pool: str, sender: Callable[[str], Mode], worker_factory: Factory,
        broker_url: str, proxy: Proxy, redis_client: redis.Redis, rec: redis.Redis) -> None:
    """Every connection of a pool is cut while it runs jobs and holds prefetched ones:
    the jobs it still runs are not also requeued, those it dropped are, and each
    job runs exactly once. (Drop-in with Celery's own acks_late, so a running job is
    still in flight when the connections go.)"""
    worker = start_worker(worker_factory, sender(mode), broker_url, proxy=proxy, pool=pool,
                          concurrency=2, env=sender(mode).env(acks_late=True))
    producer = sender(mode)
    keys = [f"c{i}" for i in range(8)]
    for k in keys:
        send(producer, "slow", k, 0.4)
    wait_for(lambda: any(recorded(rec, "start", k) for k in keys), 10, "a job running")
    proxy.stop()
    time.sleep(0.3)
    proxy.start()
    wait_for(lambda: all(recorded(rec, "runs", k) for k in keys), 30, "every job to run")
    time.sleep(1.0)  # a duplicate would start within this
    assert {k: len(recorded(rec, "start", k)) for k in keys} == dict.fromkeys(keys, 1)
    wait_for(lambda: inflight(redis_client) == 0, 5, "an empty in-flight record")
    assert worker.alive


@pytest.mark.parametrize("pool", ["prefork", "threads", "gevent"])
def test_an_ack_that_never_reached_redis_is_applied_later_not_forgotten(
        pool: str, sender: Callable[[str], Mode], worker_factory: Factory, broker_url: str,
        proxy: Proxy, redis_client: redis.Redis, rec: redis.Redis) -> None:
    """A job finishes; its ack never reaches Redis (its connection is cut before the
    request is forwarded, and reconnecting is refused for a second), while the
    consumer's own connection stays up. The pool keeps the ack and applies it: the
    in-flight record empties, the job never runs again, later jobs run."""
    worker = start_worker(worker_factory, sender("install"), broker_url, proxy=proxy, pool=pool,
                          concurrency=1)
    producer = sender("install")
    proxy.drop_request(scripts.sha("ack").encode(), refuse_for=1.0)
    job = send(producer, "slow", "unacked", 0.3)
    assert job.get(timeout=15) == "unacked"
    wait_for(lambda: proxy.requests_dropped, 5, "the ack dropped")
    wait_for(lambda: inflight(redis_client) == 0, 10, "the ack applied after all")
    assert send(producer, "slow", "after", 0.0).get(timeout=15) == "after"
    time.sleep(1.0)
    assert len(recorded(rec, "start", "unacked")) == 1
    assert worker.alive


@pytest.mark.parametrize(("mode", "pool"), [("install", "prefork"), ("install", "threads"),
                                            ("dropin", "threads"), ("dropin", "solo"),
                                            ("dropin", "gevent")])
def test_a_half_open_connection_is_noticed_and_the_pool_fetches_again(
        mode: str, pool: str, sender: Callable[[str], Mode], worker_factory: Factory,
        broker_url: str, proxy: Proxy, redis_client: redis.Redis, rec: redis.Redis) -> None:
    """Every open connection of an idle pool stops answering without a reset (a
    half-open TCP connection: the fetch's reply never comes, reads block). Within
    ``reply_timeout`` the pool notices, reconnects with one log line, and runs the
    jobs queued meanwhile, each once."""
    worker = start_worker(worker_factory, sender(mode), broker_url, proxy=proxy, pool=pool,
                          concurrency=concurrency(pool), env={"CELERY_EXT_REPLY_TIMEOUT": "2"})
    producer = sender(mode)
    assert send(producer, "slow", "before", 0.0).get(timeout=15) == "before"
    proxy.freeze()
    keys = [f"h{i}" for i in range(5)]
    for k in keys:
        send(producer, "slow", k, 0.0)
    wait_for(lambda: all(recorded(rec, "runs", k) for k in keys), 20,
             "the jobs queued while the connections hung")
    assert {k: len(recorded(rec, "runs", k)) for k in keys} == dict.fromkeys(keys, 1)
    assert worker.alive


@pytest.mark.parametrize("key", ["pool", "pool_cls"])
@pytest.mark.parametrize("pool", ["eventlet", "celery.concurrency.eventlet:TaskPool"])
def test_eventlet_is_refused_with_one_line_and_gevent_runs(pool: str, key: str) -> None:
    """Eventlet stops the worker at start with one line naming gevent, the supported
    green executor, whichever way the executor is named (``celery worker -P`` hands it
    over as "pool", a WorkController made in code as "pool_cls")."""
    from types import SimpleNamespace

    from celery_ext.worker.bootsteps import validate_settings

    app = Celery("refused", broker="celery-ext://127.0.0.1:1/0", set_as_current=False)
    with pytest.raises(SystemExit) as exc:
        validate_settings(instance=SimpleNamespace(app=app), options={key: pool})
    message = str(exc.value)
    assert "not supported" in message and "-P gevent" in message
    assert "\n" not in message
    for runs in ("gevent", "threads"):
        validate_settings(instance=SimpleNamespace(app=app), options={key: runs})


@pytest.mark.parametrize("mode", MODES)
def test_reserved_jobs_dropped_at_a_lost_fetch_reply_run_after_the_reconnect(
        mode: str, sender: Callable[[str], Mode], worker_factory: Factory, broker_url: str,
        proxy: Proxy, redis_client: redis.Redis, rec: redis.Redis) -> None:
    """A prefork pool runs two jobs and holds four reserved when a fetch reply is lost
    (Redis reachable). Celery drops the reserved four only after the channel closed;
    the pool must return them after the reconnect, not count them as held at the
    close and forget them: every job runs, once."""
    worker = start_worker(worker_factory, sender(mode), broker_url, proxy=proxy, pool="prefork",
                          concurrency=2)
    producer = sender(mode)
    first = [f"r{i}" for i in range(6)]
    for i, k in enumerate(first):
        send(producer, "slow_late", k, 2.0 if i < 2 else 0.01)
    wait_for(lambda: len([k for k in first if recorded(rec, "start", k)]) >= 2, 10,
             "two long jobs running, the rest reserved")
    proxy.cut_on_reply(scripts.sha("fetch").encode())
    later = [f"s{i}" for i in range(6)]
    for k in later:
        send(producer, "slow_late", k, 0.01)
    wait_for(lambda: proxy.replies_cut, 10, "a fetch reply cut")
    keys = first + later
    wait_for(lambda: all(recorded(rec, "runs", k) for k in keys), 20,
             "every job, the reserved ones too")
    assert {k: len(recorded(rec, "start", k)) for k in keys} == dict.fromkeys(keys, 1)
    wait_for(lambda: inflight(redis_client) == 0, 5, "an empty in-flight record")
    assert worker.alive
