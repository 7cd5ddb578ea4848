"""Workers and producers on a real 3-master Redis Cluster (issue 13): job queues spread
over the masters, every configuration (install and drop-in; prefork, threads, solo)
runs each job exactly once, and a master killed while jobs flow (its replica takes
over) loses no job and strands none.

The cluster (tests/conftest.py) is shared by the session: each test has a namespace of
its own. Tasks record their runs on the one-node test server (a cluster has no db 3).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery

import celery_ext
import celery_ext.client
from celery_ext.store.connections import cluster_client, cluster_config
from celery_ext.store.keys import Keys
from celery_ext.testing.server import ClusterGroup, RedisServer
from tests.helpers import wait_for
from tests.webutil import env_for, free_port, stop_all
from tests.workers import ManagedProcess, WorkerProcess

APP = "tests.apps.proj_cluster"
NAMES = 30  # tests/apps/proj_cluster.py: job0 ... job29


@pytest.fixture
def namespace() -> str:
    return "cl" + uuid.uuid4().hex[:8]


@pytest.fixture
def records(redis_server: RedisServer) -> Iterator[tuple[str, redis.Redis]]:
    """Where tasks record their runs: db 3 of the one-node server, emptied first."""
    url = redis_server.url(db=3)
    client = redis.Redis.from_url(url)
    client.flushdb()
    yield url, client
    client.close()


def producer(url: str, namespace: str, install: bool) -> Celery:
    """A user's app publishing to the cluster: ``install(app)`` or only the URL."""
    app = Celery("producer", broker=url)
    app.conf.broker_transport_options = {"cluster": True, "namespace": namespace}
    app.conf.task_ignore_result = True
    if install:
        celery_ext.install(app)
    return app


def runs(rec: redis.Redis, name: str, n: int) -> list[int]:
    values = rec.mget([f"runs:{name}:{i}" for i in range(n)])
    return [int(v or 0) for v in values]


def cluster_rc(url: str) -> Any:
    config = cluster_config([url], {"cluster": True})
    assert config is not None
    return cluster_client(config, {"socket_timeout": 5.0})


def leftovers(rc: Any, namespace: str, queues: list[str]) -> dict[str, int]:
    """Jobs still in a job queue or an in-flight record of any pool, per queue."""
    k = Keys(namespace, cluster=True)
    out: dict[str, int] = {}
    for q in queues:
        copy = k.of(q)
        n = sum(rc.llen(key) for key in copy.queue_levels(q, (0,)))
        for pool in rc.zrange(copy.pools, 0, -1) or []:
            n += rc.hlen(copy.inflight(pool.decode()))
        if n:
            out[q] = n
    return out


@pytest.mark.parametrize("pool", ["prefork", "threads", "solo"])
@pytest.mark.parametrize("mode", ["install", "dropin"])
def test_every_configuration_runs_each_job_once(
        cluster: ClusterGroup, namespace: str, records: tuple[str, redis.Redis],
        worker_factory: Callable[..., WorkerProcess], mode: str, pool: str) -> None:
    record_url, rec = records
    url = cluster.url()
    install = mode == "install"
    env = {"CELERY_EXT_NAMESPACE": namespace, "CELERY_EXT_RECORD_URL": record_url}
    if not install:
        env["CELERY_EXT_NO_INSTALL"] = "1"
    worker_factory(APP, broker_url=url, pool=pool, concurrency=4 if pool == "threads" else 2,
                   env=env).start(timeout=60)
    app = producer(url, namespace, install)
    per_name = 4
    for i in range(per_name):
        for n in range(NAMES):
            app.send_task(f"{APP}.job{n}", (i,))
    total = per_name * NAMES
    wait_for(lambda: int(rec.get("done") or 0) >= total, 60, f"{total} jobs done")
    for n in range(NAMES):
        assert runs(rec, f"job{n}", per_name) == [1] * per_name, f"job{n}"
    rc = cluster_rc(url)
    try:
        queues = [f"{APP}.job{n}" for n in range(NAMES)] if install else ["celery"]
        k = Keys(namespace, cluster=True)
        if install:
            # One job queue per job name, each in its own copy of the layout: the copies
            # the pool joined are spread over all three masters.
            assert {cluster.master_of(k.of(q).pools) for q in queues} == set(
                cluster.master_servers())
        assert wait_for(lambda: not leftovers(rc, namespace, queues), 10,
                        "every in-flight record emptied by its acks")
        assert rc.sismember(k.queues, queues[0])  # the home registry knows the queues
    finally:
        rc.close()


def test_master_killed_while_jobs_flow_loses_none_and_strands_none(
        cluster: ClusterGroup, namespace: str, records: tuple[str, redis.Redis],
        worker_factory: Callable[..., WorkerProcess]) -> None:
    """The master holding the most job queues is SIGKILLed mid-drain; its replica takes
    over. Every job runs (a fetch or ack the dead master had not replicated runs a job
    again: at-least-once), no job is left in a queue or an in-flight record, and the
    producer publishes to the promoted master."""
    record_url, rec = records
    url = cluster.url()
    app = producer(url, namespace, install=True)
    per_name = 20
    for i in range(per_name):
        for n in range(NAMES):
            app.send_task(f"{APP}.job{n}", (i,), kwargs={"sleep": 0.005})
    for master in cluster.master_servers():  # the enqueues are on the replicas too
        with master.client() as c:
            assert c.wait(1, 5000) == 1
    k = Keys(namespace, cluster=True)
    queues = [f"{APP}.job{n}" for n in range(NAMES)]
    load: dict[RedisServer, int] = {}
    for q in queues:
        owner = cluster.master_of(k.of(q).queue(q))
        load[owner] = load.get(owner, 0) + 1
    victim = max(load, key=lambda s: load[s])
    env = {"CELERY_EXT_NAMESPACE": namespace, "CELERY_EXT_RECORD_URL": record_url}
    worker = worker_factory(APP, broker_url=url, pool="threads", concurrency=4, env=env)
    worker.start(timeout=60)
    total = per_name * NAMES
    rc = cluster_rc(url)
    try:
        wait_for(lambda: int(rec.get("done") or 0) >= total // 5, 60, "a fifth of the jobs done")
        cluster.kill_master(victim)
        cluster.wait_promoted(victim)
        # The producer reaches the promoted master (redis-py refreshes the slot map).
        after = 2
        for i in range(per_name, per_name + after):
            for n in range(NAMES):
                wait_for(lambda n=n, i=i: _published(app, n, i), 30, f"job{n}[{i}] published")
        wait_for(lambda: all(min(runs(rec, f"job{n}", per_name + after)) >= 1
                             for n in range(NAMES)), 120, "every job run after the failover")
        assert wait_for(lambda: not leftovers(rc, namespace, queues), 60,
                        "no job left in a queue or an in-flight record")
        counts = [c for n in range(NAMES) for c in runs(rec, f"job{n}", per_name + after)]
        print(f"failover of a master with {load[victim]} of {NAMES} job queues: "
              f"{len(counts)} jobs, 0 lost, {sum(c - 1 for c in counts)} run twice or more")
        assert worker.alive
    finally:
        rc.close()
        victim.start()  # it rejoins from its nodes.conf, as a replica of the promoted one
        wait_for(lambda: cluster.healthy() and len(cluster.replica_servers()) == 3, 30,
                 "the killed master to rejoin as a replica")


def _published(app: Celery, n: int, i: int) -> bool:
    try:
        app.send_task(f"{APP}.job{n}", (i,))
    except Exception:  # the failover is still settling: the caller tries again
        return False
    return True


def test_sigkilled_pool_jobs_go_back_to_their_queues(
        cluster: ClusterGroup, namespace: str, records: tuple[str, redis.Redis],
        worker_factory: Callable[..., WorkerProcess]) -> None:
    """A pool SIGKILLed while it holds jobs of job queues on every master: the other
    pool's reaper returns them to the front of their queues and they run."""
    record_url, rec = records
    url = cluster.url()
    env = {"CELERY_EXT_NAMESPACE": namespace, "CELERY_EXT_RECORD_URL": record_url,
           "CELERY_EXT_HEARTBEAT_INTERVAL": "0.5", "CELERY_EXT_DEAD_AFTER": "2",
           "CELERY_EXT_REAP_INTERVAL": "0.5"}
    victim = worker_factory(APP, broker_url=url, pool="threads", concurrency=8, env=env)
    victim.start(timeout=60)
    app = producer(url, namespace, install=True)
    names = range(0, NAMES, 3)  # ten job queues, on every master
    rec.set("hold", 1)  # the jobs wait while this key exists
    for n in names:
        app.send_task(f"{APP}.job{n}", (0,), kwargs={"hold": "hold"})
    k = Keys(namespace, cluster=True)
    rc = cluster_rc(url)
    try:
        def held() -> int:
            return sum(rc.hlen(k.of(f"{APP}.job{n}").inflight(p.decode()))
                       for n in names for p in rc.zrange(k.of(f"{APP}.job{n}").pools, 0, -1))
        wait_for(lambda: held() == len(names), 30, "the victim holding every job")
        assert {cluster.master_of(k.of(f"{APP}.job{n}").queue("x")) for n in names} == set(
            cluster.master_servers())
        victim.kill()
        rescuer = worker_factory(APP, broker_url=url, pool="threads", concurrency=4, env=env)
        rescuer.start(timeout=60)
        rec.delete("hold")  # (the victim is gone: only the rescuer can run them now)
        wait_for(lambda: int(rec.get("done") or 0) >= len(names), 60, "every job run again")
        for n in names:
            assert runs(rec, f"job{n}", 1) == [1], f"job{n}"
        recovered = sum(int(rc.hget(k.of(f"{APP}.job{n}").stats, "recovered") or 0)
                        for n in names)
        assert recovered == len(names)
    finally:
        rc.close()


def test_scheduled_retry_and_dead_jobs_on_a_cluster(
        cluster: ClusterGroup, namespace: str, records: tuple[str, redis.Redis],
        worker_factory: Callable[..., WorkerProcess]) -> None:
    """Countdown jobs wait in their queue's scheduled set, a failed try in its retry
    set, a failed job in its dead set: the requeuer promotes across the masters, and
    the client lists the dead job and retries it."""
    record_url, rec = records
    url = cluster.url()
    env = {"CELERY_EXT_NAMESPACE": namespace, "CELERY_EXT_RECORD_URL": record_url,
           "CELERY_EXT_PROMOTE_INTERVAL": "0.5"}
    worker_factory(APP, broker_url=url, pool="threads", concurrency=4, env=env).start(timeout=60)
    app = producer(url, namespace, install=True)
    for i in range(10):
        app.send_task(f"{APP}.later", (i,), countdown=1.5)
        app.send_task(f"{APP}.flaky", (i,))
    app.send_task(f"{APP}.boom", (7,))
    wait_for(lambda: min(runs(rec, "later", 10)) >= 1 and min(runs(rec, "flaky", 10)) >= 1,
             60, "countdown and retried jobs run")
    assert runs(rec, "later", 10) == [1] * 10 and runs(rec, "flaky", 10) == [1] * 10
    client = celery_ext.client.Client.for_app(app)
    try:
        dead = wait_for(lambda: client.dead()["items"], 30, "the failed job in the dead set")
        assert [j["name"] for j in dead] == [f"{APP}.boom"]
    finally:
        client.client.close()


def test_flower_and_unique_jobs_on_a_cluster(
        cluster: ClusterGroup, namespace: str, records: tuple[str, redis.Redis],
        worker_factory: Callable[..., WorkerProcess], tmp_path: Path) -> None:
    """Flower sees the pool and the true length of a paused job queue (its copy on
    its own master); a unique job enqueued twice runs once."""
    record_url, rec = records
    url = cluster.url()
    env = {"CELERY_EXT_NAMESPACE": namespace, "CELERY_EXT_RECORD_URL": record_url}
    worker = worker_factory(APP, broker_url=url, pool="threads", concurrency=2, env=env)
    worker.start(timeout=60)
    app = producer(url, namespace, install=True)
    client = celery_ext.client.Client.for_app(app)
    port = free_port()
    # Flower's config line (docs/dashboard.md), in flowerconfig.py where Flower runs.
    (tmp_path / "flowerconfig.py").write_text(
        "from celery_ext.admin.flower import enable; enable()\n")
    flower = ManagedProcess(
        [sys.executable, "-m", "celery", "-A", APP, "flower", f"--port={port}",
         "--address=127.0.0.1"], log_path=tmp_path / "flower.log", cwd=tmp_path,
        env=env_for(url, FLOWER_UNAUTHENTICATED_API="1", **env), ready_pattern=r"Visit me at")
    base = f"http://127.0.0.1:{port}"
    paused = f"{APP}.job4"
    try:
        client.pause(paused)
        for i in range(4):
            app.send_task(paused, (i,))
        # The producer's own declaration of the task carries its options (unique=True).
        unique = app.task(name=f"{APP}.unique", unique=True)(_declared)
        # Paused while both are sent: the first cannot run and release its lock before
        # the second arrives (a loaded CI run did that, and ran both).
        client.pause(unique.name)
        unique.delay(1)
        unique.delay(1)
        client.resume(unique.name)
        flower.start(timeout=30)
        wait_for(lambda: worker.hostname.split("@")[0] in str(_get_json(
            base, "/api/workers?refresh=1")), 30, "Flower to see the worker")
        lengths = {q["name"]: q for q in _get_json(base, "/api/queues/length")["active_queues"]}
        assert lengths[paused]["messages_ready"] == 4
        wait_for(lambda: runs(rec, "unique", 2)[1] >= 1, 30, "the unique job run")
        client.resume(paused)
        wait_for(lambda: min(runs(rec, "job4", 4)) >= 1, 30, "the paused queue drained")
        assert runs(rec, "unique", 2) == [0, 1]  # enqueued twice, run once
    finally:
        client.resume(paused)
        client.client.close()
        stop_all([flower])


def _declared(i: int) -> None:
    """The producer's declaration of a task the worker runs (never run here)."""


def _get_json(base: str, path: str) -> Any:
    with urllib.request.urlopen(base + path, timeout=10) as r:
        return json.loads(r.read().decode())


def test_periodic_jobs_run_once_per_due_time_on_a_cluster(
        cluster: ClusterGroup, namespace: str, records: tuple[str, redis.Redis],
        worker_factory: Callable[..., WorkerProcess]) -> None:
    """Two pools run a 1-second ``beat_schedule`` entry with the publish marker off: the
    leader enqueues each due time once (enqueued in the job queue's copy, recorded on the
    home entry); SIGKILLed, the other pool takes over within its ``dead_after`` and
    still enqueues each due time once."""
    record_url, rec = records
    url = cluster.url()
    env = {"CELERY_EXT_NAMESPACE": namespace, "CELERY_EXT_RECORD_URL": record_url,
           "TEST_PERIODIC": "1", "CELERY_EXT_PROMOTE_INTERVAL": "0.5",
           "CELERY_EXT_HEARTBEAT_INTERVAL": "0.5", "CELERY_EXT_DEAD_AFTER": "2",
           "CELERY_EXT_PUBLISH_IDEMPOTENCY_TTL": "0"}
    workers = [worker_factory(APP, broker_url=url, pool="threads", concurrency=2, env=env)
               for _ in range(2)]
    for w in workers:
        w.start(timeout=60)
    wait_for(lambda: int(rec.get("tick_runs") or 0) >= 4, 30, "four periodic runs")
    leads = "this worker pool leads: it enqueues the periodic jobs"
    (first,) = wait_for(lambda: [w for w in workers if leads in w.log_text()], 10, "a leader")
    first.stop(signal.SIGKILL, timeout=5)
    before = int(rec.get("tick_runs") or 0)
    (other,) = (w for w in workers if w is not first)
    other.wait_for_log(leads, timeout=10)
    wait_for(lambda: int(rec.get("tick_runs") or 0) >= before + 3, 30, "runs after the failover")
    runs_seen, ids = int(rec.get("tick_runs") or 0), rec.scard("tick_ids")
    assert runs_seen == ids, f"{runs_seen} runs of {ids} due times"


def test_a_fetch_whose_reply_is_lost_on_a_cluster_is_returned(
        cluster: ClusterGroup, namespace: str) -> None:
    """The fetch ran on the masters holding the queues (its jobs are in the pool's
    records), but the reply that brings it to the event loop never comes: the home
    master, which carries it, is stopped (SIGSTOP, shorter than the cluster's node
    timeout). After ``reply_timeout`` the channel gives the fetch up as lost (a
    connection error: the consumer reconnects), and the pool's reconcile returns every
    job it never delivered to its queue."""
    url = cluster.url()
    app = producer(url, namespace, install=True)
    app.conf.broker_transport_options = {**app.conf.broker_transport_options,
                                         "reply_timeout": 0.3}
    k = Keys(namespace, cluster=True)
    home = cluster.master_of(k.home.pools)
    queues = [q for q in (f"{APP}.job{n}" for n in range(NAMES))
              if cluster.master_of(k.of(q).queue(q)) is not home][:6]
    for q in queues:
        app.send_task(q, (0,))
    rc = cluster_rc(url)
    conn = app.connection_for_read()
    try:
        channel = conn.default_channel
        for q in queues:
            channel.basic_consume(q, False, lambda message: None, f"tag-{q}")
        pool = channel.worker_pool
        # The pool joins the queues' copies first, as its earlier fetches would have: a
        # join also writes the home copy (the queue registry, the live revokes), and what
        # is tested here is a fetch whose reply is lost, not a join that cannot reach home.
        pool.join(list(k.groups(queues)))
        assert home.pid is not None
        os.kill(home.pid, signal.SIGSTOP)
        try:
            # As the event loop does: register the channel's socket, which sends the
            # fetch (one pipeline per master) and then a PING for its reply.
            conn.transport.cycle._register_BRPOP(channel)
            time.sleep(0.4)
            with pytest.raises(channel.connection_errors):
                channel.fetcher.check_reply()
        finally:
            os.kill(home.pid, signal.SIGCONT)

        def in_records() -> int:
            return sum(rc.hlen(k.of(q).inflight(pool.pool_id)) for q in queues)

        moved = in_records()
        assert moved >= 1  # the fetch ran: its jobs wait in the records
        pool.maybe_reconcile()  # (it runs only when something asked for it: the lost fetch)
        assert in_records() == 0  # the pool returned what it never delivered
        assert sum(rc.llen(k.of(q).queue(q)) for q in queues) == len(queues)
    finally:
        conn.release()
        rc.close()
