"""Redis Sentinel: ``celery-ext+sentinel://`` URLs, and a primary killed while jobs flow.

One group per module (a primary, a replica, three sentinels, from the same server
binary as the other tests; a killed primary is replaced in about 3 s). Jobs record
their runs on the session server, outside the group, so a failover cannot lose the
records. The failover test reports, with and without ``wait_replicas``, the jobs lost
(enqueue returned, never ran), run twice, and how long the parts took to follow the
new primary; it asserts no loss only where it is promised (with ``WAIT``).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from itertools import pairwise
from typing import Any

import pytest
import redis
from celery import Celery
from kombu import Connection

import celery_ext
from celery_ext.client import Client
from celery_ext.config import ConfigError, check_broker_url, uses_our_transport
from celery_ext.errors import NotReplicated
from celery_ext.store.connections import client_from_url, connections_for, sentinel_config
from celery_ext.testing.server import RedisServer, SentinelGroup
from celery_ext.transport.channel import Transport
from tests.helpers import Factory, celery_cli, start_workers, wait_for

MASTER = "mymaster"
#: Worker timings shrunk so that a killed pool is reaped within about 3 s.
FAST = {"CELERY_EXT_HEARTBEAT_INTERVAL": "0.5", "CELERY_EXT_DEAD_AFTER": "2",
        "CELERY_EXT_REAP_INTERVAL": "0.5"}


# -- URLs and options (no server) ---------------------------------------------------------
def test_sentinel_url_is_read_like_kombus() -> None:
    url = ("celery-ext+sentinel://:s%40cret@h1:26380/3;celery-ext+sentinel://h2;"
           "celery-ext+sentinel://h3:26390")
    config = sentinel_config([url], {"master_name": "m", "sentinel_kwargs": {"password": "x"},
                                     "min_other_sentinels": 1})
    assert config is not None
    assert config.sentinels == (("h1", 26380), ("h2", 26379), ("h3", 26390))
    assert (config.master_name, config.db, config.password, config.tls) == ("m", 3, "s@cret",
                                                                             False)
    assert config.sentinel_kwargs == {"password": "x"} and config.min_other_sentinels == 1
    assert config.server_id == "sentinel:m/3"
    tls = sentinel_config(["celery-exts+sentinel://h1"], {"master_name": "m"})
    assert tls is not None and tls.tls
    assert sentinel_config(["celery-ext://h1:6379/0"], {"master_name": "m"}) is None
    with pytest.raises(ConfigError, match="master_name"):
        sentinel_config(["celery-ext+sentinel://:pw@h1"], {})
    with pytest.raises(ConfigError, match="db") as err:
        sentinel_config(["celery-ext+sentinel://:pw@h1/x"], {"master_name": "m"})
    assert "pw" not in str(err.value)


def test_sentinel_scheme_selects_our_transport() -> None:
    url = "celery-ext+sentinel://h1:26379;celery-ext+sentinel://h2:26380"
    conn = Connection(url, transport_options={"master_name": "m"})
    assert conn.transport_cls == "celery-ext" and isinstance(conn.transport, Transport)
    conn.maybe_switch_next()  # Kombu's failover to the next URL keeps our transport
    assert isinstance(conn.transport, Transport)
    check_broker_url(url)
    app = Celery(set_as_current=False, broker=url)
    assert uses_our_transport(app.conf)
    assert celery_ext.TRANSPORT


# -- a real group ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def group() -> Iterator[SentinelGroup]:
    with SentinelGroup(master_name=MASTER, down_after_ms=1500, failover_timeout_ms=2000) as g:
        yield g


@pytest.fixture
def sentinel_url(group: SentinelGroup) -> str:
    primary = wait_for(group.master_server, 15, "a primary")
    with primary.client() as c:
        c.flushall()
    return group.url()


def worker_env(redis_server: RedisServer, **extra: str) -> dict[str, str]:
    return {"CELERY_EXT_MASTER_NAME": MASTER, "CELERY_EXT_RECORD_URL": redis_server.url(),
            **FAST, **extra}


def producer_app(url: str, **options: Any) -> Celery:
    app = Celery("producer", broker=url, set_as_current=False)
    app.conf.broker_transport_options = {"master_name": MASTER, **options}
    app.conf.task_ignore_result = True
    celery_ext.install(app)
    return app


def runs(rec: redis.Redis, keys: list[str]) -> list[int]:
    with rec.pipeline(transaction=False) as pipe:
        for key in keys:
            pipe.llen(f"runs:{key}")
        return [int(n) for n in pipe.execute()]


def test_readonly_from_a_demoted_master_is_a_connection_error(group: SentinelGroup,
                                                              sentinel_url: str) -> None:
    """A connection still on a server that became a replica gets READONLY: ours turns
    it into a ConnectionError and drops the connection, so the caller reconnects (to the
    primary the sentinels name) instead of failing the job."""
    config = sentinel_config([sentinel_url], {"master_name": MASTER})
    pool = connections_for({"socket_timeout": 2.0}, config)
    replica = next(s for s in group.servers if s is not group.master_server())
    conn = pool.get_connection()
    try:
        conn.disconnect()
        conn.connect_to((replica.host, replica.port))  # where a demoted master would be
        conn.send_command("EVAL", "return redis.call('SET', KEYS[1], '1')", 1, "k")
        with pytest.raises(redis.ConnectionError, match="slave"):
            conn.read_response()
        assert conn._sock is None  # dropped: the next use asks the sentinels again
    finally:
        pool.release(conn)
    client = redis.Redis(connection_pool=pool)
    assert client.eval("return redis.call('SET', KEYS[1], '1')", 1, "k")
    pool.disconnect()


def test_worker_without_master_name_stops_with_one_line(sentinel_url: str) -> None:
    out = celery_cli("-A", "tests.apps.proj", "worker", "--loglevel=INFO", broker_url=sentinel_url,
                     env={"CELERY_EXT_MASTER_NAME": ""})
    assert out.returncode != 0
    assert "master_name" in out.stderr and "Traceback" not in out.stderr, out.stderr


def test_worker_cli_and_client_through_sentinels(group: SentinelGroup, sentinel_url: str,
                                                 redis_server: RedisServer, rec: redis.Redis,
                                                 worker_factory: Factory) -> None:
    env = worker_env(redis_server)
    [worker] = start_workers(worker_factory, 1, app="tests.apps.proj", broker_url=sentinel_url,
                             env=env)
    app = producer_app(sentinel_url)
    keys = [f"e2e:{time.monotonic_ns()}:{i}" for i in range(5)]
    for key in keys:
        app.send_task("tests.apps.proj.record", args=[key])
    wait_for(lambda: all(runs(rec, keys)), 30, "the jobs to run")
    client = Client.from_url(sentinel_url, master_name=MASTER)
    # The pool writes its counters about once a second, not at each job's end.
    wait_for(lambda: client.totals()["processed"] >= len(keys), 10, "the counters")
    pools = client.worker_pools()
    assert [p["pid"] for p in pools] == [worker.pid]
    out = celery_cli("-A", "tests.apps.proj", "ext", "status", "--json", broker_url=sentinel_url,
                     env=env)
    assert out.returncode == 0, out.stderr
    status = json.loads(out.stdout)
    assert status["summary"]["processed"] >= len(keys) and len(status["pools"]) == 1
    with app.connection_for_write() as conn:
        assert conn.default_channel.server_id == f"sentinel:{MASTER}/0"
    assert client_from_url(sentinel_url, {"master_name": MASTER}).ping()


def test_enqueue_waits_for_a_replica(group: SentinelGroup, sentinel_url: str) -> None:
    """wait_replicas: the publish returns once a replica has the job; asking for more
    replicas than exist raises NotReplicated (the job is on the primary)."""
    client = Client.from_url(sentinel_url, master_name=MASTER)
    app = producer_app(sentinel_url, wait_replicas=1, wait_timeout_ms=2000)
    app.send_task("tests.apps.proj.record", args=["replicated"])
    replica = next(s for s in group.servers if s is not group.master_server())
    with replica.client() as c:
        assert c.llen(client.keys.queue("tests.apps.proj.record")) == 1  # there at once
    too_many = producer_app(sentinel_url, wait_replicas=2, wait_timeout_ms=50)
    with pytest.raises(NotReplicated, match="1 of 2 replica"):
        too_many.send_task("tests.apps.proj.record", args=["written anyway"])
    assert client.client.llen(client.keys.queue("tests.apps.proj.record")) == 2


@pytest.mark.parametrize("wait", [False, True], ids=["async", "wait_replicas"])
def test_primary_killed_while_jobs_flow(group: SentinelGroup, sentinel_url: str,
                                        redis_server: RedisServer, rec: redis.Redis,
                                        worker_factory: Factory, wait: bool) -> None:
    """SIGKILL the primary while a producer enqueues and two pools run jobs: both pools,
    the producer, the Client and the reaper go on with the new primary."""
    env = worker_env(redis_server)
    a, b = start_workers(worker_factory, 2, app="tests.apps.proj", broker_url=sentinel_url,
                         env=env)
    options = {"wait_replicas": 1, "wait_timeout_ms": 1000} if wait else {}
    app = producer_app(sentinel_url, **options)
    tag = f"fo:{wait}:{time.monotonic_ns()}"
    total, kill_at = 300, 100
    confirmed: dict[int, float] = {}  # job -> when its publish returned
    unconfirmed: list[int] = []  # NotReplicated: on the primary only
    attempts: dict[int, int] = {}
    sent = threading.Event()

    def produce() -> None:
        for i in range(total):
            while True:
                attempts[i] = attempts.get(i, 0) + 1
                try:
                    app.send_task("tests.apps.proj.record", args=[f"{tag}:{i}"])
                except NotReplicated:
                    unconfirmed.append(i)
                except Exception:  # the publish failed (Celery retried it already)
                    time.sleep(0.05)
                    continue
                else:
                    confirmed[i] = time.time()
                break
            if i == kill_at:
                sent.set()
            time.sleep(0.01)

    producer = threading.Thread(target=produce, daemon=True)
    producer.start()
    assert sent.wait(60)
    old = group.master_server()
    assert old is not None
    killed_at = time.time()
    old.kill()
    wait_for(lambda: group.master() not in (None, (old.host, old.port)), 30,
             "the sentinels to promote the replica")
    promoted = time.time() - killed_at
    group.rejoin(old)  # the crashed node comes back as a replica
    client = Client.from_url(sentinel_url, master_name=MASTER)
    wait_for(lambda: _answers(client), 30, "the Client to reach the new primary")
    client_back = time.time() - killed_at
    producer.join(120)
    assert not producer.is_alive()

    keys = [f"{tag}:{i}" for i in range(total)]
    # Settle: every confirmed job ran, or none ran for a while (those are lost).
    last, still = None, time.monotonic()
    while True:
        counts = runs(rec, keys)
        missing = [i for i in confirmed if not counts[i]]
        if not missing or time.monotonic() - still > 8:
            break
        if missing != last:
            last, still = missing, time.monotonic()
        time.sleep(0.2)
    twice = [i for i, n in enumerate(counts) if n > 1]
    # The first run of a job enqueued once the new primary was named: the pools consume
    # from it (jobs prefetched before the kill run on without Redis).
    first_after = min((float(v.decode().split(":")[1]) for i, at in confirmed.items()
                       if at > killed_at + promoted
                       for v in rec.lrange(f"runs:{tag}:{i}", 0, -1)), default=None)
    gaps = sorted(confirmed.values())
    blocked = max((b - a for a, b in pairwise(gaps)), default=0.0)
    print(f"\nsentinel failover ({'wait_replicas=1' if wait else 'async replication'}): "
          f"{len(confirmed)} confirmed, {len(unconfirmed)} NotReplicated, "
          f"{sum(attempts.values()) - total} publish retries; lost {len(missing)}, "
          f"run twice {len(twice)}; promoted after {promoted:.1f}s, client back after "
          f"{client_back:.1f}s, first job enqueued after that ran {first_after - killed_at:.1f}s "
          "after the kill, "
          f"producer blocked at most {blocked:.1f}s" if first_after else "no job ran after")

    assert first_after is not None  # the pools consume from the new primary
    if wait:
        assert missing == []  # a confirmed enqueue survives the failover
    # What is guaranteed either way: every job confirmed once the new primary was in
    # place ran (jobs confirmed before may have been lost with the old primary).
    after = [i for i in missing if confirmed[i] > killed_at + promoted]
    assert after == [], after
    # Both pools heartbeat on the new primary...
    pools = wait_for(lambda: _fresh_pools(client, 2), 15, "both pools to heartbeat there")
    assert {p["pid"] for p in pools} == {a.pid, b.pid}
    # ...and the reaper there declares a pool killed after the failover dead.
    b.kill()
    wait_for(lambda: [p["pid"] for p in client.worker_pools()] == [a.pid], 20,
             "the surviving pool's reaper to reap the killed one")


def _answers(client: Client) -> bool:
    try:
        client.worker_pools()
    except redis.RedisError:
        return False
    return True


def _fresh_pools(client: Client, n: int) -> list[Any]:
    try:
        pools = client.worker_pools()
    except redis.RedisError:
        return []
    fresh = [p for p in pools if p["state"] == "running" and (p["heartbeat_age"] or 9) < 1.5]
    return fresh if len(fresh) == n else []


def test_flower_broker_page_through_sentinels(sentinel_url: str) -> None:
    """Flower's broker page (queue lengths) reads the primary the sentinels name."""
    import asyncio

    import flower.utils.broker as fb

    from celery_ext.admin.flower import enable

    enable()  # what Flower's config line does in the Flower process
    producer_app(sentinel_url).send_task("tests.apps.proj.record", args=["flower"])
    broker = fb.Broker(sentinel_url, broker_options={"master_name": MASTER})
    [queue] = asyncio.run(broker.queues(["tests.apps.proj.record"]))
    assert (queue["name"], queue["messages_ready"]) == ("tests.apps.proj.record", 1)
