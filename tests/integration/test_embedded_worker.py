"""Celery's embedded test worker keeps every promise, in both modes and every pool it
supports, through this project's own pytest plugin (``celery_ext.pytest``): the dead
set, checkin, the pool registered with its node and queues, a clean stop (deregistered,
every thread of ours ended), and a second worker in the same process."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
from celery.contrib.testing.worker import start_worker

from celery_ext.worker.worker_pool import live_pools
from tests.apps.proj_embedded import APPS, TASKS

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(params=["dropin", "install"])
def mode(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def celery_ext_app(mode: str) -> Any:
    return APPS[mode]


@pytest.fixture(params=["solo", "threads", "prefork"])
def celery_ext_worker_options(request: pytest.FixtureRequest) -> dict[str, Any]:
    return {"pool": request.param, "concurrency": 2}


def _ours(but: frozenset[threading.Thread] = frozenset()) -> list[str]:
    """Our threads alive in this process, but those in ``but`` (started before the test:
    an earlier test in the same process may have left its own)."""
    return sorted(t.name for t in threading.enumerate()
                  if t.name.startswith("celery_ext") and t not in but)


def _wait(predicate: Any, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.05)


def test_every_promise_in_the_embedded_worker(
        mode: str, celery_ext_configured_app: Any, celery_ext_client: Any,
        celery_ext_worker_options: dict[str, Any]) -> None:
    tasks = TASKS[mode]
    before = frozenset(threading.enumerate())
    for round_ in (1, 2):  # a second worker in the same process works the same
        with start_worker(celery_ext_configured_app, perform_ping_check=False,
                          **celery_ext_worker_options) as worker:
            assert tasks["add"].delay(2, 2).get(timeout=10) == 4
            assert tasks["progress"].delay(3).get(timeout=10) == 3
            failed = tasks["boom"].delay()
            with pytest.raises(KeyError):
                failed.get(timeout=10)
            _wait(lambda n=round_: celery_ext_client.counts()["dead"] >= n)
            dead = [job["task_id"] for job in celery_ext_client.dead(limit=10)["items"]]
            assert failed.id in dead
            (pool,) = celery_ext_client.worker_pools()
            assert pool["node"] == worker.hostname
            assert pool["concurrency"] == str(celery_ext_worker_options["concurrency"])
            queues = pool["queues"]
            assert ("celery" in queues if mode == "dropin"
                    else tasks["add"].name in queues), queues
        assert celery_ext_client.worker_pools() == []
        assert live_pools() == []
        _wait(lambda: not _ours(before), timeout=5)
        assert _ours(before) == []
