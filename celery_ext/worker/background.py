"""The loop a worker pool's part runs in a thread of its own, started and stopped by the
worker pool (:class:`celery_ext.worker.worker_pool.WorkerPool`).

The heartbeater, the reaper, the requeuer and the periodic leader each run one loop around
a one-shot step that tests call directly (``heartbeat()``, ``reap()``, ``promote()``,
``step()``, as gocraft/work's parts do); this class is the thread around it: ``start()``
is idempotent, ``stop()`` ends the loop and joins the thread. Our threads are named
``celery_ext-<part>``, so a test or an operator can tell them apart.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

logger = logging.getLogger("celery_ext.worker.background")

#: Longest a part's ``stop()`` waits for its thread to end (seconds); a thread blocked on an
#: unreachable Redis is a daemon and does not keep the process alive.
JOIN_TIMEOUT = 5.0
#: Slowest a part's thread reacts to ``stop()`` while it waits on a pub/sub channel.
STOP_POLL = 0.25


class BackgroundLoop:
    """A thread running :meth:`_run` until :meth:`stop_loop`."""

    #: The thread's name: ``celery_ext-<part>``.
    thread_name = "celery_ext-background"

    def __init__(self) -> None:
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _run(self) -> None:
        raise NotImplementedError

    def start(self) -> None:
        if self._thread is not None:
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name=self.thread_name, daemon=True)
        self._thread.start()

    def stop_loop(self) -> None:
        """End the loop and join its thread (the part's own ``stop()`` then says goodbye:
        deregisters, hands its lease over)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=JOIN_TIMEOUT)
            self._thread = None

    @staticmethod
    def _close_listener(pubsub: Any, what: str) -> None:
        """Close a pub/sub listener after a Redis error (the loop subscribes anew before
        its next pass); a failure to close only matters to a debug log."""
        try:
            pubsub.close()
        except Exception:
            logger.debug("celery_ext: closing the %s listener failed", what, exc_info=True)

    def _wait_for_message(self, pubsub: Any, seconds: float) -> None:
        """Wait ``seconds``, or until ``pubsub`` (when there is one) delivers a message,
        or the loop is stopped."""
        deadline = time.monotonic() + seconds
        while not self._stop.is_set():
            left = deadline - time.monotonic()
            if left <= 0:
                return
            if pubsub is None:
                self._stop.wait(min(left, STOP_POLL))
            elif pubsub.get_message(timeout=min(left, STOP_POLL)) is not None:
                return
