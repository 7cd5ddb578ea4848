"""``worker/green.py``: which result backends a gevent worker's greenlets share, and
Kombu's retry sleep under ``-P gevent``.

gevent makes ``threading.local`` per greenlet; real threads show the same behaviour of
Celery's ``app.backend``, so threads stand in for greenlets in the backend tests. The
retry-sleep test patches a fresh interpreter as ``celery worker -P gevent`` does
(``celery.maybe_patch_concurrency``), so this test process stays unpatched: a greenlet
ticks every 50 ms while the main greenlet sleeps 0.5 s in ``kombu.utils.functional``'s
``sleep`` (the one ``retry_over_time`` uses between reconnect attempts); before
``cooperative_retry_sleep`` the ticker is frozen, after it the ticker runs.
"""

from __future__ import annotations

import subprocess
import sys
import threading
from typing import Any

import pytest
from celery import Celery

from celery_ext.config import GREEN_MAX_CONNECTIONS
from celery_ext.worker.green import share_result_backend
from tests.workers import REPO_ROOT


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


SCRIPT = """
import time

import celery

celery.maybe_patch_concurrency(["celery", "worker", "-P", "gevent"])
import gevent
from kombu.utils import functional

from celery_ext.worker.green import cooperative_retry_sleep

ticks = []


def tick():
    while True:
        ticks.append(time.monotonic())
        gevent.sleep(0.05)


def ticks_during_retry_sleep():
    ticker = gevent.spawn(tick)
    gevent.sleep(0)
    before = len(ticks)
    functional.sleep(0.5)
    ticker.kill()
    return len(ticks) - before


frozen = ticks_during_retry_sleep()
changed = cooperative_retry_sleep()
print(frozen, changed, ticks_during_retry_sleep(), cooperative_retry_sleep())
"""


def test_kombus_retry_sleep_lets_other_greenlets_run() -> None:
    done = subprocess.run([sys.executable, "-c", SCRIPT], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=60, check=True)
    frozen, changed, ticks, again = done.stdout.split()
    # Changed only where gevent's patching had left the blocking sleep in place (it
    # does with gevent 25.9.1 and Celery 5.7.0); once changed, never twice.
    assert changed == str(frozen == "0"), done.stdout
    assert int(ticks) >= 5, done.stdout
    assert again == "False"


def test_an_unpatched_process_is_left_alone() -> None:
    from kombu.utils import functional

    from celery_ext.worker.green import cooperative_retry_sleep

    sleep = functional.sleep
    assert cooperative_retry_sleep() is False
    assert functional.sleep is sleep
