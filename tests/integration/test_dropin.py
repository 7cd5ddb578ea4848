"""Drop-in mode: only the broker URL changed, no ``install(app)`` (issue 2).

Workers run ``tests.apps.proj`` with ``CELERY_EXT_NO_INSTALL=1``; this process sends
through a plain Celery app (no routing by task name) on the same broker and result
backend, so everything goes where it goes on ``redis://``: the ``celery`` queue,
explicit queues, canvas, remote control.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Callable, Iterator

import pytest
import redis
from celery import Celery, chain, chord, group

from celery_ext.store.keys import Keys
from tests.apps.proj import backend_url
from tests.workers import WorkerProcess

#: Nothing reads what this module's pools write at a warm stop: teardown SIGKILLs
#: them (worker_factory in tests/conftest.py).
pytestmark = pytest.mark.kill_workers_at_teardown

K = Keys("celery_ext")
DROP_IN = {"CELERY_EXT_NO_INSTALL": "1"}
Factory = Callable[..., WorkerProcess]


@pytest.fixture
def sender(broker_url: str, redis_client: redis.Redis) -> Iterator[Celery]:
    """A stock Celery app: our broker URL, the redis result backend, nothing else."""
    app = Celery("dropin-sender", broker=broker_url, backend=backend_url(broker_url),
                 set_as_current=False)
    yield app
    app.close()


def sig(app: Celery, name: str, *args: object) -> object:
    return app.signature(f"tests.apps.proj.{name}", args=args)


def test_default_queue_explicit_queue_and_remote_control(
    sender: Celery, redis_client: redis.Redis, worker_factory: Factory,
) -> None:
    # Before any worker: the jobs sit in our job queues named like Celery's queues.
    first = sender.send_task("tests.apps.proj.add", (1, 2))
    explicit = sender.send_task("tests.apps.proj.explicit", (3,), queue="explicit_q")
    assert json.loads(redis_client.lindex(K.queue("celery"), 0))["headers"]["id"] == first.id
    assert redis_client.llen(K.queue("explicit_q")) == 1
    assert not redis_client.exists(K.queue("tests.apps.proj.add"))

    worker = worker_factory("tests.apps.proj", pool="prefork", concurrency=2,
                            queues=["celery", "explicit_q"], env=DROP_IN).start()
    node = worker.hostname.replace("%h", socket.gethostname())
    assert first.get(timeout=15) == 3
    assert explicit.get(timeout=15) == 30
    assert [sender.send_task("tests.apps.proj.add", (i, i)).get(timeout=15)
            for i in range(5)] == [0, 2, 4, 6, 8]

    # Remote control over the inherited fanout (PUB/SUB) path.
    assert (sender.control.inspect(timeout=5, limit=1).ping() or {}).get(node) == {"ok": "pong"}
    assert {node: {"ok": "pong"}} in sender.control.ping(timeout=5, limit=1)
    replies = sender.control.rate_limit("tests.apps.proj.add", "100/m", reply=True, timeout=5,
                                         limit=1)
    assert replies and "ok" in replies[0][node], replies
    stats = (sender.control.inspect(timeout=5, limit=1).stats() or {}).get(node)
    assert stats and stats["total"].get("tests.apps.proj.add") == 6, stats
    queues = (sender.control.inspect(timeout=5, limit=1).active_queues() or {}).get(node) or []
    assert {q["name"] for q in queues} == {"celery", "explicit_q"}
    assert redis_client.llen(K.queue("celery")) == 0


def test_canvas_chain_group_and_chord(
    sender: Celery, redis_client: redis.Redis, worker_factory: Factory,
) -> None:
    worker_factory("tests.apps.proj", pool="threads", concurrency=4, env=DROP_IN).start()
    # chain: (1 + 2) + 3, then + 4
    res = chain(sig(sender, "add", 1, 2), sig(sender, "add", 3), sig(sender, "add", 4)).delay()
    assert res.get(timeout=20) == 10
    assert res.parent.get(timeout=5) == 6
    # group
    res = group(sig(sender, "add", i, i) for i in range(10)).delay()
    assert res.get(timeout=20) == [2 * i for i in range(10)]
    # chord: the body gets every header result (redis result backend)
    res = chord((sig(sender, "add", i, 1) for i in range(8)), sig(sender, "xsum")).delay()
    assert res.get(timeout=20) == sum(i + 1 for i in range(8))
    # A chain whose second step fails reports the failure.
    res = chain(sig(sender, "add", 1, 1), sig(sender, "fail")).delay()
    with pytest.raises(ValueError, match="2 failed on purpose"):
        res.get(timeout=20)
