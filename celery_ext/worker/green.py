"""What changes when a worker's jobs are greenlets (``-P gevent``), called at its start.

**The result backend is shared.** gevent's monkey-patching makes ``threading.local`` local
to each greenlet, and Celery keeps the app's result backend in one (``Celery.backend``)
unless the backend says it is thread-safe: every job then builds a backend of its own,
and a Redis result backend a connection pool of its own, which the next job does not
reuse. The disabled backend (no ``result_backend``) holds nothing, and a Redis backend's
client is a pool that serves any number of greenlets, so both are shared across the
worker's greenlets (the Redis one bounded like our own clients, ``GREEN_MAX_CONNECTIONS``,
unless ``redis_max_connections`` says otherwise). Other backends keep Celery's default
(one per greenlet): whether they may be shared is theirs to say, with
``result_backend_thread_safe``, or with a ``shared_by_greenlets`` class attribute (celery-ext's
result backend, whose clients are sized for every greenlet as the channels' are).

**Kombu's retry sleep yields.** ``celery worker -P gevent`` patches the standard library
first thing (``celery.maybe_patch_concurrency`` -> ``gevent.monkey.patch_all``). While
gevent patches ``threading`` it walks every live object to replace existing locks, which
touches Celery's lazy module proxies; they import ``celery._state`` -> ``celery.utils`` ->
``kombu.utils``, and ``kombu.utils.functional`` binds ``from time import sleep`` before
gevent has patched ``time``. That ``sleep`` is the blocking one, and it is the sleep of
``retry_over_time``: the wait between the consumer's reconnect attempts ("Trying again
in 2.00 seconds...") and between a publish's retries. Under gevent it stopped the whole
process, every job's greenlet and the heartbeat's with it, for the length of the
backoff: a cut of half a second froze a pool for 2 s, its jobs finished seconds late and
a ``dead_after`` of 2 s had the live pool reaped (the ``connection_cut_gevent`` fault
scenario).
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Any

from celery.app.backends import by_url
from celery.backends.base import DisabledBackend
from celery.backends.redis import RedisBackend

from celery_ext.config import GREEN_MAX_CONNECTIONS

logger = logging.getLogger("celery_ext.worker.green")

#: The setting Celery's backends read (not among Celery's documented defaults).
THREAD_SAFE = "result_backend_thread_safe"
#: The Redis result backend's connection bound (Celery's setting).
MAX_CONNECTIONS = "redis_max_connections"
#: Result backends whose one instance serves every greenlet of a worker.
SHAREABLE_BACKENDS: tuple[type, ...] = (DisabledBackend, RedisBackend)


def share_result_backend(app: Any) -> bool:
    """Make ``app``'s result backend one instance for every greenlet, if it is one of
    ``SHAREABLE_BACKENDS`` (else leave Celery's choice); whether it is shared now."""
    conf = app.conf
    if conf.get(THREAD_SAFE):
        return True
    # Which class Celery would make, without making one (as ``Celery._get_backend``).
    cls, _ = by_url(getattr(app, "backend_cls", None) or conf.result_backend, app.loader)
    # celery-ext's own backend says so itself (``results/`` is not imported from here).
    if not (issubclass(cls, SHAREABLE_BACKENDS) or getattr(cls, "shared_by_greenlets", False)):
        return False
    conf[THREAD_SAFE] = True
    if issubclass(cls, RedisBackend) and not conf.get(MAX_CONNECTIONS):
        # One client now serves every greenlet that stores a result at once: room for
        # them all, as the channels have (redis-py's default of 100 made jobs fail).
        conf[MAX_CONNECTIONS] = GREEN_MAX_CONNECTIONS
    logger.debug("celery_ext: the %s result backend is shared by the worker's greenlets",
                 cls.__name__)
    return True


def cooperative_retry_sleep() -> bool:
    """Under gevent's patching, make Kombu's retry sleep gevent's (it yields to the other
    greenlets); returns whether it had to. A process gevent did not patch is left alone:
    there a blocking sleep blocks one thread, as it should."""
    monkey = sys.modules.get("gevent.monkey")
    if monkey is None or not monkey.is_module_patched("time"):
        return False
    from kombu.utils import functional

    if functional.sleep is not monkey.get_original("time", "sleep"):
        return False
    functional.sleep = time.sleep  # gevent's, now that ``time`` is patched
    logger.debug("celery_ext: Kombu's retry sleep made cooperative under gevent")
    return True
