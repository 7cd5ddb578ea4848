"""Flower against a worker on our transport: workers, tasks with checkin progress, and
true job queue lengths on its broker page (``celery_ext.admin.flower``), asked for by
the one line docs/dashboard.md gives for Flower's config file; ``import celery_ext``
alone leaves Flower as it is."""

from __future__ import annotations

import json
import subprocess
import sys
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

#: Nothing reads what this module's pools write at a warm stop: teardown SIGKILLs
#: them (worker_factory in tests/conftest.py).
pytestmark = pytest.mark.kill_workers_at_teardown

pytest.importorskip("flower", reason="flower is not installed")

#: The Flower config line docs/dashboard.md gives (compose/flowerconfig.py has it too).
CONFIG_LINE = "from celery_ext.admin.flower import enable; enable()"


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
    # Flower reads flowerconfig.py from its working directory.
    (tmp_path / "flowerconfig.py").write_text(CONFIG_LINE + "\n")
    flower = ManagedProcess(
        celery_argv("flower", f"--port={port}", "--address=127.0.0.1"),
        log_path=tmp_path / "flower.log", cwd=tmp_path,
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


def _broker_classes(*lines: str) -> list[str]:
    """In a fresh interpreter, after ``lines``: the class Flower's broker factory gives
    for a celery-ext:// URL (``NotImplementedError`` when it has none) and for redis://."""
    code = "\n".join([
        *lines,
        "import flower.utils.broker as fb",
        "try:",
        "    ours = type(fb.Broker('celery-ext://127.0.0.1:1/0', broker_options={})).__name__",
        "except NotImplementedError:",
        "    ours = 'NotImplementedError'",
        "print(ours, type(fb.Broker('redis://127.0.0.1:1/0')).__name__)",
    ])
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout.split()


def test_import_celery_ext_leaves_flower_alone() -> None:
    """Importing the package registers the URL schemes and patches nothing: no import
    hook, Flower's broker factory as Flower made it."""
    assert _broker_classes(
        "import sys",
        "import celery_ext",
        "hooks = [f for f in sys.meta_path if type(f).__module__.startswith('celery_ext')]",
        "assert not hooks, hooks",
        "from kombu.transport import TRANSPORT_ALIASES",
        "assert TRANSPORT_ALIASES['celery-ext'] == celery_ext.TRANSPORT",
    ) == ["NotImplementedError", "Redis"]


@pytest.mark.parametrize("order", ["enable first", "flower first"])
def test_enable_patches_flower_whatever_the_import_order(order: str) -> None:
    lines = ["from celery_ext.admin.flower import enable; enable()",
             "import flower.utils.broker"]
    if order == "flower first":
        lines.reverse()
    assert _broker_classes(*lines) == ["CeleryExtBroker", "Redis"]
