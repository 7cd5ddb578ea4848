"""Acks without waiting for their replies: one ``ack`` script per batch of jobs, written on a
connection of its own; the replies are read later, in order.

A synchronous ack (send, wait, read, parse) was a quarter of a prefork pool's main
process in the profile. Redis applies a command when it receives it, not when its
reply is read, so the worker writes the script and goes on. Replies are read when they
are already there (``poll()``, about once a second from the worker's event loop), half
of them once ``MAX_UNREAD`` are pending (one read, no probe of the socket per ack), and
at ``close()``. An error reply (``NOSCRIPT`` after a server restart) or a lost connection
hands the tags concerned to the synchronous path (``fallback``); acks are idempotent
(a tag no longer in the in-flight record is ignored), so resending is safe. Each reply
read without error confirms its tags (``on_confirmed``). A connection that goes silent
(half-open: no reply, no reset) is noticed by ``poll()`` once the oldest unread reply
is overdue while the server answers a fresh connection (``store/probe.py``): it is
dropped and its acks resent like those of a lost one.
"""

from __future__ import annotations

import os
import threading
from collections import deque
from collections.abc import Callable
from time import monotonic
from typing import Any

import redis

from celery_ext.errors import CONNECTION_ERRORS
from celery_ext.store import scripts as _scripts
from celery_ext.store.probe import gone_silent

#: Ack replies left unread before an ack waits for the oldest ones.
MAX_UNREAD = 64
#: Seconds ``close()`` waits for the replies still unread.
CLOSE_TIMEOUT = 2.0


class AckSender:
    """Sends ``ack`` scripts for one pool on a dedicated connection (thread-safe)."""

    def __init__(self, pool: Any, fallback: Callable[[list[str]], None],
                 on_confirmed: Callable[[list[str]], None] | None = None) -> None:
        self._pool = pool  # the redis-py connection pool whose settings the connection uses
        self._fallback = fallback
        self._on_confirmed = on_confirmed
        self._lock = threading.Lock()
        self._conn: Any = None
        self._pid = 0
        #: Tags of each ack whose reply is unread, and when that ack was sent.
        self._unread: deque[tuple[list[str], float]] = deque()

    def connect(self) -> None:
        """Open the connection now (before the first ack needs it)."""
        with self._lock:
            try:
                self._connection().connect()
            except CONNECTION_ERRORS:
                self._disconnect()  # the first ack tries again, or falls back

    def ack(self, keys: list[str], args: list[Any], tags: list[str]) -> None:
        """Send ``ack`` for ``tags`` (``keys``/``args``: the script's, tags last)."""
        resend: list[str] = []
        confirmed: list[str] = []
        with self._lock:
            try:
                conn = self._connection()
                if len(self._unread) >= MAX_UNREAD:
                    self._read(conn, MAX_UNREAD // 2, resend, confirmed, probe=False)
                # Packed by hiredis: redis-py's packer took 8x as long (13 against 1.6 µs
                # for an ack of three jobs), once per ack call of a prefork pool's loop.
                conn.send_packed_command([_scripts.pack_evalsha(_scripts.sha("ack"), keys, args)])
                self._unread.append((tags, monotonic()))
            except CONNECTION_ERRORS:
                resend += self._drop()
                resend += tags
        self._report(resend, confirmed)

    def poll(self) -> None:
        """Read the replies already there, without waiting: a connection that broke
        after an ack was written shows up here, and one gone silent (its acks go to
        the fallback)."""
        resend: list[str] = []
        confirmed: list[str] = []
        with self._lock:
            conn = self._conn
            if conn is not None and self._pid == os.getpid() and self._unread:
                try:
                    self._read(conn, len(self._unread), resend, confirmed)
                except CONNECTION_ERRORS:
                    resend += self._drop()
                if self._unread and gone_silent(conn, self._unread[0][1], conn.socket_timeout):
                    resend += self._drop()
        self._report(resend, confirmed)

    def flush(self) -> None:
        """Read every pending reply now (resending what failed); keep the connection."""
        self._read_all(drop=False)

    def close(self) -> None:
        """Read every pending reply (resending what failed) and drop the connection."""
        self._read_all(drop=True)

    def _read_all(self, drop: bool) -> None:
        resend: list[str] = []
        confirmed: list[str] = []
        with self._lock:
            conn = self._conn
            if conn is not None and self._pid == os.getpid():
                try:
                    self._read(conn, 0, resend, confirmed, timeout=CLOSE_TIMEOUT)
                except CONNECTION_ERRORS:
                    resend += self._drop()
            if drop:
                self._unread.clear()
                self._disconnect()
        self._report(resend, confirmed)

    def _report(self, resend: list[str], confirmed: list[str]) -> None:
        if confirmed and self._on_confirmed is not None:
            self._on_confirmed(confirmed)
        if resend:
            self._fallback(resend)

    def _connection(self) -> Any:
        if self._conn is None or self._pid != os.getpid():
            # (A forked child never acks for its parent: it gets a connection of its own.)
            self._unread.clear()
            self._conn = self._pool.connection_class(**self._pool.connection_kwargs)
            self._pid = os.getpid()
        return self._conn

    def _read(self, conn: Any, keep: int, resend: list[str], confirmed: list[str],
              timeout: float | None = None, probe: bool = True) -> None:
        """Read replies while more than ``keep`` are unread or (``probe``) one is
        already there."""
        unread = self._unread
        while unread and (len(unread) > keep or (probe and conn.can_read(timeout=0))):
            tags = unread[0][0]
            # The wait is bounded by can_read, which every redis-py of the declared range
            # has (read_response(timeout=...) is redis-py 8's only); once the reply's first
            # bytes are there, the rest of it comes within the socket's timeout.
            if timeout is not None and not conn.can_read(timeout=timeout):
                raise redis.exceptions.TimeoutError(
                    f"no ack reply within {timeout:g} s ({len(unread)} unread)")
            try:
                conn.read_response()
            except redis.exceptions.ResponseError:
                resend += tags
            else:
                confirmed += tags
            unread.popleft()

    def _drop(self) -> list[str]:
        """The connection failed: every unread ack may or may not have been applied."""
        tags = [t for batch, _ in self._unread for t in batch]
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


class SyncAcks:
    """The :class:`AckSender` interface for a pool whose acks are applied at once by
    ``fallback`` (on a cluster, where one pool's acks go to several masters)."""

    def __init__(self, fallback: Callable[[list[str]], None]) -> None:
        self._fallback = fallback

    def connect(self) -> None:
        """Nothing to open: the pool's client connects on use."""

    def ack(self, keys: list[str], args: list[Any], tags: list[str]) -> None:
        self._fallback(tags)

    def poll(self) -> None:
        """No replies wait: every ack was applied when it was made."""

    def flush(self) -> None:
        """No replies wait: every ack was applied when it was made."""

    def close(self) -> None:
        """No connection of its own to drop."""
