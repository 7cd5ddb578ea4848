"""The connection a producer writes its jobs on, and the Redis protocol it writes.

A publish is one ``EVALSHA`` (and a ``WAIT`` with ``wait_replicas``): packed here by
hiredis into one buffer and written on one kept connection of the channel's, so a
publish costs one write and one read, not redis-py's per-command bookkeeping. The
:class:`~celery_ext.producer.publish.Enqueuer` decides what to write; this module only
carries it, and says when it could not (:data:`NOT_SENT`), so the caller falls back to
redis-py's client and its retries.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from contextlib import suppress
from typing import Any

import hiredis
import redis

#: What :meth:`PublishConnection.send` returns when it did not get a reply.
NOT_SENT = object()


def pack_command(*parts: str | int) -> bytes:
    """A short command in the Redis protocol (``WAIT n ms``)."""
    return hiredis.pack_command(parts)  # type: ignore[arg-type]


class PublishConnection:
    """One connection of a channel's connections, kept for the producer's script calls.

    ``connections`` returns the channel's current redis-py connections (its
    ``ConnectionPool``); the connection is taken from them at first use and again when
    they changed or the process forked (a child never writes on its parent's socket).
    They still own it: closing the channel disconnects it with the others.
    """

    def __init__(self, connections: Callable[[], Any]) -> None:
        self._connections_of = connections
        self._lock = threading.Lock()
        self._connections: Any = None
        self._conn: Any = None
        self._pid = 0
        #: Replies :meth:`start` left for :meth:`finish` to read.
        self._sent = 0

    def send(self, commands: list[bytes]) -> Any:
        """Send the packed ``commands`` on the kept connection in one write and return
        their replies, an error reply (NOSCRIPT, out of memory, ...) as its exception in
        place; or :data:`NOT_SENT` when the connection is busy in another thread or failed
        (the caller then sends them through its client, with redis-py's retries)."""
        if not self.start(commands):
            return NOT_SENT
        return self.finish()

    def start(self, commands: list[bytes]) -> bool:
        """:meth:`send` without reading the replies: the connection stays busy until
        :meth:`finish` does (a bulk builds its next round trip meanwhile)."""
        if not self._lock.acquire(blocking=False):
            return False
        try:
            conn = self._connection()
            try:
                conn.send_packed_command([b"".join(commands)], check_health=False)
            except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError):
                with suppress(Exception):
                    conn.disconnect()
                self._lock.release()
                return False
        except BaseException:
            self._lock.release()
            raise
        self._sent = len(commands)
        return True

    def finish(self) -> Any:
        """The replies of what :meth:`start` sent, as :meth:`send` returns them."""
        try:
            conn = self._conn
            try:
                replies: list[Any] = []
                for _ in range(self._sent):
                    try:
                        replies.append(conn.read_response())
                    except redis.exceptions.ResponseError as exc:
                        replies.append(exc)  # the reply was read whole: read on
                return replies
            except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError):
                with suppress(Exception):
                    conn.disconnect()  # its replies may still come: never read them later
                return NOT_SENT
        finally:
            self._sent = 0
            self._lock.release()

    def _connection(self) -> Any:
        connections = self._connections_of()
        if (self._conn is None or connections is not self._connections
                or self._pid != os.getpid()):
            if self._conn is not None and self._pid == os.getpid():
                with suppress(Exception):
                    self._connections.release(self._conn)
            self._connections, self._pid = connections, os.getpid()
            self._conn = connections.get_connection()
        return self._conn
