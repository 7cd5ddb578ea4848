"""Flower against a worker on our transport: workers, tasks with checkin progress, and
true job queue lengths on its broker page (``celery_ext.admin.flower``)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import redis

from celery_ext.client import Client
from tests.apps import proj_web
from tests.webutil import celery_argv, env_for, free_port, stop_all, wait_for
from tests.workers import ManagedProcess, WorkerProcess

pytest.importorskip("flower", reason="flower is not installed")


def get(base: str, path: str) -> Any:
    with urllib.request.urlopen(base + path, timeout=10) as r:
        body = r.read().decode()
    return json.loads(body) if r.headers.get("content-type", "").startswith("application/json") \
        else body


def test_flower_shows_workers_tasks_progress_and_queue_lengths(
        broker_url: str, redis_client: redis.Redis, tmp_path: Path,
        worker_factory: Callable[..., WorkerProcess]) -> None:
    proj_web.configure(broker_url)
    client = Client.for_app(proj_web.app)
    worker = worker_factory(proj_web.__name__, concurrency=2).start()
    port = free_port()
    flower = ManagedProcess(
        celery_argv("flower", f"--port={port}", "--address=127.0.0.1"),
        log_path=tmp_path / "flower.log",
        env=env_for(broker_url, FLOWER_UNAUTHENTICATED_API="1"),
        ready_pattern=r"Visit me at")
    base = f"http://127.0.0.1:{port}"
    try:
        flower.start(timeout=30)
        workers = wait_for(lambda: (lambda w: w if worker.hostname.split("@")[0] in str(w)
                                    else None)(get(base, "/api/workers?refresh=1")),
                           timeout=30, what="Flower to see the worker")
        assert any(info.get("active_queues") for info in workers.values())

        # A paused job queue keeps its jobs: Flower must report their true number.
        client.pause("tests.apps.proj_web.echo")
        for i in range(4):
            proj_web.echo.delay(i)
        job = proj_web.progress.delay(40, 0.1)

        def info() -> Any:
            try:
                data = get(base, f"/api/task/info/{job.id}")
            except urllib.error.HTTPError as exc:
                if exc.code == 404:  # Flower has not had the task's first event yet
                    return None
                raise
            return data if data.get("progress") else None

        running = wait_for(info, timeout=30, what="checkin progress in Flower")
        assert running["state"] == "STARTED"  # a checkin does not replace the state
        assert 0 < running["progress"] <= 1 and running["checkin"].startswith("step ")

        lengths = {q["name"]: q for q in get(base, "/api/queues/length")["active_queues"]}
        echo = lengths["tests.apps.proj_web.echo"]
        assert echo["messages"] == 4 and echo["messages_ready"] == 4
        assert echo["consumers"] == 1
        assert lengths["tests.apps.proj_web.progress"]["messages_unacknowledged"] == 1

        page = get(base, "/broker")
        assert 'id="tests.apps.proj_web.echo"' in page  # the broker page renders (no 404)

        assert job.get(timeout=30) == {"steps": 40}
        done = wait_for(lambda: (lambda d: d if d["state"] == "SUCCESS" else None)(
            get(base, f"/api/task/info/{job.id}")), what="task success in Flower")
        assert done["progress"] >= running["progress"]  # kept after the task finished
        tasks = get(base, "/api/tasks?limit=50")
        assert job.id in tasks and tasks[job.id]["name"] == "tests.apps.proj_web.progress"
    finally:
        client.resume("tests.apps.proj_web.echo")
        stop_all([flower])


@pytest.mark.parametrize("order", ["celery_ext first", "flower first"])
def test_flower_patch_whatever_the_import_order(order: str) -> None:
    import subprocess
    import sys

    imports = ["import celery_ext", "import flower.utils.broker as fb"]
    if order == "flower first":
        imports.reverse()
    code = "; ".join([*imports, "import flower.utils.broker as fb",
                      "b = fb.Broker('celery-ext://127.0.0.1:1/0', broker_options={})",
                      "print(type(b).__name__, type(fb.Broker('redis://127.0.0.1:1/0')).__name__)"])
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["CeleryExtBroker", "Redis"]
