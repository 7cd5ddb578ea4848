"""The result backend behind Redis Sentinel (``celery-ext+sentinel://``): results stored
through a real worker are read back, and a primary killed after results were stored with
``wait_replicas`` (Redis ``WAIT``) loses none of them: the promoted replica has every one,
each with its TTL.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator

import pytest
from celery import Celery

import celery_ext  # noqa: F401 - registers the celery-ext schemes
from celery_ext.results import ResultBackend
from celery_ext.testing.server import RedisServer, SentinelGroup
from tests.apps import proj_results
from tests.helpers import wait_for
from tests.workers import WorkerProcess

#: Nothing reads what this module's pools write at a warm stop: teardown SIGKILLs
#: them (worker_factory in tests/conftest.py).
pytestmark = pytest.mark.kill_workers_at_teardown

MASTER = "resultsmaster"


@pytest.fixture(scope="module")
def group() -> Iterator[SentinelGroup]:
    with SentinelGroup(master_name=MASTER, down_after_ms=1500, failover_timeout_ms=2000) as g:
        yield g


def sentinel_app(url: str, namespace: str, **options: object) -> Celery:
    app = Celery("results_sentinel", set_as_current=False, backend=url)
    app.conf.result_backend_transport_options = {"master_name": MASTER,
                                                 "namespace": namespace, **options}
    return app


def test_results_through_sentinel_with_a_worker(
        group: SentinelGroup, redis_server: RedisServer,
        worker_factory: Callable[..., WorkerProcess]) -> None:
    url = group.url(db=1)
    namespace = "s" + uuid.uuid4().hex[:8]
    broker = redis_server.url(scheme="celery-ext")
    proj_results.configure(broker, url, redis_server.url(db=2), namespace=namespace,
                           master_name=MASTER)
    assert isinstance(proj_results.app.backend, ResultBackend)
    worker_factory("tests.apps.proj_results", broker_url=broker, env={
        "CELERY_EXT_RESULT_URL": url, "CELERY_EXT_RESULT_NAMESPACE": namespace,
        "CELERY_EXT_RESULT_MASTER_NAME": MASTER}).start(timeout=60)
    assert proj_results.add.delay(20, 22).get(timeout=30) == 42
    assert "**" in proj_results.app.backend.as_uri() or "@" not in url


def test_no_result_confirmed_by_wait_is_lost_in_a_failover(group: SentinelGroup) -> None:
    namespace = "f" + uuid.uuid4().hex[:8]
    app = sentinel_app(group.url(db=1), namespace, wait_replicas=1, wait_timeout_ms=2000)
    backend = app.backend
    ids = [uuid.uuid4().hex for _ in range(200)]
    for i, task_id in enumerate(ids):
        backend.store_result(task_id, i, "SUCCESS")
    old = group.master_server()
    assert old is not None
    old.kill()
    try:
        wait_for(lambda: group.master() not in (None, (old.host, old.port)), 30,
                 "a replica promoted")
        reader = sentinel_app(group.url(db=1), namespace).backend
        metas = wait_for(lambda: _read(reader, ids), 30, "the new primary to answer")
        assert [m["result"] for m in metas] == list(range(200))
        ttls = [reader.client.ttl(reader.get_key_for_task(t)) for t in ids]
        assert all(0 < t <= 3600 * 24 for t in ttls)
    finally:
        group.rejoin(old)


def _read(backend: ResultBackend, ids: list[str]) -> list[dict[str, object]] | None:
    try:
        return [backend.get_task_meta(t) for t in ids]
    except Exception:  # the old primary's connections are still being dropped
        return None


def test_fewer_replicas_than_asked_is_said(group: SentinelGroup) -> None:
    """WAIT runs on the connection that wrote the result: asking for more replicas than
    the group has raises NotReplicated naming the result, instead of returning as if
    a failover could not lose it."""
    from celery.exceptions import BackendStoreError

    from celery_ext.errors import NotReplicated

    app = sentinel_app(group.url(db=1), "w" + uuid.uuid4().hex[:8], wait_replicas=2,
                       wait_timeout_ms=300)
    with pytest.raises((NotReplicated, BackendStoreError), match=r"[01] of 2 replica"):
        app.backend.store_result("t-wait", 1, "SUCCESS")
