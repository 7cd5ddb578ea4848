"""Helpers for the dashboard, CLI, browser and Flower tests."""

from __future__ import annotations

import base64
import json
import os
import socket
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

from celery_ext.config import Settings
from celery_ext.store.keys import Keys
from celery_ext.store.scripts import Scripts
from tests.workers import REPO_ROOT, ManagedProcess

T = TypeVar("T")

APP = "tests.apps.proj_web"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def env_for(broker_url: str, **extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        CELERY_EXT_BROKER_URL=broker_url,
        PYTHONPATH=os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH", ""))
                                   if p),
        PYTHONUNBUFFERED="1",
    )
    env.update(extra)
    return env


def celery_argv(*args: str) -> list[str]:
    return [sys.executable, "-m", "celery", "-A", APP, *args]


def start_web(broker_url: str, log_dir: Path, *extra: str, port: int | None = None
              ) -> tuple[ManagedProcess, str]:
    """``celery -A tests.apps.proj_web ext web`` on a free port; returns (process, base URL)."""
    port = port or free_port()
    proc = ManagedProcess(
        celery_argv("ext", "web", "--port", str(port), *extra),
        log_path=log_dir / f"web-{port}.log", env=env_for(broker_url),
        ready_pattern=r"Uvicorn running on")
    proc.start(timeout=30)
    return proc, f"http://127.0.0.1:{port}"


def wait_for(check: Callable[[], T | None], timeout: float = 20.0, interval: float = 0.1,
             what: str = "condition") -> T:
    """Poll ``check`` until it returns something truthy; return that."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = check()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what} (last: {last!r})")


def run_cli(broker_url: str, *args: str, timeout: float = 60) -> Any:
    """Run ``celery -A tests.apps.proj_web ext ARGS`` and return the CompletedProcess."""
    import subprocess

    return subprocess.run(celery_argv("ext", *args), env=env_for(broker_url), cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=timeout)


def stop_all(procs: Sequence[ManagedProcess]) -> None:
    for proc in procs:
        if proc.started:
            proc.stop(timeout=10)


def task_payload(tag: str, name: str, args: list[Any], kwargs: dict[str, Any] | None = None
                 ) -> str:
    """A task message as the transport stores it (kombu JSON, base64 body)."""
    body = json.dumps([args, kwargs or {}, {"callbacks": None, "errbacks": None,
                                            "chain": None, "chord": None}])
    return json.dumps({
        "body": base64.b64encode(body.encode()).decode(), "content-encoding": "utf-8",
        "content-type": "application/json",
        "headers": {"lang": "py", "task": name, "id": tag, "retries": 0, "root_id": tag},
        "properties": {"correlation_id": tag, "delivery_tag": tag, "body_encoding": "base64",
                       "delivery_mode": 2, "priority": 0,
                       "delivery_info": {"exchange": "", "routing_key": name}}})


def fill_dead(client: Any, jobs: Sequence[tuple[str, str, str, list[Any]]]) -> None:
    """Dead-letter ``jobs`` (tag, job name, exception type, args) the way a worker
    does (the ``dead`` script, with the record a job acked at its start leaves),
    pipelined: thousands of dead jobs in a second or two, no real failures needed."""
    settings, scripts = Settings(), Scripts(client)
    k = Keys.for_settings(settings)
    with client.pipeline(transaction=False) as pipe:
        for tag, name, exc_type, args in jobs:
            meta = json.dumps({"reason": "failed", "error": f"{exc_type}: {args[0]!r} failed",
                               "exc_type": exc_type, "name": name, "task_id": tag,
                               "pool": "filler"})
            scripts("dead", [k.inflight("filler"), k.dead, k.dead_jobs, k.redelivery,
                             k.running, k.limits, k.ready],
                    [tag, meta, 100_000, int(settings.dead_max_age * 1000),
                     f"{name}\n{task_payload(tag, name, args)}", k.wake_channel], client=pipe)
        pipe.execute()
