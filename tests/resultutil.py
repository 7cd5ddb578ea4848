"""Fixtures of the result backend's tests (``test_results.py``, ``test_result_chords.py``):
where one test's results live (the one-node server's db 1, or the session's cluster with a
namespace of its own) and workers of ``tests.apps.proj_results`` pointed at them."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis

from celery_ext.store.connections import cluster_client, cluster_config
from celery_ext.store.keys import ResultKeys
from celery_ext.testing.server import ClusterGroup, RedisServer
from tests.apps import proj_results
from tests.workers import WorkerProcess

APP = "tests.apps.proj_results"


class Results:
    """Where one test's results live: the URL, the namespace and a client to inspect it."""

    def __init__(self, url: str, namespace: str, client: Any, cluster: bool) -> None:
        self.url, self.namespace, self.client, self.cluster = url, namespace, client, cluster
        self.keys = ResultKeys(namespace)

    def our_keys(self) -> list[bytes]:
        """Every key of this namespace's results, on every master."""
        if self.cluster:
            return list(self.client.scan_iter(match=self.keys.pattern,
                                              target_nodes=self.client.PRIMARIES))
        return list(self.client.scan_iter(match=self.keys.pattern))

    def ttl(self, key: bytes) -> int:
        return int(self.client.ttl(key))


@pytest.fixture(params=["node", "cluster"])
def results(request: pytest.FixtureRequest, redis_client: redis.Redis,
            redis_server: RedisServer) -> Iterator[Results]:
    namespace = "r" + uuid.uuid4().hex[:8]
    if request.param == "node":
        url = redis_server.url(scheme="celery-ext", db=1)
        yield Results(url, namespace, redis_server.client(db=1), cluster=False)
        return
    group_: ClusterGroup = request.getfixturevalue("cluster")
    url = group_.url()
    config = cluster_config([url], {"cluster": True})
    assert config is not None
    client = cluster_client(config)
    yield Results(url, namespace, client, cluster=True)
    client.close()


@pytest.fixture
def app_for(results: Results, redis_server: RedisServer,
            worker_factory: Callable[..., WorkerProcess]) -> Callable[..., WorkerProcess]:
    """Point the test process's app at the servers and return a starter of workers."""
    broker = redis_server.url(scheme="celery-ext")
    record = redis_server.url(db=2)
    proj_results.configure(broker, results.url, record, cluster=results.cluster,
                           namespace=results.namespace)

    def start(**kwargs: Any) -> WorkerProcess:
        env = {"CELERY_EXT_RESULT_URL": results.url, "CELERY_EXT_RECORD_URL": record,
               "CELERY_EXT_RESULT_NAMESPACE": results.namespace,
               "CELERY_EXT_RESULT_CLUSTER": "1" if results.cluster else "0"}
        env.update(kwargs.pop("env", {}))
        return worker_factory(APP, broker_url=broker, env=env, **kwargs).start(timeout=60)

    return start
