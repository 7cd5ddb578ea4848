"""The Celery app benchmark workers and clients run (``celery -A bench.app worker``).

Everything comes from environment variables, so one module serves both transports
and every workload (the harness sets them for each subprocess):

- ``BENCH_BROKER_URL``  broker URL; ``redis://`` = stock Kombu, ``celery-ext://`` = ours
- ``BENCH_MODE``        ``stock`` or ``ours`` (``dramatiq``: see ``bench.dramatiq_app``)
- ``BENCH_INSTALL``     ours only: ``1`` (default) calls ``celery_ext.install(app)``, ``0`` is
  drop-in (only the broker URL is ours)
- ``BENCH_BACKEND``     ``1`` configures a Redis result backend (db 1 of the same server);
  the jobs still ignore their results (``task_ignore_result``), as a new user's no-op
  task with ``ignore_result=True`` would
- ``BENCH_NAMES``       number of counting job names ``bench.job_0000``... (default 1)
- ``BENCH_WEIGHTS``     comma-separated weights, one job name each (fairness workload)
- ``BENCH_LATENCY``     ``1`` registers only ``bench.latency``
- ``BENCH_ACKS_LATE``   ``1`` sets ``task_acks_late=True``, else ``False`` (set for both)
- ``BENCH_COUNT_LIMIT`` fairness: only the first N completions are counted per name
- ``BENCH_QUEUES``      one job name spread over this many queues ``bench.q_0000``...
  (many_queues' "1 job name over N queues": the queues' cost without Celery's
  per-task-name cost); the client enqueues round-robin over them
- ``BENCH_FLOOR``       ``1``: tasks use ``bench.floor.strategy`` (the drain's floor: no
  Celery Request or tracer); ``2``: ``bench.floor.kept_strategy`` (the floor plus the
  least a request path keeping Celery's semantics does); see ``bench.floor``
- ``BENCH_CLUSTER``     ``1``: the broker URL is a seed node of a Redis Cluster (ours, with
  the transport option ``cluster``; ``bench.cluster``)
- ``BENCH_WAIT``        seconds each job waits before it counts (``time.sleep``: under
  ``-P gevent`` the monkey-patched, cooperative sleep, a job waiting on I/O; ``bench.green``)
- ``BENCH_SHARED_BACKEND`` ``1`` sets Celery's ``result_backend_thread_safe`` (one result
  backend for every thread or greenlet; what ``celery_ext`` does under gevent for the
  disabled and the Redis backend): stock with that setting, in ``bench.green``
- ``BENCH_COUNTER_URL`` where the jobs count their completions, if not db 2 of the
  broker's server (a cluster has no db 2: ``bench.cluster`` counts on a one-node server)

Jobs count their completions with one ``INCR`` on db 2 of the same server (the
same cost for both transports); no task events, no result stored.
Stock routes each job name to its own queue (``task_queues`` + ``task_routes``),
so with many names it consumes as many queues as ours does.
"""

from __future__ import annotations

import os
import time
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import redis
from celery import Celery
from celery.signals import worker_ready
from kombu import Queue

BROKER_URL = os.environ.get("BENCH_BROKER_URL", "redis://127.0.0.1:6379/0")
MODE = os.environ.get("BENCH_MODE", "stock")
NAMES = int(os.environ.get("BENCH_NAMES", "1"))
WEIGHTS = [int(w) for w in os.environ.get("BENCH_WEIGHTS", "").split(",") if w]
LATENCY = os.environ.get("BENCH_LATENCY") == "1"
ACKS_LATE = os.environ.get("BENCH_ACKS_LATE") == "1"
COUNT_LIMIT = int(os.environ.get("BENCH_COUNT_LIMIT", "0"))
QUEUES = int(os.environ.get("BENCH_QUEUES", "0"))
INSTALL = MODE == "ours" and os.environ.get("BENCH_INSTALL", "1") == "1"
BACKEND = os.environ.get("BENCH_BACKEND") == "1"
CLUSTER = os.environ.get("BENCH_CLUSTER") == "1"
FLOOR = {"1": "bench.floor:strategy", "2": "bench.floor:kept_strategy"}.get(
    os.environ.get("BENCH_FLOOR", ""), "")
COUNTER_URL = os.environ.get("BENCH_COUNTER_URL", "")
WAIT = float(os.environ.get("BENCH_WAIT", "0") or 0)
#: The queues one job name is spread over (empty unless BENCH_QUEUES is set).
QUEUE_NAMES = [f"bench.q_{i:04d}" for i in range(QUEUES)]

#: Redis keys (db 2) the jobs and workers write for the harness.
COUNTER_KEY = "bench:done"
SHARE_KEY = "bench:share"
LATENCY_KEY = "bench:latency"
READY_KEY = "bench:ready"
COUNTER_DB = 2
#: The counter client's connection bound (``counter``).
COUNTER_CONNECTIONS = 1000
#: The result backend's db when ``BENCH_BACKEND=1`` (nothing is stored there: no job
#: keeps its result; configuring it is what costs, in ``apply_async``).
BACKEND_DB = 1

if MODE == "ours":
    import celery_ext  # registers the celery-ext:// scheme


def counter_url(broker_url: str = BROKER_URL, db: int = COUNTER_DB) -> str:
    """Plain ``redis://`` URL of another db on the broker's server (the counter's URL
    when ``BENCH_COUNTER_URL`` names one)."""
    if COUNTER_URL and db == COUNTER_DB:
        return COUNTER_URL
    parts = urlsplit(broker_url)
    return urlunsplit(("redis", parts.netloc, f"/{db}", parts.query, ""))


app = Celery("bench", broker=BROKER_URL,
             backend=counter_url(db=BACKEND_DB) if BACKEND else None)
app.conf.update(
    task_ignore_result=True,
    task_acks_late=ACKS_LATE,
    worker_hijack_root_logger=False,
    broker_connection_retry_on_startup=True,
    worker_send_task_events=False,
    task_send_sent_event=False,
)
if os.environ.get("BENCH_SHARED_BACKEND") == "1":
    app.conf["result_backend_thread_safe"] = True
if CLUSTER:
    app.conf.broker_transport_options = {"cluster": True}

_counter: redis.Redis | None = None
_share_script: Any = None


def counter() -> redis.Redis:
    """This process's client for the counter db (made lazily: after a prefork fork).
    Room for ``COUNTER_CONNECTIONS`` at once: under ``-P gevent -c 200`` every greenlet may
    count at the same instant, past redis-py's default bound."""
    global _counter
    if _counter is None:
        _counter = redis.Redis.from_url(counter_url(), max_connections=COUNTER_CONNECTIONS)
    return _counter


# Fairness: count a completion for its job name only while fewer than the limit are done.
_COUNT_SHARE = """
local n = redis.call('INCR', KEYS[1])
if n <= tonumber(ARGV[2]) then redis.call('HINCRBY', KEYS[2], ARGV[1], 1) end
return n
"""


def job_name(i: int) -> str:
    return f"bench.job_{i:04d}"


def _make_job(i: int, weight: int | None = None) -> Any:
    name = job_name(i)
    if COUNT_LIMIT:
        def job() -> None:
            global _share_script
            if _share_script is None:
                _share_script = counter().register_script(_COUNT_SHARE)
            _share_script(keys=[COUNTER_KEY, SHARE_KEY], args=[name, COUNT_LIMIT])
    elif WAIT:
        def job() -> None:
            time.sleep(WAIT)
            counter().incr(COUNTER_KEY)
    else:
        def job() -> None:
            counter().incr(COUNTER_KEY)

    job.__name__ = job.__qualname__ = f"job_{i:04d}"
    options: dict[str, Any] = {"name": name}
    if weight is not None:
        options["weight"] = weight
    return app.task(**options)(job)


def _latency(sent: float) -> None:
    started = time.time()  # same host, same clock as the sender's stamp
    if WAIT:
        time.sleep(WAIT)
    counter().rpush(LATENCY_KEY, repr(started - sent))


if LATENCY:
    TASKS = [app.task(name="bench.latency")(_latency)]
elif WEIGHTS:
    TASKS = [_make_job(i, w) for i, w in enumerate(WEIGHTS)]
elif QUEUE_NAMES:
    TASKS = [_make_job(0)]
    # Both transports: a worker started without -Q consumes every one of these.
    app.conf.task_queues = [Queue(q, routing_key=q) for q in QUEUE_NAMES]
else:
    TASKS = [_make_job(i) for i in range(NAMES)]

if INSTALL:
    celery_ext.install(app)
elif not QUEUE_NAMES:
    # Stock and drop-in: one queue per job name too, all consumed by a worker started
    # without -Q (install() does this for ours).
    names = [t.name for t in TASKS]
    app.conf.task_queues = [Queue(n, routing_key=n) for n in names]
    app.conf.task_routes = {n: {"queue": n} for n in names}
if FLOOR:
    app.Task.Strategy = FLOOR


@worker_ready.connect
def _on_ready(sender: Any = None, **kwargs: Any) -> None:
    """Tell the harness this worker consumes (it waits for this key)."""
    counter().sadd(READY_KEY, str(os.getpid()))

