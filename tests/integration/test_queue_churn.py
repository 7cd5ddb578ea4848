"""Job queue names that come and go leave bounded state (issue 33, item 13).

A worker consumes job queues of names made up for the test, runs one job of each and
stops; then a reader (``Client.job_queues()``, as the dashboard and the CLI call it)
runs. Every name is forgotten: from the registry ``{ns}:queues``, with its fields of
``{ns}:stats``, ``{ns}:runtime`` and ``{ns}:running`` (a count of 0 since its last
ack); on a cluster also from the home registry, so the reaper's pass runs one script
for the home copy again, not one per queue ever seen. Before, the per-queue fields
stayed for good on one node, and on a cluster the home registry never shrank. One node
and a cluster, real workers.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

import pytest
import redis
from celery import Celery

import celery_ext
from celery_ext.client import Client
from celery_ext.config import Settings
from celery_ext.store.copies import copies
from celery_ext.store.keys import Keys
from celery_ext.testing.server import ClusterGroup, RedisServer
from celery_ext.worker.reaper import Reaper
from tests.helpers import wait_for
from tests.workers import WorkerProcess

N = 12
APP = "tests.apps.proj_cluster"  # its tasks record their runs on a one-node server


def per_queue_fields(client: Any, keys: Keys, names: list[str]) -> list[str]:
    """The fields of ``names`` left in the stats, runtime and running hashes of every
    copy."""
    left = []
    for copy in {keys, *(keys.of(n) for n in names)}:
        for hash_key in (copy.stats, copy.runtime):
            left += [f.decode() for f in client.hkeys(hash_key)
                     if f.decode().partition(":")[2] in names]
        left += [f"running {f.decode()}" for f in client.hkeys(copy.running)
                 if f.decode() in names]
    return left


@pytest.mark.parametrize("topology", ["node", "cluster"])
def test_queue_names_that_come_and_go_leave_bounded_state(
        topology: str, redis_server: RedisServer, request: pytest.FixtureRequest,
        worker_factory: Callable[..., WorkerProcess]) -> None:
    namespace = "churn" + uuid.uuid4().hex[:8]
    record = redis.Redis.from_url(redis_server.url(db=3))
    record.delete("done")
    cluster = topology == "cluster"
    if cluster:
        group: ClusterGroup = request.getfixturevalue("cluster")
        url = group.url()
    else:
        url = redis_server.url(scheme="celery-ext")
    names = [f"churn.{uuid.uuid4().hex[:6]}.{i}" for i in range(N)]
    env = {"CELERY_EXT_NAMESPACE": namespace, "CELERY_EXT_RECORD_URL": redis_server.url(db=3),
           # Finished jobs' index entries keep a cluster copy in use until trimmed.
           "CELERY_EXT_JOB_INDEX_TTL": "1", "CELERY_EXT_CLUSTER": "1" if cluster else "0"}
    options: dict[str, Any] = {"namespace": namespace, "job_index_ttl": 1}
    if cluster:
        options["cluster"] = True
    worker = worker_factory(APP, broker_url=url, concurrency=2, queues=names, env=env)
    worker.start(timeout=60)

    app = Celery("churn-producer", broker=url, set_as_current=False)
    app.conf.broker_transport_options = options
    app.conf.task_ignore_result = True
    celery_ext.install(app)
    for name in names:
        app.send_task(f"{APP}.job0", (0,), queue=name)
    wait_for(lambda: int(record.get("done") or 0) >= N, 60, f"{N} jobs run")

    ext = Client.from_url(url, **options)
    keys, client = ext.keys, ext.client
    try:
        wait_for(lambda: len(per_queue_fields(client, keys, names)) >= 3 * N, 10,
                 "every queue's counters flushed (processed, a runtime bucket, its sum)")
        assert {n.decode() for n in client.smembers(keys.queues)} >= set(names)
        worker.stop()  # it deregisters: no live pool consumes the names any more
        if cluster:
            reaper = Reaper(client, Settings(namespace=namespace, cluster=True,
                                             job_index_ttl=1.0))
            wait_for(lambda: reaper.trim_index() == 0
                     and not any(client.exists(keys.of(n).job_index_done) for n in names),
                     10, "the finished entries of the job index trimmed")

        ext.job_queues()  # a reader: the dashboard, the CLI, the requeuer's sample

        known = {n.decode() for n in client.smembers(keys.queues)}
        assert not known & set(names), known & set(names)
        assert per_queue_fields(client, keys, names) == []
        assert not {q["name"] for q in ext.job_queues()} & set(names)
        # The reaper's trim (and every namespace-wide pass) visits the home copy only.
        assert copies(client, keys) == [keys.home]
    finally:
        app.close()
        ext.client.close()
        record.close()
