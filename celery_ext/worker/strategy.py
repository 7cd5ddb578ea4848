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

``LazyStrategies`` builds each task's strategy and tracer on the first message of
that task instead of all of them when the consumer starts. Celery's
``Consumer.update_strategies`` builds one of each for every registered task before
the first fetch: at 10,000 job names that was 27 % of a worker's start to its first
job (py-spy), for tasks most of which a worker of one queue never sees.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from celery.app.trace import build_tracer
from celery.utils.imports import symbol_by_name
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


class LazyStrategies(dict[str, Any]):
    """A consumer's ``strategies``, each built on the first message of its task.

    Celery's task handler (``Consumer.create_task_handler``) looks a message's task
    up with ``strategies[name]`` and takes a ``KeyError`` for an unregistered task;
    ``__missing__`` builds what ``update_strategies`` would have built for a task the
    app has (its strategy, and its tracer, which ``fast_trace_task`` reads in the
    executor), and raises ``KeyError`` for any other name, so an unknown task takes
    Celery's path as before. Only the consumer's thread looks strategies up.
    """

    def __init__(self, consumer: Any) -> None:
        super().__init__()
        self.consumer = consumer
        #: How many strategies were built (the tests count them).
        self.built = 0

    def __missing__(self, name: str) -> Any:
        c = self.consumer
        task = c.app.tasks.get(name)  # dict.get: no NotRegistered from the registry
        if task is None:
            raise KeyError(name)
        strategy = task.start_strategy(c.app, c)
        task.__trace__ = build_tracer(name, task, c.app.loader, c.hostname, app=c.app)
        self[name] = strategy
        self.built += 1
        return strategy

    def reset(self) -> None:
        """``Consumer.update_strategies``: forget every strategy built (a restarted
        consumer has a new pool and event dispatcher; a new task may be bound), and
        import each distinct Strategy and Request class the tasks name, so a task naming
        one that does not import still stops the worker at start, as Celery's eager
        build does."""
        self.clear()
        paths = {(task.Strategy, task.Request) for task in self.consumer.app.tasks.values()}
        for strategy, request in paths:
            symbol_by_name(strategy)
            symbol_by_name(request)


def lazy_strategies(consumer: Any) -> LazyStrategies:
    """Give ``consumer`` strategies built on first use (see :class:`LazyStrategies`):
    its ``strategies`` (which Celery's task handler captures when the consumer starts,
    so the same object is kept across restarts) and its ``update_strategies``."""
    strategies = consumer.strategies
    if not isinstance(strategies, LazyStrategies):
        strategies = consumer.strategies = LazyStrategies(consumer)
        consumer.update_strategies = strategies.reset
    return strategies
