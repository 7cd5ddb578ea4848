"""A gevent pool of hundreds of greenlets fetches and acks in batches: one fetch script
for many slots, one ack script for the jobs that finish together (``Fetcher.start``,
``WorkerPool.ack``), not a round trip per job.

Real server, a real ``celery worker -P gevent -c 200``; the commands are counted with
``MONITOR``.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import redis

from celery_ext.store import scripts
from celery_ext.store.keys import Keys
from celery_ext.testing.server import RedisServer
from tests.apps import proj
from tests.helpers import wait_for

#: Nothing reads what this module's pools write at a warm stop: teardown SIGKILLs
#: them (worker_factory in tests/conftest.py).
pytestmark = pytest.mark.kill_workers_at_teardown

APP = "tests.apps.proj_pools"
KEYS = Keys("celery_ext")


class ScriptCalls:
    """Counts the ``EVALSHA`` calls clients send, by script name, while it is open."""

    def __init__(self, server: RedisServer, names: tuple[str, ...]) -> None:
        self._names = {scripts.sha(n): n for n in names}
        self.calls = dict.fromkeys(names, 0)
        self._client = server.client()
        self._stop = threading.Event()
        self._listening = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._server = server

    def _run(self) -> None:
        with self._client.monitor() as mon:
            self._listening.set()
            for command in mon.listen():
                if self._stop.is_set():
                    return
                if command.get("client_type") == "lua":
                    continue
                parts = str(command.get("command", "")).split()
                if len(parts) > 1 and parts[0].upper() == "EVALSHA":
                    name = self._names.get(parts[1])
                    if name is not None:
                        self.calls[name] += 1

    def __enter__(self) -> ScriptCalls:
        self._thread.start()
        self._listening.wait(5)
        time.sleep(0.1)  # MONITOR is on once its reply came back
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        with self._server.client() as waker:
            waker.ping()  # unblocks listen()
        self._thread.join(5)
        self._client.close()


def test_two_hundred_greenlets_fetch_and_ack_in_batches(
        broker_url: str, redis_server: RedisServer, redis_client: redis.Redis,
        rec: redis.Redis, worker_factory: Any) -> None:
    proj.configure(broker_url)
    from tests.apps import proj_pools

    n = 2000
    keys = [f"b{i}" for i in range(n)]
    for k in keys:
        proj_pools.slow.delay(k, 0.02)
    with ScriptCalls(redis_server, ("fetch", "ack")) as counted:
        worker_factory(APP, pool="gevent", concurrency=200).start()
        wait_for(lambda: sum(run_counts(rec, keys)) == n and
                 redis_client.hlen(KEYS.inflight(only_pool(redis_client))) == 0,
                 60, "every job run and acked")
    assert set(run_counts(rec, keys)) == {1}  # each once, none lost
    print(f"per job: {counted.calls['fetch'] / n:.3f} fetch, {counted.calls['ack'] / n:.3f} ack")
    # Measured about 1/16 each (the fetch batch; jobs finishing in one turn of the hub).
    assert counted.calls["fetch"] <= n / 4, counted.calls
    assert counted.calls["ack"] <= n / 4, counted.calls


def run_counts(rec: redis.Redis, keys: list[str]) -> list[int]:
    with rec.pipeline(transaction=False) as pipe:
        for k in keys:
            pipe.llen(f"runs:{k}")
        return [int(c) for c in pipe.execute()]


def only_pool(client: redis.Redis) -> str:
    pools = client.zrange(KEYS.pools, 0, -1)
    assert len(pools) == 1, pools
    return pools[0].decode()
