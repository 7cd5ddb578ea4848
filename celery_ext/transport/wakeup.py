"""Idle wake-ups: what makes a channel fetch again once its queues looked empty.

When every consumed queue is empty, nothing is polled. The channel listens on the
``wake`` pub/sub channel (announced by ``enqueue`` when a queue becomes non-empty) and
re-reads the ``ready`` set once per ``idle_refresh_interval`` in case a notification
was missed. A wake-up read while a fetch is on the wire outlives that fetch's "empty"
reply (``readiness.ReadyQueues``). A rate-limited queue whose next job is not due yet
(``options/rate_limits.py``) comes back in the fetch reply with its wait; the channel
sets one event-loop timer for the earliest such time and fetches from the other queues
meanwhile.

:class:`Wakeups` does this for one channel; :class:`MultiChannelPoller`, Kombu's
poller, listens on the wake-up connections beside the fetch and fanout ones.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from contextlib import suppress
from queue import Empty
from time import monotonic
from typing import TYPE_CHECKING, Any

from kombu.transport import redis as kredis
from kombu.utils.encoding import bytes_to_str
from kombu.utils.eventio import READ

from celery_ext.worker.worker_pool import register_poll

if TYPE_CHECKING:
    from celery_ext.transport.channel import Channel

logger = logging.getLogger("celery_ext.transport.wakeup")


class Wakeups:
    """The wake-up listener, the ready-set refresh and the rate-limit timer of one
    channel."""

    def __init__(self, channel: Channel) -> None:
        self.channel = channel
        #: The connection the subscription was sent on (False: not sent on the
        #: registered one; None: it failed).
        self.listening: Any = False
        self._client: Any = None
        self._last_refresh = 0.0
        #: The event-loop timer that wakes rate-limited queues, and when it fires.
        self._timer: Any = None
        self._timer_at: float | None = None

    # -- the wake pub/sub --------------------------------------------------------------
    @property
    def client(self) -> Any:
        """Pub/Sub connection that hears which job queues became non-empty."""
        if self._client is None:
            self._client = self.channel._create_client(asynchronous=True).pubsub()
        return self._client

    def subscribe(self) -> None:
        c = self.client
        if c.connection._sock is None:
            c.connection.connect()
        self.listening = c.connection
        c.subscribe(self.channel.keys.wake_channel)

    def read(self) -> bool:
        """Read every wake-up waiting on the connection (the poller's ``WAKE``
        handler)."""
        c = self.client
        try:
            self._on_wake(c.parse_response())
            while c.connection is not None and c.connection.can_read(timeout=0):
                self._on_wake(c.parse_response())
        except self.channel.connection_errors:
            self.listening = None
            raise
        return False

    def _on_wake(self, response: Any) -> None:
        if not isinstance(response, list | tuple) or len(response) < 3:
            return
        kind = bytes_to_str(response[0])
        if kind == "message":
            self.channel._ready.woken([bytes_to_str(response[2])])
        elif kind == "subscribe":
            self.channel._ready.subscribed()

    # -- the ready set -----------------------------------------------------------------
    def maybe_refresh_ready(self) -> None:
        """Re-read the ready set if some consumed queue is believed empty (1 command);
        let the worker pool look at its acks and in-flight record."""
        channel = self.channel
        if channel._worker_pool is not None:
            channel._worker_pool.tick()
        channel._ready.release_due(monotonic())
        if channel._ready.all_active():
            return
        now = monotonic()
        if now - self._last_refresh < channel.settings.idle_refresh_interval * 0.9:
            return
        self._last_refresh = now
        self.refresh_ready()

    def refresh_ready(self) -> None:
        """Mark every consumed queue in the ``ready`` set active (1 command), after the
        topology's look at the queues' own lists when one is due (a cluster's)."""
        channel = self.channel
        found = channel.topology.recheck(lambda: [q for q in channel._active_queues
                                                  if q not in channel.active_fanout_queues])
        if found:
            channel._ready.woken(found)
        with channel.conn_or_acquire() as client:
            ready = client.smembers(channel.keys.ready)
        channel._ready.woken([bytes_to_str(name) for name in ready], refresh=True)

    # -- rate limits -------------------------------------------------------------------
    def throttle(self, waits: list[tuple[str, float]]) -> None:
        """Rate-limited queues whose next job is due in so many seconds: keep them
        inactive until then, with one event-loop timer for the earliest."""
        self.channel._ready.throttle(waits, monotonic())
        self._arm_timer()

    def _arm_timer(self) -> None:
        due = self.channel._ready.next_due()
        loop = getattr(self.channel.connection, "event_loop", None)
        if due is None or loop is None:
            return  # no loop: MultiChannelPoller.get waits no longer than ``due``
        if self._timer_at is not None and self._timer_at <= due:
            return  # the timer already set fires first
        if self._timer is not None:
            self._timer.cancel()
        self._timer_at = due
        self._timer = loop.call_later(max(0.0, due - monotonic()), self._timer_due)

    def _timer_due(self) -> None:
        self._timer = self._timer_at = None
        self.channel._ready.release_due(monotonic())
        self._arm_timer()

    def close(self) -> None:
        """Cancel the timer and drop the wake-up connection (the channel closes).

        The connection is disconnected while the subscription still names it: Kombu's
        disconnect hook finds a registered socket by its client's connection, and only
        then takes its reader off the event loop (else the closed channel's reader
        stays on the hub)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = self._timer_at = None
        wake = self._client
        if wake is not None:
            with suppress(Exception):
                if wake.connection is not None:
                    wake.connection.disconnect()
            wake.connection = None


#: The per-turn hook Kombu's Redis transport puts on an event loop
#: (``kombu.transport.redis.Transport.register_with_event_loop``).
KOMBU_POLL_START = "Transport.register_with_event_loop.<locals>.on_poll_start"


def _kombu_poll_start_of(hook: Any, cycle: Any) -> bool:
    """Whether ``hook`` (an ``on_tick`` callback) is Kombu's per-turn hook for ``cycle``."""
    code, cells = getattr(hook, "__code__", None), getattr(hook, "__closure__", None)
    if getattr(hook, "__qualname__", None) != KOMBU_POLL_START or code is None or not cells:
        return False
    cell = dict(zip(code.co_freevars, cells, strict=False)).get("cycle")
    return cell is not None and cell.cell_contents is cycle


#: Longest a poll waits once the worker is stopping (seconds). It does wait, and yields: a
#: loop that polls again at once (Celery's green remote-control loop does) would
#: otherwise spin and, under gevent, never let another greenlet run.
STOPPING_POLL = 0.1


class WakePipe:
    """A pipe the poller watches while it waits without an event loop (Celery's
    ``synloop``, under gevent), written to end that wait: when an ack frees prefetch
    credit the poll waits for (the job acks in its own greenlet, and nothing else the
    poll watches becomes readable then, so the next fetch would wait out the whole drain
    timeout, 2 s in Celery's loop), and when the worker stops. With an event loop, its
    tick looks at the credit after every turn instead."""

    def __init__(self) -> None:
        self._read_fd = self._write_fd = -1
        #: The poll waits for credit: the next ack writes a byte (then disarms).
        self.armed = False

    @property
    def read_fd(self) -> int:
        """The read end, -1 until the pipe is made."""
        return self._read_fd

    def fileno(self) -> int:
        """The read end (the pipe is made at first use)."""
        if self._read_fd < 0:
            self._read_fd, self._write_fd = os.pipe()
            os.set_blocking(self._read_fd, False)
            os.set_blocking(self._write_fd, False)
        return self._read_fd

    def credit_freed(self) -> None:
        """An ack or reject freed a prefetch slot: wake the poll if it waits for one."""
        if not self.armed:
            return
        self.armed = False
        self.wake()

    def wake(self) -> None:
        """End the poll's wait (if it watches the pipe)."""
        if self._write_fd >= 0:
            with suppress(BlockingIOError, OSError):  # (full: a byte is there already)
                os.write(self._write_fd, b"\0")

    def drain(self) -> None:
        with suppress(BlockingIOError, OSError):
            while os.read(self._read_fd, 4096):
                pass

    def close(self) -> None:
        self.armed = False
        for fd in (self._read_fd, self._write_fd):
            if fd >= 0:
                with suppress(OSError):
                    os.close(fd)
        self._read_fd = self._write_fd = -1


class MultiChannelPoller(kredis.MultiChannelPoller):
    """Adds the WAKE pub/sub listener, the idle refresh and, without an event loop, the
    wake pipe (``WakePipe``) to Kombu's poller."""

    def __init__(self) -> None:
        super().__init__()
        self.wake_pipe = WakePipe()
        #: ``get`` is polling (no event loop: the wake pipe applies).
        self._in_get = False
        self._pipe_registered: Any = None
        #: The worker is stopping: ``get`` returns at once (``stop_soon``).
        self.stopping = False
        #: This poller's per-turn hook on an event loop (``take_turns``): (loop, hook).
        self._turn_hook: tuple[Any, Callable[[], None]] | None = None
        #: Adds every socket's reader to the event loop again (``take_turns``).
        self._add_readers: Callable[[], None] | None = None
        register_poll(self)

    def take_turns(self, loop: Any, on_readable: Callable[[int], Any]) -> None:
        """Replace Kombu's per-turn hook on ``loop`` with one that adds a socket's reader
        only when the loop does not have it.

        Kombu's hook adds every socket (fetch, wake-up, fanout) as a reader at each turn
        of the loop: a failed ``epoll_ctl`` and the exception around it, three per turn,
        about three turns per job in a prefork pool's main process. The epoll side needs
        none of it: a socket is registered by ``_register`` when it is new, and every way
        one leaves (a disconnect, a paused fetch, the loop's own error handling) also
        takes it out of the loop's readers, which this hook then adds again. Once per
        ``idle_refresh_interval`` (``maybe_refresh_ready``) every reader is added again
        as Kombu does, in case a socket closed by any other way left its number to a new
        one. A Kombu whose hook is not found keeps its own."""
        kombu_hooks = [hook for hook in loop.on_tick if _kombu_poll_start_of(hook, self)]
        if not kombu_hooks:
            return
        for hook in kombu_hooks:
            loop.on_tick.discard(hook)
        if self._turn_hook is not None:
            old_loop, old_hook = self._turn_hook
            old_loop.on_tick.discard(old_hook)
        readers, add_reader, poll_start = loop.readers, loop.add_reader, self.on_poll_start

        def on_poll_start() -> None:
            poll_start()
            paused = self._paused_brpop
            for fd in self._fd_to_chan:
                if fd not in paused:
                    entry = readers.get(fd)
                    if entry is None or entry[0] != on_readable:
                        add_reader(fd, on_readable, fd)

        def add_readers() -> None:
            for fd in self.fds:
                add_reader(fd, on_readable, fd)

        loop.on_tick.add(on_poll_start)
        self._turn_hook = (loop, on_poll_start)
        self._add_readers = add_readers

    @property
    def draining(self) -> bool:
        """A ``drain_events`` call is polling (no event loop): one event per call."""
        return self._in_get

    def stop_soon(self) -> None:
        """The worker is stopping: end the current wait and return from every later
        ``get`` at once, so Celery's loop without an event loop reads its shutdown flag
        now rather than after its 2 s ``drain_events``."""
        self.stopping = True
        self.wake_pipe.wake()

    def on_poll_start(self) -> None:
        self._update_brpop_polling()
        starved = False
        for channel in self._channels:
            # Not ``channel.active_queues``: Kombu rebuilds that list on every call, a
            # cost that grows with the number of job queues, on every loop turn.
            fanout = channel.active_fanout_queues
            if any(q not in fanout for q in channel._active_queues):
                self._register_WAKE(channel)
                if not self._fetch(channel):
                    starved = True
            if channel.active_fanout_queues:
                self._register_LISTEN(channel)
        if self._in_get:
            self._watch_pipe()
            self.wake_pipe.armed = starved

    def _fetch(self, channel: Channel) -> bool:
        """Send a fetch on the channel's connection unless one is on the wire or it has
        nothing to fetch from (``Fetcher.start``); False: no prefetch credit."""
        if not channel.qos.can_consume():
            return False
        self._check_idle_fetch_connection(channel)
        self._register_BRPOP(channel)
        return True

    def _check_idle_fetch_connection(self, channel: Channel) -> None:
        """Before a fetch is sent on an idle connection, its health check (when due)
        finds a connection the server closed meanwhile (a restart, the server's
        ``timeout``, CLIENT KILL) and connects again (``ProbingConnection.check_health``):
        the poller then watches the new socket, so the fetch's reply is heard."""
        conn = getattr(channel.client, "connection", None)
        if channel._in_poll or conn is None or conn._sock is None:
            return
        conn.check_health()
        ident = (channel, channel.client, "BRPOP")
        if ident in self._chan_to_sock and self._chan_to_sock[ident] is not conn._sock:
            self._register(*ident)

    def _watch_pipe(self) -> None:
        """Make sure this poll watches the wake-up pipe (credit freed, worker stopping)."""
        fd = self.wake_pipe.fileno()
        if self._pipe_registered is not self.poller:
            self.poller.register(fd, READ)
            self._pipe_registered = self.poller

    def credit_freed(self) -> None:
        self.wake_pipe.credit_freed()

    def close(self) -> None:
        super().close()
        if self._pipe_registered is not None:
            with suppress(KeyError, ValueError, OSError):
                self._pipe_registered.unregister(self.wake_pipe.read_fd)
            self._pipe_registered = None
        self.wake_pipe.close()

    def _register_WAKE(self, channel: Channel) -> None:
        wakeups = channel.wakeups
        if not self._client_registered(channel, wakeups.client, "WAKE"):
            wakeups.listening = False
            self._register(channel, wakeups.client, "WAKE")
        if not wakeups.listening:
            wakeups.subscribe()

    def on_readable(self, fileno: int) -> None:
        chan_type = self._fd_to_chan.get(fileno)
        if chan_type is not None and chan_type[1] == "WAKE":
            # Reading a wake-up never consumes prefetch credit: always drain it,
            # or a level-triggered poller would spin on the readable socket.
            channel = chan_type[0]
            channel.handlers["WAKE"]()
            if not channel._in_poll and channel._ready.has_active():
                # The fetch goes out now, not at the loop's next turn: an idle pool's
                # job waits for this round trip, and a turn (timers, the other tick
                # callbacks) was a fifth of the way from the wake-up to the fetch.
                self._fetch(channel)
            return
        super().on_readable(fileno)

    def handle_event(self, fileno: int, event: int) -> Any:
        if fileno == self.wake_pipe.read_fd:
            # Credit came back: read the byte; ``get`` returns Empty and Kombu's
            # drain_events calls it again, which fetches (or, stopping, returns).
            self.wake_pipe.drain()
            return None
        # Kombu's handle_event reports every readable socket as a delivery, so
        # drain_events() (pidbox replies, kombu consumers) would return on a wake-up
        # that delivered nothing. Read it and let drain_events() keep waiting.
        chan_type = self._fd_to_chan.get(fileno)
        if chan_type is not None and chan_type[1] == "WAKE" and event & READ:
            self.on_readable(fileno)
            return None
        return super().handle_event(fileno, event)

    def maybe_refresh_ready(self) -> None:
        if self._add_readers is not None:
            self._add_readers()  # (take_turns: what Kombu's hook did at every turn)
        for channel in list(self._channels):
            channel.fetcher.check_reply()  # raises: the consumer reconnects
            try:
                channel.wakeups.maybe_refresh_ready()
            except channel.connection_errors:
                logger.debug("celery_ext: ready refresh failed, will retry", exc_info=True)

    def get(self, callback: Any, timeout: float | None = None) -> Any:
        # One event per drain_events call: a job a former call's fetch brought comes
        # first, without a round trip.
        for channel in self._channels:
            if channel.fetcher.kept and channel.qos.can_consume() \
                    and channel.fetcher.deliver_kept():
                return None
        self.maybe_refresh_ready()
        # Without an event loop (a plain Kombu consumer) no timer wakes a rate-limited
        # queue: wait no longer than until it is due.
        due = [d for d in (c._ready.next_due() for c in self._channels) if d is not None]
        if due:
            wait = max(0.0, min(due) - monotonic())
            timeout = wait if timeout is None else min(timeout, wait)
        if self.stopping:
            timeout = STOPPING_POLL if timeout is None else min(timeout, STOPPING_POLL)
        self._in_get = True
        try:
            return super().get(callback, timeout=timeout)
        except Empty:
            if self.stopping:  # (Kombu's drain_events would poll again until its timeout)
                raise TimeoutError("celery_ext: the worker is stopping") from None
            raise
        finally:
            self._in_get = False
            self.wake_pipe.armed = False
