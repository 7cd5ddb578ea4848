"""Celery's task strategy with one Request class per task *settings*, not per task.

Celery's ``default`` strategy builds a Request subclass for every task name
(``celery.worker.request.create_request_cls``). The class depends only on the base
Request class, the pool, whether task events are on, the task's ``time_limit``,
``soft_time_limit`` and ``acks_late`` (and the trace function); the task itself is
passed to each request. With 1,000 job names a pool held 1,000 such classes (plus
1,000 task classes), and the interpreter's type attribute cache stopped covering
the per-message lookups: measured on the many-job-names drain (prefork -c 2,
20,000 jobs over 1,000 names, four paired rounds), sharing the classes took worker
CPU per job from 921 to 836 µs and throughput from 1,320 to 1,477 jobs/s.

``default`` below runs Celery's own strategy, handing it a ``create_request_cls``
that returns the class already built for the same settings. The cache lives on the
consumer, so a restarted consumer (new pool, new event dispatcher) builds afresh.

``collector_paused`` wraps a consumer's ``update_strategies`` (every task's strategy
and tracer, built when the consumer starts): with 10,000 job names the garbage
collector's passes took most of that build, each full pass walking the 10,000 task
classes and everything built so far. Measured in one process (10,000 tasks, Celery's
own ``update_strategies``): 1.41-1.58 s of CPU with the collector, 0.23-0.28 s with it
paused, 0.85-0.91 s with the start frozen (``gc.freeze``) but the collector on.
Building them on each task's first message instead moved that cost, collector
included, into the drain: a pool draining jobs of all 10,000 names spent about a
fifth of its main thread building them (py-spy).

Once the build is done, one full pass runs at once (0.40-0.53 s over the 1.06 million
objects a 10,000-name worker holds then): the passes skipped during the build would
otherwise come due in the drain. It runs before the collector is turned back on, so it is
the only pass: turned on first, the collector made a young pass over every object the
build made (it counts allocations while paused) at the next allocation, before the full
one. Freezing the start out of the collector instead (``gc.freeze`` at ``worker_ready``)
left the start shorter but raised the worker's CPU per job at 10,000 names in six paired
drains of six.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from celery.worker import strategy as _celery_strategy

_CACHE_ATTR = "_celery_ext_request_classes"
#: Serialises our swaps of Celery's module-level factory (strategies are built in each
#: consumer's thread; a process may run more than one).
_lock = threading.Lock()


def request_class_key(base: Any, task: Any, pool: Any, hostname: Any, eventer: Any,
                      kwargs: dict[str, Any]) -> tuple[Any, ...]:
    """Everything ``create_request_cls`` reads: equal keys give equal classes."""
    events = bool(eventer and eventer.enabled)
    return (base, id(pool), hostname, events, task.time_limit, task.soft_time_limit,
            task.acks_late, *sorted((k, id(v)) for k, v in kwargs.items()))


def shared_factory(consumer: Any, create: Callable[..., Any]) -> Callable[..., Any]:
    """``create`` (Celery's factory), memoised per consumer by ``request_class_key``."""
    cache: dict[tuple[Any, ...], Any] = consumer.__dict__.setdefault(_CACHE_ATTR, {})

    def create_shared(base: Any, task: Any, pool: Any, hostname: Any, eventer: Any,
                      **kwargs: Any) -> Any:
        key = request_class_key(base, task, pool, hostname, eventer, kwargs)
        cls = cache.get(key)
        if cls is None:
            cls = cache[key] = create(base, task, pool, hostname, eventer, **kwargs)
        return cls

    return create_shared


def default(task: Any, app: Any, consumer: Any, **kwargs: Any) -> Any:
    """Celery's default strategy, sharing Request classes between tasks (see module)."""
    with _lock:
        original = _celery_strategy.create_request_cls
        _celery_strategy.create_request_cls = shared_factory(consumer, original)
        try:
            return _celery_strategy.default(task, app, consumer, **kwargs)
        finally:
            _celery_strategy.create_request_cls = original


@contextmanager
def collector_paused() -> Iterator[None]:
    """The garbage collector off for the block, back on after it unless it was off
    already (an app may run without it)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def build_without_collector(consumer: Any) -> None:
    """Make ``consumer.update_strategies`` (Celery's, unchanged: every task's strategy
    and tracer, at each start of the consumer and at a reload) run with the garbage
    collector paused, then make one full pass (see the module docstring). Idempotent."""
    if getattr(consumer, "_celery_ext_build_without_collector", False):
        return
    update = consumer.update_strategies

    def update_strategies() -> None:
        enabled = gc.isenabled()
        with collector_paused():
            update()
            if enabled:
                # Now, not in the drain (see the module docstring), and before the
                # collector is back on: the build's allocations are still counted while
                # it is paused, so turned on first it would make a young pass over every
                # object built (0.1-0.2 s at 10,000 job names) before this full one.
                gc.collect()

    consumer.update_strategies = update_strategies
    consumer._celery_ext_build_without_collector = True
