"""``celery inspect scheduled`` and Flower's view of it answer from Redis (issue 35):
countdown, ETA and retry jobs wait in the scheduled and retry sets, not in a worker's
timer, so Celery's own answer was empty. Each worker lists the jobs of the queues it
consumes, first due first, in Celery's reply shape; install(app) and drop-in."""

from __future__ import annotations

import json
import sys
import urllib.error
import urllib.request
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import redis

from celery_ext.config import INSPECT_SCHEDULED_PAGES
from celery_ext.producer.scheduled import schedule
from celery_ext.store.keys import Keys
from celery_ext.store.scripts import Scripts
from celery_ext.worker.inspect_scheduled import scheduled_jobs
from tests.apps import proj
from tests.helpers import Factory, Mode, message, node_name, start_workers, wait_for
from tests.helpers import mode_fixture as mode_fixture  # the `mode` fixture: both modes
from tests.webutil import env_for, free_port, stop_all
from tests.workers import ManagedProcess, WorkerProcess

#: Nothing reads what this module's pools write at a warm stop: teardown SIGKILLs
#: them (worker_factory in tests/conftest.py).
pytestmark = pytest.mark.kill_workers_at_teardown

K = Keys("celery_ext")


def _send_three(mode: Mode, redis_client: redis.Redis) -> tuple[datetime, Any, Any]:
    """An ETA job, a retry due sooner, and a job of a queue no worker consumes."""
    eta = datetime.now(UTC) + timedelta(seconds=60)
    at_eta = mode.send(proj.add, 1, 2, eta=eta)
    retry = mode.send(proj.add, 3, 4, countdown=30, retries=1)
    mode.app.send_task(proj.add.name, args=(5, 6), countdown=20, queue="nobody_q")
    assert redis_client.zcard(K.scheduled) == 2 and redis_client.zcard(K.retry) == 1
    return eta, at_eta, retry


def test_inspect_scheduled_lists_the_scheduled_and_retry_sets(
        mode: Mode, redis_client: redis.Redis, worker_factory: Factory) -> None:
    (worker,) = start_workers(worker_factory, 1, app="tests.apps.proj", env=mode.env())
    eta, at_eta, retry = _send_three(mode, redis_client)
    # A connection of its own: a pooled one may have been dropped by the server in an
    # earlier test of this process, and its first write fails (not retried).
    with mode.app.connection_for_write() as conn:
        replies = mode.app.control.inspect(timeout=10, connection=conn, limit=1).scheduled()
    entries = replies[node_name(worker)]
    assert [e["request"]["id"] for e in entries] == [retry.id, at_eta.id]
    entry = entries[1]
    assert entry["eta"].startswith(eta.strftime("%Y-%m-%dT%H:%M:%S"))
    assert entry["priority"] == 0
    request = entry["request"]
    assert request["name"] == request["type"] == proj.add.name
    assert request["args"] == [1, 2] and request["kwargs"] == {}
    assert request["acknowledged"] is False and request["time_start"] is None
    assert request["worker_pid"] is None and request["hostname"] == node_name(worker)
    assert request["delivery_info"]["routing_key"] == mode.queue(proj.add)
    assert entries[0]["request"]["args"] == [3, 4]
    # Celery's alias answers the same.
    assert mode.app.control.inspect(timeout=10, limit=1)._request("dump_schedule")[
        node_name(worker)] == entries


@pytest.mark.usefixtures("redis_client")
def test_flower_shows_the_scheduled_jobs(
        broker_url: str, redis_client: redis.Redis, tmp_path: Path,
        worker_factory: Callable[..., WorkerProcess]) -> None:
    pytest.importorskip("flower", reason="flower is not installed")
    mode = Mode("install", broker_url)
    (worker,) = start_workers(worker_factory, 1, app="tests.apps.proj")
    _, at_eta, retry = _send_three(mode, redis_client)
    (tmp_path / "flowerconfig.py").write_text(
        "from celery_ext.admin.flower import enable; enable()\n")
    port = free_port()
    flower = ManagedProcess(
        [sys.executable, "-m", "celery", "-A", "tests.apps.proj", "flower", f"--port={port}",
         "--address=127.0.0.1"], log_path=tmp_path / "flower.log", cwd=tmp_path,
        env=env_for(broker_url, FLOWER_UNAUTHENTICATED_API="1"), ready_pattern=r"Visit me at")
    base = f"http://127.0.0.1:{port}"

    def scheduled() -> list[Any] | None:
        # (Flower asks workers for task lists only when one worker is named.)
        url = f"{base}/api/workers?refresh=1&workername={node_name(worker)}"
        try:
            with urllib.request.urlopen(url, timeout=10) as r:
                workers = json.loads(r.read().decode())
        except urllib.error.HTTPError as exc:
            if exc.code == 404:  # Flower has not seen the worker yet
                return None
            raise
        return (workers.get(node_name(worker)) or {}).get("scheduled") or None

    try:
        flower.start(timeout=30)
        entries = wait_for(scheduled, 30, "Flower to list the scheduled jobs")
        assert [e["request"]["id"] for e in entries] == [retry.id, at_eta.id]
    finally:
        stop_all([flower])


def test_the_reply_is_bounded_first_due_first(redis_client: redis.Redis) -> None:
    """At most ``limit`` jobs, first due first, of the worker's queues only; the sets are
    read ``INSPECT_SCHEDULED_PAGES`` pages deep at most (bounded work per reply)."""
    scripts = Scripts(redis_client)
    for i in range(5):
        schedule(scripts, K, "mine", message(f"m{i}", "mine"), 60_000 - i * 1000, redis_client)
    for i in range(10):
        schedule(scripts, K, "other", message(f"o{i}", "other"), 1000 + i, redis_client)
    got = scheduled_jobs(redis_client, K, ["mine"], "node@h", limit=2)
    assert [e["request"]["id"] for e in got] == ["id-m4", "id-m3"]
    assert got[0]["request"]["delivery_info"]["routing_key"] == "mine"
    assert len(scheduled_jobs(redis_client, K, ["mine", "other"], "node@h", limit=100)) == 15
    # Deeper than the pages read: not found, the reply stays bounded.
    for i in range(10, 10 + 2 * INSPECT_SCHEDULED_PAGES):
        schedule(scripts, K, "other", message(f"o{i}", "other"), 1000 + i, redis_client)
    assert scheduled_jobs(redis_client, K, ["mine"], "node@h", limit=2) == []
