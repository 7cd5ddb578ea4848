"""``worker/green.py``: which result backends a gevent worker's greenlets share.

gevent makes ``threading.local`` per greenlet; real threads show the same behaviour of
Celery's ``app.backend``, so threads stand in for greenlets here."""

from __future__ import annotations

import threading
from typing import Any

import pytest
from celery import Celery

from celery_ext.config import GREEN_MAX_CONNECTIONS
from celery_ext.worker.green import share_result_backend


def backends_seen(app: Celery, threads: int = 4) -> set[int]:
    """The distinct backend instances ``threads`` threads get (kept alive meanwhile, so
    no two share an ``id``)."""
    seen: list[Any] = []

    def look() -> None:
        seen.append(app.backend)

    workers = [threading.Thread(target=look) for _ in range(threads)]
    for t in workers:
        t.start()
    for t in workers:
        t.join()
    return {id(b) for b in seen}


@pytest.mark.parametrize("backend", [None, "redis://127.0.0.1:1/1"])
def test_the_disabled_and_the_redis_backend_are_one_instance_for_every_thread(
        backend: Any) -> None:
    app = Celery("green", broker="memory://", backend=backend, set_as_current=False)
    assert len(backends_seen(app)) == 4  # Celery's default: one per thread (greenlet)
    assert share_result_backend(app)
    # (Threads that make the first instance at the same moment may each make one, as
    # they may without us; greenlets do not: nothing in between yields.)
    backends_seen(app, threads=1)
    assert len(backends_seen(app)) == 1


def test_other_backends_keep_one_instance_per_thread() -> None:
    app = Celery("green", broker="memory://", backend="cache+memory://",
                 set_as_current=False)
    assert not share_result_backend(app)
    assert len(backends_seen(app)) == 4


def test_a_backend_the_user_declared_thread_safe_is_left_as_it_is() -> None:
    app = Celery("green", broker="memory://", backend="cache+memory://",
                 set_as_current=False)
    app.conf["result_backend_thread_safe"] = True
    assert share_result_backend(app)
    backends_seen(app, threads=1)
    assert len(backends_seen(app)) == 1


def test_a_shared_redis_backend_has_room_for_every_greenlet() -> None:
    """One client serves every greenlet storing a result at once: redis-py's default
    bound (100) failed jobs of a -c 200 pool; a bound the user set is kept."""
    app = Celery("green", broker="memory://", backend="redis://127.0.0.1:1/1",
                 set_as_current=False)
    assert share_result_backend(app)
    assert app.backend.connparams["max_connections"] == GREEN_MAX_CONNECTIONS
    mine = Celery("green", broker="memory://", backend="redis://127.0.0.1:1/1",
                  set_as_current=False)
    mine.conf["redis_max_connections"] = 300
    assert share_result_backend(mine)
    assert mine.backend.connparams["max_connections"] == 300
