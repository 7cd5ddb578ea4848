"""The celery_ext Kombu transport: Kombu's Redis transport with job-system semantics.

What changes against ``redis://`` (everything else, fanout/events/remote control
over PUB/SUB included, is inherited unchanged, and ``driver_type`` stays ``redis``):

* Job queues are lists under ``{ns}:queue:<name>``; producers push with the
  ``enqueue`` script, which also keeps the ``ready`` set and wakes idle pools, and
  writes a publish retried by Kombu only once (``producer.py``).
* Consuming: instead of ``BRPOP`` the channel sends one ``fetch`` script per round
  trip. The pool's weighted round-robin (``sampler``) picks up to ``prefetch``
  candidate queues among those believed non-empty; the script pops one job per
  candidate and records it in the pool's in-flight hash in the same atomic step.
* Idle: when every consumed queue is empty, nothing is polled. The channel listens
  on the ``wake`` pub/sub channel (announced by ``enqueue`` when a queue becomes
  non-empty) and re-reads the ``ready`` set once per ``idle_refresh_interval`` in
  case a notification was missed. A wake-up read while a fetch is on the wire
  outlives that fetch's "empty" reply (``Channel._activate``).
* Ack removes the job from the in-flight hash (O(1)); reject-with-requeue and the
  restore at shutdown put jobs back at the *front* of their queue. There is no
  visibility timeout: a job leaves the in-flight record only when its pool acks it,
  returns it, or is declared dead by the reaper.
"""

from __future__ import annotations

import logging
import ssl
import time
import weakref
from collections.abc import Iterable, Iterator
from contextlib import contextmanager, suppress
from queue import Empty
from time import monotonic
from typing import Any

import redis
from kombu.transport import redis as kredis
from kombu.transport import virtual
from kombu.utils.encoding import bytes_to_str
from kombu.utils.eventio import READ
from kombu.utils.json import loads

from . import scripts as _scripts
from .acks import AckSender
from .clock import now_s
from .config import Settings
from .dead import dead_letter, one_line
from .envelope import envelope_problem
from .errors import BrokerOutOfMemory, job_name
from .heartbeater import Heartbeater, heartbeater_for
from .keys import Keys
from .producer import Enqueuer
from .sampler import WeightedRoundRobin
from .weights import weight_of

logger = logging.getLogger("celery_ext.transport")

#: URL schemes registered for this transport (plain and TLS).
SCHEME = "celery-ext"
TLS_SCHEME = "celery-exts"

#: Channels of this process that consume from job queues: their unacked jobs are
#: the only in-flight records of this pool that are legitimately outstanding.
_live_channels: weakref.WeakSet[Channel] = weakref.WeakSet()
#: Errors of the connection while delivering a job (not of the job): they propagate.
_IO_ERRORS = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError)
#: Set when a channel closed without returning its jobs (Redis unreachable); the
#: next channel to fetch returns the leftovers first.
_pending_recovery: set[tuple[str, str]] = set()


class QoS(virtual.QoS):
    """Prefetch accounting in memory; ownership lives in Redis (the in-flight hash)."""

    restore_at_shutdown = True
    channel: Channel

    def append(self, message: Any, delivery_tag: str) -> None:
        # The fetch script already recorded the job as in flight, atomically.
        super().append(message, delivery_tag)

    def ack(self, delivery_tag: str) -> None:
        self.channel._ack_nowait([delivery_tag])
        super().ack(delivery_tag)

    def reject(self, delivery_tag: str, requeue: bool = False) -> None:
        if requeue:
            self.channel._requeue([delivery_tag])
        else:
            self.channel._dead_letter(delivery_tag, "rejected", "rejected by the consumer")
        super().ack(delivery_tag)

    def restore_unacked(self, client: Any = None) -> list[Any]:
        """Return every job fetched and not acked to the front of its queue, in order.

        Jobs running right now are left in the in-flight record: their channel may be
        closing (connection loss) but their pool lives and acks them when they end."""
        self._flush()
        running = running_tags()
        tags = [t for t in self._delivered if t not in running]
        errors: list[Any] = []
        if tags:
            try:
                self.channel._requeue(tags)
            except Exception as exc:
                errors = [(exc, self._delivered[t]) for t in tags]
                self.channel._mark_needs_recovery()
        self._delivered.clear()
        return errors

    def restore_visible(self, *args: Any, **kwargs: Any) -> None:
        """No visibility timeout: dead pools' jobs are requeued by the reaper."""

    def forget(self, delivery_tag: str) -> None:
        """Drop a tag from prefetch accounting only (Redis was already updated)."""
        super().ack(delivery_tag)

    def live_tags(self) -> set[str]:
        return {t for t in self._delivered if t not in self._dirty}


_QoS = QoS


def running_tags() -> set[str]:
    """Delivery tags of the jobs this worker process is executing now (Celery's
    ``active_requests``); empty outside a Celery worker."""
    try:
        from celery.worker.state import active_requests
    except ImportError:  # pragma: no cover - kombu used without celery
        return set()
    tags = set()
    for request in list(active_requests):
        message = getattr(request, "message", None)
        tag = getattr(message, "delivery_tag", None)
        if tag:
            tags.add(tag)
    return tags


class MultiChannelPoller(kredis.MultiChannelPoller):
    """Adds the WAKE pub/sub listener and the idle refresh to Kombu's poller."""

    def on_poll_start(self) -> None:
        self._update_brpop_polling()
        for channel in self._channels:
            # Not ``channel.active_queues``: Kombu rebuilds that list on every call, which
            # with 1,000 job queues was 12% of a prefork pool's main process (profiled).
            fanout = channel.active_fanout_queues
            if any(q not in fanout for q in channel._active_queues):
                self._register_WAKE(channel)
                if channel.qos.can_consume():
                    self._register_BRPOP(channel)
            if channel.active_fanout_queues:
                self._register_LISTEN(channel)

    def _register_WAKE(self, channel: Channel) -> None:
        if not self._client_registered(channel, channel.wakeclient, "WAKE"):
            channel._in_wake = False
            self._register(channel, channel.wakeclient, "WAKE")
        if not channel._in_wake:
            channel._wake_subscribe()

    def on_readable(self, fileno: int) -> None:
        chan_type = self._fd_to_chan.get(fileno)
        if chan_type is not None and chan_type[1] == "WAKE":
            # Reading a wake-up never consumes prefetch credit: always drain it,
            # or a level-triggered poller would spin on the readable socket.
            chan_type[0].handlers["WAKE"]()
            return
        super().on_readable(fileno)

    def handle_event(self, fileno: int, event: int) -> Any:
        # Kombu's handle_event reports every readable socket as a delivery, so
        # drain_events() (pidbox replies, kombu consumers) would return on a wake-up
        # that delivered nothing. Read it and let drain_events() keep waiting.
        chan_type = self._fd_to_chan.get(fileno)
        if chan_type is not None and chan_type[1] == "WAKE" and event & READ:
            self.on_readable(fileno)
            return None
        return super().handle_event(fileno, event)

    def maybe_refresh_ready(self) -> None:
        for channel in list(self._channels):
            try:
                channel.maybe_refresh_ready()
            except channel.connection_errors:
                logger.debug("celery_ext: ready refresh failed, will retry", exc_info=True)

    def get(self, callback: Any, timeout: float | None = None) -> Any:
        self.maybe_refresh_ready()
        return super().get(callback, timeout=timeout)


class Channel(kredis.Channel):
    """Redis channel whose queues are job queues with crash-safe, weighted fetch."""

    QoS = QoS
    qos: _QoS
    from_transport_options = kredis.Channel.from_transport_options + Settings.option_names()

    _in_wake: Any = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        conn = args[0] if args else kwargs["connection"]
        self.settings = Settings.load(conn.client.transport_options)
        self.keys = Keys(self.settings.namespace)
        self._sched = WeightedRoundRobin(default_weight=self.settings.default_weight)
        self._no_ack_queues: set[str] = set()
        self._predeclared_sizes: dict[str, int] = {}
        self._prebound: set[tuple[str, str, str, str]] = set()
        self._last_refresh = 0.0
        # Queues found non-empty (wake-up, ready refresh) while a fetch is on the wire,
        # and whether the wake-up channel was (re)subscribed meanwhile. See _activate.
        self._woken_in_fetch: set[str] = set()
        self._resubscribed_in_fetch = False
        self._heartbeater: Heartbeater | None = None
        super().__init__(*args, **kwargs)
        self.handlers["WAKE"] = self._wake_read
        self._scripts = _scripts.Scripts(self.client)
        # The event loop sends fetch by SHA without redis-py's NOSCRIPT fallback.
        with self.conn_or_acquire() as client:
            self._scripts.load_all(client)
            # Redis time minus local time: jobs are stamped on the one clock.
            self._clock_offset = now_s(client) - time.time()

    # -- connection details ----------------------------------------------------------
    def _connparams(self, asynchronous: bool = False) -> dict[str, Any]:
        conninfo = self.connection.client
        if conninfo.transport_cls == TLS_SCHEME and not conninfo.ssl:
            # Secure by default: verify the server certificate unless told otherwise
            # (e.g. ?ssl_cert_reqs=none in the URL, as with rediss://).
            conninfo.ssl = {"ssl_cert_reqs": ssl.CERT_REQUIRED}
        return super()._connparams(asynchronous=asynchronous)

    @contextmanager
    def conn_or_acquire(self, client: Any = None) -> Iterator[Any]:
        """Like Kombu's, but reuse one client per channel and connection pool:
        Kombu builds a fresh ``redis.Redis`` for every publish, a sixth of the cost
        of ``apply_async``. (redis-py clients are thread-safe over their pool.)"""
        if client:
            yield client
            return
        pool = self.pool
        cached = self.__dict__.get("_cached_client")
        if cached is None or cached.connection_pool is not pool:
            cached = self.__dict__["_cached_client"] = self._create_client()
        yield cached

    @property
    def server_id(self) -> str:
        """Which server this channel talks to; kept after close, when Kombu has
        dropped ``self.connection`` but acks of jobs still running must go on."""
        sid = self.__dict__.get("_server_id")
        if sid is None:
            c = self.connection.client
            sid = self.__dict__["_server_id"] = f"{c.hostname}:{c.port}/{c.virtual_host}"
        return sid

    def _new_sync_client(self) -> redis.Redis:
        params = self._connparams(asynchronous=False)
        return redis.Redis(connection_pool=redis.ConnectionPool(**params))

    @property
    def wakeclient(self) -> Any:
        """Pub/Sub connection that hears which job queues became non-empty."""
        client = self.__dict__.get("_wakeclient")
        if client is None:
            client = self.__dict__["_wakeclient"] = self._create_client(asynchronous=True).pubsub()
        return client

    # -- producing ---------------------------------------------------------------------
    @property
    def enqueuer(self) -> Enqueuer:
        """Writes this channel's published jobs (the producer path, :mod:`.producer`)."""
        enqueuer = self.__dict__.get("_enqueuer")
        if enqueuer is None:
            enqueuer = self.__dict__["_enqueuer"] = Enqueuer(
                self.settings, self.keys, self._scripts, self.conn_or_acquire, self._expires,
                clock_offset=getattr(self, "_clock_offset", 0.0))
        return enqueuer

    def basic_publish(self, message: Any, exchange: str, routing_key: str,
                      **kwargs: Any) -> Any:
        try:
            result = super().basic_publish(message, exchange, routing_key, **kwargs)
        except redis.exceptions.OutOfMemoryError as exc:
            # Not retried as a connection error: Redis stays full until someone acts.
            raise BrokerOutOfMemory(
                f"job {job_name(message, routing_key)} was not enqueued", exc) from None
        Enqueuer.published(message)
        return result

    def _put(self, queue: str, message: Any, **kwargs: Any) -> None:
        self.enqueuer.put(queue, message, kwargs.pop("_publish_batch", None))

    def create_publish_batch(self, max_size: int) -> Any:
        batch = super().create_publish_batch(max_size)
        self.enqueuer.load_batch_scripts()
        return batch

    # -- queue management --------------------------------------------------------------
    def _size(self, queue: str) -> int:
        size = self._predeclared_sizes.pop(queue, None)
        if size is not None:  # read by predeclared() a moment ago, in the same start-up
            return size
        with self.conn_or_acquire() as client:
            return int(client.llen(self.keys.queue(queue)))

    def _purge(self, queue: str) -> int:
        with self.conn_or_acquire() as client, client.pipeline() as pipe:
            pipe.llen(self.keys.queue(queue)).delete(self.keys.queue(queue))
            pipe.srem(self.keys.ready, queue)
            size = pipe.execute()[0]
            return int(size)

    def _has_queue(self, queue: str, **kwargs: Any) -> bool:
        with self.conn_or_acquire() as client:
            return bool(client.exists(self.keys.queue(queue)))

    def _delete(self, queue: str, exchange: str, routing_key: str, pattern: str,
                *args: Any, **kwargs: Any) -> None:
        self.auto_delete_queues.discard(queue)
        member = self.sep.join([routing_key or "", pattern or "", queue or ""])
        with self.conn_or_acquire(client=kwargs.get("client")) as client, \
                client.pipeline() as pipe:
            pipe.srem(self.keyprefix_queue % (exchange,), member)
            pipe.srem(self.keyprefix_binding_permanent % (exchange,), member)
            pipe.delete(self.keys.queue(queue))
            pipe.srem(self.keys.ready, queue)
            pipe.execute()

    def _maybe_update_queues_expire(self, client: Any, queue: str) -> None:
        if self._expires and queue in self._expires:
            client.pexpire(self.keys.queue(queue), self._expires[queue])

    @contextmanager
    def predeclared(self, queues: Iterable[Any]) -> Iterator[None]:
        """Declare many queues in one round trip: a worker consuming 1,000 job queues
        otherwise spends two round trips per queue at start (Kombu's ``queue_declare``
        reads the size, ``queue_bind`` adds the binding). Inside the block, the
        per-queue ``_size`` and ``_queue_bind`` of these queues use what this pipeline
        did; only plain queues on a direct exchange (no expiry or extra bindings)
        are handled here, the others go the usual way."""
        binds: dict[str, list[str]] = {}
        prebound: set[tuple[str, str, str, str]] = set()
        names: list[str] = []
        for q in queues:
            ex = q.exchange
            if (q.no_declare or q.bindings or q.expires is not None or q.queue_arguments
                    or not q.name or (ex is not None and ex.name and ex.type != "direct")):
                continue
            if ex is not None and ex.name:  # Kombu binds only queues with a named exchange
                rkey, pattern, _ = self.exchange_types["direct"].prepare_bind(
                    q.name, ex.name, q.routing_key, q.binding_arguments)
                binds.setdefault(ex.name, []).append(
                    self.sep.join([rkey or "", pattern or "", q.name]))
                prebound.add((ex.name, rkey, pattern, q.name))
            names.append(q.name)
        if len(names) > 1:
            try:
                with self.conn_or_acquire() as client, \
                        client.pipeline(transaction=False) as pipe:
                    for name in names:
                        pipe.llen(self.keys.queue(name))
                    for exchange, members in binds.items():
                        pipe.sadd(self.keyprefix_queue % (exchange,), *members)
                        pipe.sadd(self.keyprefix_binding_permanent % (exchange,), *members)
                    sizes = pipe.execute()[:len(names)]
            except redis.exceptions.ResponseError:
                # e.g. out of memory: let the per-queue path report it on its queue.
                logger.debug("celery_ext: batched queue declaration failed", exc_info=True)
            else:
                self._predeclared_sizes = dict(zip(names, map(int, sizes), strict=True))
                self._prebound = prebound
        try:
            yield
        finally:
            self._predeclared_sizes = {}
            self._prebound = set()

    def _queue_bind(self, exchange: str, routing_key: str, pattern: str, queue: str) -> None:
        key = (exchange, routing_key, pattern, queue)
        if key in self._prebound:
            self._prebound.discard(key)  # written by predeclared()
            return
        try:
            super()._queue_bind(exchange, routing_key, pattern, queue)
        except redis.exceptions.OutOfMemoryError:
            # Redis is full: write the binding anyway, so a worker starts and drains it;
            # an enqueue is still refused, at publish.
            self._bind_at_maxmemory(exchange, routing_key, pattern, queue)

    def _refresh_bindings(self, queues: Any) -> None:
        """Kombu's periodic refresh of expiring bindings (the remote-control queue),
        also at maxmemory: otherwise Kombu logs a traceback each time and, after the
        binding TTL, ``celery inspect`` stops reaching a pool that is draining a full
        Redis."""
        try:
            super()._refresh_bindings(queues)
        except redis.exceptions.OutOfMemoryError:
            for queue in queues:
                for exchange, routing_key, args in self.state.queue_bindings(queue):
                    _, pattern, _ = self.typeof(exchange).prepare_bind(
                        queue, exchange, routing_key, args)
                    self._bind_at_maxmemory(exchange, routing_key, pattern, queue)

    def _bind_at_maxmemory(self, exchange: str, routing_key: str, pattern: str,
                           queue: str) -> None:
        """Kombu's binding writes through bind.lua, which may run at maxmemory."""
        ttl = int(self._binding_ttl(queue)) if queue in self._expires else 0
        keys = [self.keyprefix_queue % (exchange,),
                self._script_binding_deadlines if ttl
                else self.keyprefix_binding_permanent % (exchange,)]
        member = self.sep.join([routing_key or "", pattern or "", queue or ""])
        with self.conn_or_acquire() as client:
            self._scripts("bind", keys, [member, exchange, ttl], client=client)

    # -- consuming ---------------------------------------------------------------------
    def basic_consume(self, queue: str, no_ack: bool, *args: Any, **kwargs: Any) -> Any:
        if "\n" in queue:
            raise ValueError(f"celery_ext: queue name {queue!r} must not contain a newline")
        if no_ack:
            self._no_ack_queues.add(queue)
        else:
            self._no_ack_queues.discard(queue)
        ret = super().basic_consume(queue, no_ack, *args, **kwargs)
        if queue not in self.active_fanout_queues:
            self._sched.add_queues({queue: weight_of(queue, self.settings.default_weight)})
        _live_channels.add(self)
        return ret

    def _basic_cancel(self, consumer_tag: str) -> Any:
        queue = self._tag_to_queue.get(consumer_tag)
        ret = super()._basic_cancel(consumer_tag)
        if queue is not None and queue not in self._active_queues:  # (may be consumed twice)
            self._sched.remove_queues([queue])
        return ret

    def _update_queue_cycle(self) -> None:
        """Unused: Kombu calls this after every basic_consume and basic_cancel to
        rebuild its cycle from every consumed queue (quadratic in the number of job
        queues: 0.1 s to start and 0.6 s to stop a pool with 1,000, profiled); those
        two methods above change the one queue in the pool's scheduler instead."""

    def basic_get(self, queue: str, no_ack: bool = False, **kwargs: Any) -> Any:
        jobs = self._fetch_sync([queue], track=not no_ack)
        if not jobs:
            return None
        qname, tag, payload, rec = jobs[0]
        raw = self._decode(qname, tag, payload, rec)
        if raw is None:
            return None
        message = self.Message(raw, channel=self)
        if not no_ack:
            self.qos.append(message, message.delivery_tag)
        return message

    def _get(self, queue: str, timeout: float | None = None) -> Any:
        jobs = self._fetch_sync([queue], track=False)
        for qname, tag, payload, rec in jobs:
            raw = self._decode(qname, tag, payload, rec)
            if raw is not None:
                return raw
        raise Empty()

    @property
    def pool_id(self) -> str:
        return self._ensure_pool().pool_id

    def _ensure_pool(self) -> Heartbeater:
        """Register this process's pool (once) before its first tracked fetch."""
        if self._heartbeater is None:
            self._heartbeater = heartbeater_for(self._new_sync_client, self.settings,
                                                self.server_id)
        key = (self.server_id, self.settings.namespace)
        if key in _pending_recovery:
            _pending_recovery.discard(key)
            self._recover_leftovers()
        return self._heartbeater

    def _fetch_keys(self, pool_id: str, queues: list[str]) -> list[str]:
        k = self.keys
        return [k.inflight(pool_id), k.pools, k.ready, k.redelivery, k.inflight_pools,
                k.running, k.limits, k.paused, *(k.queue(q) for q in queues)]

    def _fetch_sync(self, queues: list[str], track: bool) -> list[Any]:
        pool_id = self._ensure_pool().pool_id if track else "-"
        flags = ("1" if track else "0") * len(queues)
        with self.conn_or_acquire() as client:
            for _ in range(2):
                status, jobs, _empties, _blocked = self._scripts(
                    "fetch", self._fetch_keys(pool_id, queues), [pool_id, flags, *queues],
                    client=client)
                if status:
                    return list(jobs)
                self._ensure_pool().revive()
        return []

    def _brpop_start(self, timeout: Any = None) -> None:
        """Send one fetch (instead of BRPOP) for up to the free prefetch slots."""
        sched = self._sched
        if not sched.has_active():
            return  # idle: the WAKE listener and the ready refresh take over
        credit = self.qos.can_consume_max_estimate()
        n = self.settings.fetch_batch if credit is None else min(credit, self.settings.fetch_batch)
        if n <= 0:
            return
        picks = sched.take(n)
        no_ack = self._no_ack_queues
        flags = "".join("0" if q in no_ack else "1" for q in picks)
        pool_id = self._ensure_pool().pool_id if "1" in flags else "-"
        if pool_id != "-" and "_ack_sender" not in self.__dict__:
            self._new_ack_sender().connect()  # connected before the first ack waits on it
        keys = self._fetch_keys(pool_id, picks)
        conn = self.client.connection
        self._in_poll = conn
        if self._woken_in_fetch:  # (only wake-ups during this fetch count)
            self._woken_in_fetch.clear()
        self._resubscribed_in_fetch = False
        self._brpop_sent_at = monotonic()
        conn.send_command("EVALSHA", _scripts.sha("fetch"), len(keys), *keys,
                          pool_id, flags, *picks)

    def _brpop_read(self, **options: Any) -> bool:
        conn = self.client.connection
        pending = self._in_poll
        try:
            try:
                reply = self.client.parse_response(conn, "EVALSHA", **options)
            except self.connection_errors:
                conn.disconnect()
                self._sched.activate_many(self._sched.queues)
                raise
            except redis.exceptions.NoScriptError:
                # The server restarted and lost its script cache: load and go on.
                with self.conn_or_acquire() as client:
                    self._scripts.load_all(client)
                raise Empty() from None
        finally:
            self._in_poll = None
        if not pending:
            raise Empty()
        status, jobs, empties, blocked = reply
        # Empty queues wait for a wake-up; paused ones and those at their
        # max_concurrency too (resume and ack publish one). A wake-up read while this
        # fetch was on the wire may be newer than its "empty": it wins.
        woken = self._woken_in_fetch
        for name in (*empties, *blocked):
            name = bytes_to_str(name)
            if name not in woken:
                self._sched.deactivate(name)
        if self._resubscribed_in_fetch:
            # Which of these "empty" replies predate the subscription is unknown: the
            # ready set, read now that we are subscribed, says which queues hold jobs.
            self._resubscribed_in_fetch = False
            try:
                self._refresh_ready()
            except self.connection_errors:
                # The jobs of this reply are ours already: deliver them; fetch from
                # every queue until the next refresh.
                logger.debug("celery_ext: ready refresh failed, will retry", exc_info=True)
                self._sched.activate_many(self._sched.queues)
        if not status:
            # A reaper declared this pool dead while it was stopped; register again.
            self._ensure_pool().revive()
            raise Empty()
        delivered = False
        for qname, tag, payload, rec in jobs:
            raw = self._decode(qname, tag, payload, rec)
            if raw is not None:
                try:
                    self.connection._deliver(raw, bytes_to_str(qname))
                except _IO_ERRORS:
                    raise
                except Exception as exc:
                    # The consumer failed on this job (a message Celery does not catch as
                    # invalid, e.g. without an id header): as a KeyError it would restart
                    # the consumer and refetch the job forever, as anything else stop the
                    # worker, and the rest of this fetch would stay undelivered.
                    self._dead_letter_broken(raw, bytes_to_str(qname), exc)
                    continue
                delivered = True
        if not delivered:
            raise Empty()
        return True

    def _dead_letter_broken(self, raw: dict[str, Any], queue: str, exc: Exception) -> None:
        tag = raw["properties"]["delivery_tag"]
        error = one_line(f"{type(exc).__name__}: {exc}")
        headers = raw.get("headers") or {}
        name = headers.get("task") if isinstance(headers.get("task"), str) else None
        if self._dead_letter(tag, "invalid", error, name=name):
            logger.error("celery_ext: message %s in job queue %r moved to the dead set "
                         "(invalid: %s)", one_line(str(tag)), queue, error)
        self.qos.forget(tag)

    def _decode(self, qname: Any, tag: Any, payload: Any, rec: Any) -> dict[str, Any] | None:
        """Parse a fetched job; an undecodable one goes to the dead set, not the floor."""
        queue, tag = bytes_to_str(qname), bytes_to_str(tag)
        try:
            raw = loads(bytes_to_str(payload))
            problem = envelope_problem(raw) or self._body_problem(raw)
            if problem is not None:
                raise ValueError(problem)
            props = raw["properties"]
            props["delivery_tag"] = tag
            info = props.setdefault("delivery_info", {})
        except Exception as exc:
            logger.error("celery_ext: undecodable message in job queue %r (%s: %s); "
                         "moved to the dead set", queue, type(exc).__name__, exc)
            self._dead_letter(tag, "undecodable", f"{type(exc).__name__}: {exc}", queue=queue)
            return None
        if int(rec) >= 0:
            info["redelivered"] = True
            headers = raw.get("headers")
            if isinstance(headers, dict):
                headers["redelivered"] = True
        return raw

    def _body_problem(self, raw: dict[str, Any]) -> str | None:
        """Kombu decodes the body while building the Message, where an exception stops
        the worker: try it here first (truncated base64, unknown body_encoding)."""
        body, encoding = raw.get("body"), raw["properties"].get("body_encoding")
        if not body or not encoding or encoding.lower() == "utf-8":
            return None
        if encoding not in self.codecs:
            return f"its body_encoding {encoding!r} is unknown"
        try:
            self.decode_body(body, encoding)
        except Exception as exc:
            return f"its body is not valid {encoding} ({type(exc).__name__}: {exc})"
        return None

    # -- idle: wake-ups and refresh ---------------------------------------------------
    def _wake_subscribe(self) -> None:
        c = self.wakeclient
        if c.connection._sock is None:
            c.connection.connect()
        self._in_wake = c.connection
        c.subscribe(self.keys.wake_channel)

    def _wake_read(self) -> bool:
        c = self.wakeclient
        try:
            self._on_wake(c.parse_response())
            while c.connection is not None and c.connection.can_read(timeout=0):
                self._on_wake(c.parse_response())
        except self.connection_errors:
            self._in_wake = None
            raise
        return False

    def _on_wake(self, response: Any) -> None:
        if not isinstance(response, list | tuple) or len(response) < 3:
            return
        kind = bytes_to_str(response[0])
        if kind == "message":
            self._activate([bytes_to_str(response[2])])
        elif kind == "subscribe":
            # (Re)subscribed: notifications may have been missed meanwhile.
            self._activate(None)

    def _activate(self, names: list[str] | None) -> None:
        """Mark queues (None: all, after (re)subscribing) as worth fetching from.

        Remembered while a fetch is on the wire: Redis may have run that fetch (and
        found the queue empty) just before the push that sent this wake-up, and its
        reply, read after the wake-up, must not mark the queue empty again -- nothing
        would wake it before the next ready refresh (a lost wake-up). A subscription
        confirmed meanwhile makes that reply re-read the ready set instead."""
        sched = self._sched
        if names is None:
            sched.activate_many(sched.queues)
            if self._in_poll:
                self._resubscribed_in_fetch = True
            return
        sched.activate_many(names)
        if self._in_poll:
            self._woken_in_fetch.update(names)

    def maybe_refresh_ready(self) -> None:
        """Re-read the ready set if some consumed queue is believed empty (1 command)."""
        sched = self._sched
        if sched.all_active():
            return
        now = monotonic()
        if now - self._last_refresh < self.settings.idle_refresh_interval * 0.9:
            return
        self._last_refresh = now
        self._refresh_ready()

    def _refresh_ready(self) -> None:
        """Mark every consumed queue in the ``ready`` set active (1 command)."""
        with self.conn_or_acquire() as client:
            ready = client.smembers(self.keys.ready)
        self._activate([bytes_to_str(name) for name in ready])

    # -- ack, requeue, dead ------------------------------------------------------------
    def _inflight_key(self) -> str:
        return self.keys.inflight(self.pool_id)

    def _owner_client(self) -> Any:
        """A client that outlives this channel: acks of jobs still running when the
        channel closed (connection loss) must reach Redis, not be lost with it."""
        if self._heartbeater is not None:
            return self._heartbeater.client
        return self._create_client()

    def _ack(self, tags: list[str]) -> None:
        client = self._owner_client()
        k = self.keys
        self._scripts("ack", [self._inflight_key(), k.redelivery, k.running, k.limits, k.ready],
                      [k.wake_channel, *tags], client=client)

    def _new_ack_sender(self) -> AckSender:
        sender = self.__dict__["_ack_sender"] = AckSender(
            self._owner_client().connection_pool, self._ack)
        return sender

    def _ack_nowait(self, tags: list[str]) -> None:
        """Like ``_ack`` without waiting for the reply (see ``acks.AckSender``); on the
        pool's own connection settings, so it outlives this channel like ``_ack``."""
        if self.closed:  # no close() left to read the reply: wait for it now
            self._ack(tags)
            return
        sender = self.__dict__.get("_ack_sender") or self._new_ack_sender()
        k = self.keys
        sender.ack([self._inflight_key(), k.redelivery, k.running, k.limits, k.ready],
                   [k.wake_channel, *tags], tags)

    def _requeue(self, tags: Iterable[str], client: Any = None) -> list[str]:
        """Put jobs of this pool back at the front of their queues, first delivered
        first fetched again. Tags no longer in the record are skipped."""
        return requeue_tags(self._scripts, self.keys, self.pool_id, list(tags),
                            client or self._owner_client())

    def _dead_letter(self, tag: str, reason: str, error: str, queue: str | None = None,
                     **meta: Any) -> bool:
        """Move one in-flight job of this pool to the dead set (see ``dead.dead_letter``)."""
        return dead_letter(self._owner_client(), self.settings, self.pool_id, tag,
                           reason=reason, error=error, **meta)

    def recover_lost(self, tag: str) -> str:
        """The job's prefork child died: requeue it now, counting a recovery, or
        dead-letter it past max_recoveries. Returns "requeued", "dead" or "gone"."""
        from .reaper import recover_tags

        _, requeued, dead = recover_tags(self._owner_client(), self.settings, self.pool_id,
                                         [tag], mode="job", reason="worker lost")
        self.qos.forget(tag)
        if dead:
            logger.error("celery_ext: job %s killed its worker more than %d times; "
                         "moved to the dead set", tag, self.settings.max_recoveries)
            return "dead"
        return "requeued" if requeued else "gone"

    def _mark_needs_recovery(self) -> None:
        _pending_recovery.add((self.server_id, self.settings.namespace))

    def _recover_leftovers(self) -> None:
        """Requeue this pool's in-flight jobs that no live channel of the process owns
        (their channel closed while Redis was unreachable)."""
        assert self._heartbeater is not None
        owned = running_tags()
        for channel in list(_live_channels):
            if channel is not self and not channel.closed:
                owned |= channel.qos.live_tags()
        client = self._owner_client()
        tags = [bytes_to_str(t) for t in client.hkeys(self.keys.inflight(self.pool_id))]
        left = [t for t in tags if t not in owned]
        if left:
            done = self._requeue(left, client=client)
            logger.warning("celery_ext: returned %d in-flight jobs of a closed channel "
                           "to their queues", len(done))

    def close(self) -> None:
        _live_channels.discard(self)
        sender = self.__dict__.get("_ack_sender")
        if sender is not None:
            # Acks sent through it have their replies read. On a lost connection this
            # fails; Kombu's close below must still run, or the unacked jobs of this
            # channel are neither restored nor marked for recovery (found by
            # tests/faults redis_kill: jobs stuck in a live pool's in-flight record).
            with suppress(Exception):
                sender.close()
        wake = self.__dict__.get("_wakeclient")
        if wake is not None:
            with suppress(Exception):
                conn, wake.connection = wake.connection, None
                if conn is not None:
                    conn.disconnect()
        super().close()


def requeue_tags(scripts: _scripts.Scripts, keys: Keys, pool_id: str, tags: list[str],
                 client: Any) -> list[str]:
    """Move ``tags`` (in delivery order) from a pool's in-flight record to the front
    of their job queues. Reads the queues first (scripts may only touch keys they
    are given), then moves atomically; returns the tags moved."""
    if not tags:
        return []
    inflight = keys.inflight(pool_id)
    records = client.hmget(inflight, tags)
    pairs = []
    for tag, rec in zip(tags, records, strict=True):
        if rec:
            pairs.append((tag, bytes_to_str(rec.split(b"\n", 1)[0])))
    pairs.reverse()  # pushed last = fetched first: the first delivered goes back in front
    done = scripts(
        "requeue",
        [inflight, keys.ready, keys.redelivery, keys.running,
         *(keys.queue(q) for _, q in pairs)],
        [keys.wake_channel, keys.queue(""), *(t for t, _ in pairs)],
        client=client,
    )
    return [bytes_to_str(t) for t in done]


class Transport(kredis.Transport):
    """Kombu transport registered as ``celery-ext://`` (and ``celery-exts://`` for TLS)."""

    Channel = Channel
    driver_type = "redis"
    driver_name = "redis"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.cycle = MultiChannelPoller()
        self.settings = Settings.load(self.client.transport_options)

    def register_with_event_loop(self, connection: Any, loop: Any) -> None:
        super().register_with_event_loop(connection, loop)
        cycle = self.cycle
        old = getattr(cycle, "_ready_refresh_tref", None)
        if old is not None:
            old.cancel()
        cycle._ready_refresh_tref = loop.call_repeatedly(
            self.settings.idle_refresh_interval, cycle.maybe_refresh_ready)
