"""A silent connection or a stalled server: a probe on a fresh connection tells which.

A reply that is overdue means one of two things. The connection may be dead without a
reset (half-open: a NAT or load balancer dropped its state, the path to the peer
vanished): the server answers everyone else, this connection hears nothing, ever. Or
the server itself is stalled (DEBUG SLEEP, a blocking fork, a long script, CLIENT
PAUSE): every connection waits, and every reply comes when the stall ends. Reconnecting
cures the first and only adds connections to the second (the server answers none of
them either). So once a reply is ``reply_probe_after`` overdue the process sends a probe
(the ``probe`` script, held back by what holds the plugin's scripts back) on a fresh
connection, within ``probe_timeout``: answered, the server is live and the silent
connection is dropped; unanswered (or ``BUSY``), the server is stalled and the
connection waits on, up to its socket timeout (``reply_timeout``).

One probe at a time per server and process answers every connection that waits on it;
after an unanswered probe the next waits twice as long (up to ``PROBE_BACKOFF_MAX``).
Connections built by :func:`probing` classes do this in every blocking read (commands,
pipelines, the connection handshake); :func:`gone_silent` asks without blocking, for
replies read by an event loop (a fetch) or later (acks).
"""

from __future__ import annotations

import enum
import os
import select
import threading
from collections.abc import Callable
from dataclasses import dataclass
from time import monotonic
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from celery_ext.config import PROBE_BACKOFF_MAX, PROBE_GRACE
from celery_ext.store.scripts import source


class Verdict(enum.Enum):
    #: The server answered (or refused) a fresh connection after the silent request
    #: was sent: the silent connection is dead.
    ANSWERED = "answered"
    #: The probe went unanswered too (or got BUSY): the server is stalled; wait on.
    STALLED = "stalled"
    #: A probe is on its way (only without ``wait``).
    PENDING = "pending"


@dataclass(frozen=True)
class _Outcome:
    started: float
    finished: float
    answered: bool


class ServerProbe:
    """Probes one server for every connection of this process that waits on it."""

    def __init__(self, timeout: float, first_gap: float) -> None:
        self._timeout = timeout
        self._first_gap = self._gap = first_gap
        self._cond = threading.Condition()
        self._running: float | None = None  # when the probe on its way started
        self._last: _Outcome | None = None

    def verdict(self, since: float, wait: bool, connect: Callable[[], Any]) -> Verdict:
        """What a request sent at ``since`` (monotonic) and unanswered means: ANSWERED
        only from a probe started after ``since`` and finished ``PROBE_GRACE`` ago;
        STALLED from an unanswered probe until the backoff gap after it has passed.
        Starts a probe (on a connection from ``connect``) when neither holds and none
        is on its way; ``wait``: until it is decided, else PENDING meanwhile."""
        with self._cond:
            while True:
                now = monotonic()
                last = self._last
                if last is not None and last.answered and last.started >= since:
                    settled = last.finished + PROBE_GRACE
                    if now >= settled:
                        return Verdict.ANSWERED
                    if not wait:
                        return Verdict.PENDING
                    self._cond.wait(settled - now)
                    continue
                if self._running is not None:
                    if not wait:
                        return Verdict.PENDING
                    self._cond.wait(self._timeout * 2 + 1)  # (the probe bounds itself)
                    continue
                if last is not None and not last.answered and now < last.started + self._gap:
                    return Verdict.STALLED  # the server was stalled a moment ago: wait on
                self._running = now
                threading.Thread(target=self._run, args=(now, connect), daemon=True,
                                 name="celery_ext-probe").start()
                if not wait:
                    return Verdict.PENDING

    def _run(self, started: float, connect: Callable[[], Any]) -> None:
        answered = self._probe(connect)
        with self._cond:
            self._last = _Outcome(started, monotonic(), answered)
            self._running = None
            self._gap = self._first_gap if answered else min(self._gap * 2, PROBE_BACKOFF_MAX)
            self._cond.notify_all()

    @staticmethod
    def _probe(connect: Callable[[], Any]) -> bool:
        """Whether the server answers (or refuses) a fresh connection within the
        timeout; False when it is stalled (no answer, or BUSY running a script)."""
        conn: Any = None
        try:
            conn = connect()
            conn.connect()
            conn.send_command("EVAL", source("probe"), 0)
            conn.read_response()
        except redis.TimeoutError:
            return False  # connect or reply too slow: stalled, or unreachable for now
        except redis.ConnectionError:
            return True  # refused or reset: the server is gone, and the connection with it
        except redis.ResponseError as exc:
            return not str(exc).startswith("BUSY")
        except Exception:  # anything else says nothing about the server: wait on
            return False
        finally:
            try:
                if conn is not None:
                    conn.disconnect()
            except Exception:  # closing a broken socket
                pass
        return True


class ProbingConnection(redis.Connection):
    """A connection whose blocking reads ask a :class:`ServerProbe` once a reply is
    overdue, and fail with ``ConnectionError`` when the server answers a fresh
    connection meanwhile. Built by :func:`probing` over the class a client would use
    (TCP, TLS, Sentinel-managed)."""

    #: Seconds a reply may be overdue before the server is probed, and the probe's timeout.
    probe_after: float = 0.0
    probe_timeout: float = 0.0
    #: The redis-py class the probe's connection is made of (no probing, no hooks).
    probe_class: type[redis.Connection] = redis.Connection

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._probe_kwargs = dict(kwargs)
        #: When the connection last sent a request or read a reply: silence counts
        #: from there (the replies of a long pipeline each restart it).
        self._heard_at = 0.0
        #: ``check_health`` is connecting again (the connect's own checks do not).
        self._reconnecting = False

    def check_health(self) -> None:
        """A connection the server closed while it was idle (a restart, the server's
        ``timeout``, CLIENT KILL) is found by the health check's PING, before the request
        it precedes is sent: connect again instead of failing that request. Only the PING
        is repeated, and it changes nothing; a check that times out (a server that does
        not answer) still raises, and so does a failed connect (the checks it runs are
        plain ones)."""
        if self._reconnecting:
            super().check_health()
            return
        try:
            super().check_health()
        except redis.TimeoutError:
            raise
        except redis.ConnectionError:
            self.disconnect()
            self._reconnecting = True
            try:
                self.connect()
            finally:
                self._reconnecting = False

    def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        super().send_packed_command(command, check_health=check_health)
        self._heard_at = monotonic()

    def read_response(self, *args: Any, **kwargs: Any) -> Any:
        # A read with its own timeout (pub/sub) or a push (pub/sub message) may
        # legitimately wait long: only a reply to a request is watched.
        if "timeout" not in kwargs and not kwargs.get("push_request") and self._sock:
            self._await_reply()
        try:
            return super().read_response(*args, **kwargs)
        finally:
            self._heard_at = monotonic()

    def server_probe(self) -> ServerProbe:
        """This process's probe of this connection's server."""
        kwargs = self._probe_kwargs
        pool = kwargs.get("connection_pool")  # Sentinel: the master of a service name
        key = (os.getpid(), self.probe_class, kwargs.get("host"), kwargs.get("port"),
               kwargs.get("db"), getattr(pool, "service_name", None), self.probe_timeout)
        with _probes_lock:
            found = _probes.get(key)
            if found is None:
                found = _probes[key] = ServerProbe(self.probe_timeout, self.probe_after)
        return found

    def verdict(self, since: float, wait: bool) -> Verdict:
        """This connection's server probe's verdict on a request sent at ``since``."""
        return self.server_probe().verdict(since, wait, self._probe_connection)

    def _probe_connection(self) -> redis.Connection:
        t = self.probe_timeout
        kwargs = {**self._probe_kwargs, "socket_timeout": t, "socket_connect_timeout": t,
                  "health_check_interval": 0, "retry": Retry(NoBackoff(), 0)}
        return self.probe_class(**kwargs)

    def _await_reply(self) -> None:
        """Wait until the reply can be read; raise when the connection is found dead
        (the server answers a probe) or the socket timeout passes."""
        sent, cap = self._heard_at, self.socket_timeout
        if monotonic() - sent >= self.probe_after and self.can_read(timeout=0):
            return  # (a reply read long after its request: no probe for it)
        while True:
            now = monotonic()
            waited = now - sent
            if cap is not None and waited >= cap:
                self.disconnect()
                raise redis.TimeoutError(f"Timeout reading from {self._host_error()}")
            if waited >= self.probe_after:
                verdict = self.verdict(sent, wait=True)
                if verdict is Verdict.ANSWERED and not self.can_read(timeout=0):
                    self.disconnect()
                    raise redis.ConnectionError(
                        f"no reply from {self._host_error()} in {monotonic() - sent:.1f} s "
                        "while the server answers a new connection: the connection is "
                        "dead (half-open)")
                step = self.probe_after  # stalled: look again later
            else:
                step = self.probe_after - waited
            if cap is not None:
                step = min(step, max(0.0, cap - (monotonic() - sent)))
            if self.can_read(timeout=max(step, 0.001)):
                return


def probing(base: type[redis.Connection], probe_after: float,
            probe_timeout: float) -> type[ProbingConnection]:
    """``base`` (a redis-py TCP connection class, or a subclass such as Kombu's) whose
    blocking reads probe the server once a reply is ``probe_after`` seconds overdue."""
    if issubclass(base, ProbingConnection):
        return base
    # The probe connects with the redis-py class under any hooks (Kombu's subclass
    # reports its disconnects to the channel, which a probe must not do).
    plain = next(c for c in base.__mro__ if c.__module__.startswith("redis."))
    attrs = {"probe_after": probe_after, "probe_timeout": probe_timeout, "probe_class": plain}
    return type(f"Probing{base.__name__}", (ProbingConnection, base), attrs)


def gone_silent(conn: Any, since: float, cap: float | None) -> bool:
    """Without blocking: whether ``conn``, whose reply to a request sent at ``since``
    (monotonic) has not been read, is dead: unanswered past ``cap`` seconds, or past
    its ``probe_after`` while the server answers a fresh connection (a probe is sent
    when due; a later call learns its verdict). Reads nothing from ``conn``."""
    waited = monotonic() - since
    if cap is not None and waited >= cap:
        return True
    if not isinstance(conn, ProbingConnection) or waited < conn.probe_after:
        return False
    if conn.verdict(since, wait=False) is not Verdict.ANSWERED:
        return False
    return not _readable(conn)


def _readable(conn: Any) -> bool:
    """Whether ``conn``'s socket has bytes to read, without reading them (an event
    loop may wait on that socket)."""
    sock = getattr(conn, "_sock", None)
    if sock is None:
        return False
    try:
        return bool(select.select([sock], [], [], 0)[0])
    except (OSError, ValueError):
        return True  # closed or broken: the reader finds out


#: This process's probes, by server (``ProbingConnection.server_probe``).
_probes: dict[tuple[Any, ...], ServerProbe] = {}
_probes_lock = threading.Lock()
