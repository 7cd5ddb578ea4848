"""Acks without waiting for their replies: one ``ack`` script per job, written on a
connection of its own; the replies are read later, in order.

A synchronous ack (send, wait, read, parse) was a quarter of a prefork pool's main
process in the profile. Redis applies a command when it receives it, not when its
reply is read, so the worker writes the script and goes on. Replies are read when they
are already there (at the next ack), when more than ``MAX_UNREAD`` are pending, and at
``close()``. An error reply (``NOSCRIPT`` after a server restart) or a lost connection
hands the tags concerned to the synchronous path (``fallback``); acks are idempotent
(a tag no longer in the in-flight record is ignored), so resending is safe.
"""

from __future__ import annotations

import os
import threading
from collections import deque
from collections.abc import Callable
from typing import Any

import redis

from . import scripts as _scripts

#: Ack replies left unread before an ack waits for the oldest ones.
MAX_UNREAD = 64
#: Seconds ``close()`` waits for the replies still unread.
CLOSE_TIMEOUT = 2.0

_CONNECTION_ERRORS = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError)


class AckSender:
    """Sends ``ack`` scripts for one pool on a dedicated connection (thread-safe)."""

    def __init__(self, pool: Any, fallback: Callable[[list[str]], None]) -> None:
        self._pool = pool  # the redis-py connection pool whose settings the connection uses
        self._fallback = fallback
        self._lock = threading.Lock()
        self._conn: Any = None
        self._pid = 0
        self._unread: deque[list[str]] = deque()  # tags of each ack whose reply is unread

    def connect(self) -> None:
        """Open the connection now (before the first ack needs it)."""
        with self._lock:
            try:
                self._connection().connect()
            except _CONNECTION_ERRORS:
                self._disconnect()  # the first ack tries again, or falls back

    def ack(self, keys: list[str], args: list[Any], tags: list[str]) -> None:
        """Send ``ack`` for ``tags`` (``keys``/``args``: the script's, tags last)."""
        resend: list[str] = []
        with self._lock:
            try:
                conn = self._connection()
                self._read(conn, MAX_UNREAD - 1, resend)
                conn.send_command("EVALSHA", _scripts.sha("ack"), len(keys), *keys, *args)
                self._unread.append(tags)
            except _CONNECTION_ERRORS:
                resend += self._drop()
                resend += tags
        if resend:
            self._fallback(resend)

    def close(self) -> None:
        """Read every pending reply (resending what failed) and drop the connection."""
        resend: list[str] = []
        with self._lock:
            conn = self._conn
            if conn is not None and self._pid == os.getpid():
                try:
                    self._read(conn, 0, resend, timeout=CLOSE_TIMEOUT)
                except _CONNECTION_ERRORS:
                    resend += self._drop()
            self._unread.clear()
            self._disconnect()
        if resend:
            self._fallback(resend)

    def _connection(self) -> Any:
        if self._conn is None or self._pid != os.getpid():
            # (A forked child never acks for its parent: it gets a connection of its own.)
            self._unread.clear()
            self._conn = self._pool.connection_class(**self._pool.connection_kwargs)
            self._pid = os.getpid()
        return self._conn

    def _read(self, conn: Any, keep: int, resend: list[str],
              timeout: float | None = None) -> None:
        """Read replies while more than ``keep`` are unread or one is already there."""
        unread = self._unread
        while unread and (len(unread) > keep or conn.can_read(timeout=0)):
            tags = unread[0]
            try:
                if timeout is None:
                    conn.read_response()
                else:
                    conn.read_response(timeout=timeout)
            except redis.exceptions.ResponseError:
                resend += tags
            unread.popleft()

    def _drop(self) -> list[str]:
        """The connection failed: every unread ack may or may not have been applied."""
        tags = [t for batch in self._unread for t in batch]
        self._unread.clear()
        self._disconnect()
        return tags

    def _disconnect(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None and self._pid == os.getpid():
            try:
                conn.disconnect()
            except Exception:  # closing a broken socket
                pass
