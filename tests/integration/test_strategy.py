"""Request classes shared between tasks with the same settings (``celery_ext.worker.strategy``)."""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

import pytest
import redis
from celery.concurrency.solo import TaskPool
from celery.utils.imports import symbol_by_name
from celery.worker.request import Request as CeleryRequest
from celery.worker.request import create_request_cls

from celery_ext.worker.strategy import shared_factory
from tests.apps import proj
from tests.helpers import Factory, inflight, only_pool, wait_for

#: Nothing reads what this module's pools write at a warm stop: teardown SIGKILLs
#: them (worker_factory in tests/conftest.py).
pytestmark = pytest.mark.kill_workers_at_teardown


def test_one_request_class_per_task_settings() -> None:
    """Celery's own factory, memoised: every task with the default settings gets the
    same class, and each setting a class captures (acks_late, time limits, task
    events, the base Request class) makes its own."""
    from tests.apps import proj_strategy

    assert proj.app.Task.Strategy == "celery_ext.worker.strategy:default"
    consumer = SimpleNamespace()  # holds the cache, as the worker's consumer does
    pool = TaskPool()
    on, off = SimpleNamespace(enabled=True), SimpleNamespace(enabled=False)
    create = shared_factory(consumer, create_request_cls)
    base = symbol_by_name(proj_strategy.late_ack.Request)

    def cls(task: Any, eventer: Any = off, base: Any = base) -> Any:
        return create(base, task, pool, "w@h", eventer, app=proj.app)

    alike = [t for name, t in sorted(proj.app.tasks.items())
             if not name.startswith("celery.") and t.acks_late and not t.time_limit
             and not t.soft_time_limit]
    assert len(alike) >= 10
    assert len({cls(t) for t in alike}) == 1
    shared = cls(proj_strategy.late_ack)
    assert cls(proj_strategy.early_ack) is not shared
    assert cls(proj_strategy.limited) is not shared
    assert cls(proj_strategy.late_ack, eventer=on) is not shared
    assert cls(proj_strategy.late_ack, base=CeleryRequest) is not shared
    # A second consumer (a restarted one: new pool, new dispatcher) builds its own.
    assert shared_factory(SimpleNamespace(), create_request_cls)(
        base, proj_strategy.late_ack, pool, "w@h", off, app=proj.app) is not shared
    # What is shared is exactly what Celery builds for any of those tasks.
    fresh = create_request_cls(base, proj_strategy.late_ack, pool, "w@h", off, app=proj.app)
    assert fresh.__mro__[1:] == shared.__mro__[1:]


def test_tasks_keep_their_own_settings_in_a_worker(
        broker_url: str, redis_client: redis.Redis, worker_factory: Factory) -> None:
    """A real prefork pool running the three look-alike tasks at once: the late-ack
    job stays in the in-flight record while it runs and is acked when it ends, the
    early-ack one is out of it from the start, and only the task with a 1 s time limit
    is killed -- sent without the limit in its headers, so only the Request class the
    pool built for that task knows it."""
    proj.configure(broker_url)
    from tests.apps import proj_strategy

    rec = redis.Redis.from_url(proj.backend_url(broker_url, db=2))
    worker_factory("tests.apps.proj_strategy", pool="prefork", concurrency=3).start()
    pool_id = only_pool(redis_client)
    proj_strategy.late_ack.delay("late", 2.0)
    proj_strategy.early_ack.delay("early", 2.0)
    proj.app.send_task("tests.apps.proj_strategy.limited", ("limited", 3.0),
                       time_limit=None, soft_time_limit=None)  # none in its headers
    wait_for(lambda: all(rec.llen(f"start:{k}") for k in ("late", "early", "limited")),
               15, "the three jobs to start")
    time.sleep(0.3)
    queues = {queue for queue, _ in inflight(redis_client, pool_id).values()}
    assert "tests.apps.proj_strategy.late_ack" in queues, queues
    assert "tests.apps.proj_strategy.early_ack" not in queues, queues
    wait_for(lambda: rec.llen("end:late") and rec.llen("end:early"), 10, "the ends")
    wait_for(lambda: not inflight(redis_client, pool_id), 10, "every job acked")
    time.sleep(1.5)  # the limited job would have ended by now
    assert rec.llen("end:limited") == 0
    rec.close()


def test_strategies_are_built_once_per_task_with_the_collector_paused(
        broker_url: str, redis_client: redis.Redis, rec: redis.Redis,
        worker_factory: Factory) -> None:
    """A threads worker of twenty counted job names builds each task's strategy once, at
    start, with the garbage collector paused; its jobs then run on those (no build
    per message), and the collector runs again, after one full pass and no other."""
    proj.configure(broker_url)
    from tests.apps import proj_counted

    def built() -> list[str]:
        return sorted(b.decode() for b in rec.lrange(proj_counted.BUILT_KEY, 0, -1))

    worker_factory("tests.apps.proj_counted", pool="threads", concurrency=2).start()
    only_pool(redis_client)
    names = sorted(job.name for job in proj_counted.jobs)
    assert built() == [f"{name} 0" for name in names]
    for i, job in enumerate(proj_counted.jobs[:3]):
        job.delay(f"k{i}")
    wait_for(lambda: all(rec.llen(f"ran:k{i}") for i in range(3)), 15, "the jobs to run")
    assert len(built()) == len(names)

    proj_counted.collector.delay()
    assert wait_for(lambda: rec.get("collector"), 15, "the collector") == b"1"
    # One pass after the build, the full one: not a young pass over every object the
    # build made first (the collector turned back on before the full pass: "0,2").
    assert rec.get("passes_after_build") == b"2"
