"""The test apps the tests' ``celery worker`` subprocesses run."""

from __future__ import annotations

import threading
from typing import Any

import redis

#: Timeouts of the clients the test apps' jobs record their runs with: long, because a
#: run that cannot be recorded fails its job. redis-py's own default (5 s) was reached
#: on a machine loaded by other work, and the job went to the dead set for it.
RECORDER_TIMEOUTS = {"socket_timeout": 60.0, "socket_connect_timeout": 60.0}

_recorders: dict[tuple[str, tuple[tuple[str, Any], ...]], redis.Redis] = {}
_recorders_lock = threading.Lock()


def record_client(url: str, **options: Any) -> redis.Redis:
    """This process's one client on ``url`` (``RECORDER_TIMEOUTS``, then ``options``):
    made once, under a lock, and never replaced.

    A client made lazily without the lock is made more than once when a threads pool's
    jobs start together, and a module global keeps the last one. The one it drops is
    collected at once, and ``Redis.__del__`` closes the pool ``from_url`` made for it,
    connections in use included: a job connecting through it finds its new socket closed
    (``EBADF``, "Connection closed by server") or mute in its handshake, and fails
    (``tests/integration/test_record_clients.py``)."""
    key = (url, tuple(sorted(options.items())))
    client = _recorders.get(key)  # every record write asks: the lock only to make one
    if client is None:
        with _recorders_lock:
            client = _recorders.get(key)
            if client is None:
                client = _recorders[key] = redis.Redis.from_url(
                    url, **{**RECORDER_TIMEOUTS, **options})
    return client
