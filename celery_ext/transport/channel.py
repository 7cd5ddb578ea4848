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
  outlives that fetch's "empty" reply (``readiness.ReadyQueues``).
* Rate limits: a queue whose next job is not due yet (``rate_limits.py``) comes back
  in the fetch reply with its wait; the channel sets one event-loop timer for the
  earliest such time and fetches from the other queues meanwhile.
* Ack removes the job from the in-flight hash (O(1)); reject-with-requeue and the
  return at shutdown put jobs back at the *front* of their queue. There is no
  visibility timeout: a job leaves the in-flight record only when its pool acks it,
  returns it, or is declared dead by the reaper.
* The worker pool of the process (``pool.WorkerPool``: heartbeat, reaper, requeuer,
  what the process holds) is made by the first tracked fetch, so any worker that
  consumes through this transport runs it, with or without ``install(app)``. A
  channel that closes (lost connection) returns nothing itself: the pool reconciles
  its in-flight record with what the process still holds before the next fetch.
"""

from __future__ import annotations

import logging
import ssl
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager, suppress
from queue import Empty
from time import monotonic
from typing import Any
from urllib.parse import quote

import redis
from kombu.transport import redis as kredis
from kombu.transport import virtual
from kombu.utils.encoding import bytes_to_str
from kombu.utils.eventio import READ
from kombu.utils.json import loads

from celery_ext.config import TLS_SCHEME, TLS_SENTINEL_SCHEME, ConfigError, Settings
from celery_ext.errors import CLUSTER_ERRORS, CONNECTION_ERRORS, BrokerOutOfMemory, job_name
from celery_ext.options.fair import connect as connect_fair_keys
from celery_ext.options.weights import weight_of
from celery_ext.producer.publish import Enqueuer, ReplicatedPublishBatch
from celery_ext.store import connections
from celery_ext.store import scripts as _scripts
from celery_ext.store.clock import now_s
from celery_ext.store.copies import run_scripts
from celery_ext.store.dead_set import dead_letter
from celery_ext.store.envelope import envelope_problem
from celery_ext.store.keys import LEVEL_SEP, Keys
from celery_ext.store.probe import gone_silent
from celery_ext.text import one_line
from celery_ext.transport.readiness import ReadyQueues
from celery_ext.worker.heartbeater import current_pool_id
from celery_ext.worker.worker_pool import WorkerPool, on_loop_close, on_loop_tick, pool_for

logger = logging.getLogger("celery_ext.transport.channel")
#: On a cluster, seconds between two checks of a pool's queues' own lists (one
#: pipeline), beside the check of every new channel (a start, a reconnect): the ready
#: hint's safety net for a writer that died between its push, whose wake-up reached
#: the pools subscribed then, and its hint.
CLUSTER_RECHECK_INTERVAL = 300.0
# A process that publishes through this transport computes the fair keys of its jobs
# (fair.py); this module is imported before its first publish, in drop-in mode too.
connect_fair_keys()


def fetch_waits(free: int, held: int, concurrency: int, batch: int) -> bool:
    """Whether a fetch for ``free`` prefetch slots waits: every execution slot has a job
    (``held`` >= ``concurrency``) and fewer than a pool's worth (at most ``batch``) are
    free. Fetching a few at once rather than one per finished job costs fewer round trips
    and fetch scripts per job; a slot that may be idle never waits for it."""
    return free < min(concurrency, batch) and held >= concurrency


class QoS(virtual.QoS):
    """Prefetch accounting in memory; ownership lives in Redis (the in-flight record)
    and in the worker pool of the process (what it holds: ``pool.Holdings``)."""

    restore_at_shutdown = True
    channel: Channel

    def append(self, message: Any, delivery_tag: str) -> None:
        # The fetch script already recorded the job as in flight, atomically.
        super().append(message, delivery_tag)
        self.channel.worker_pool.delivered(delivery_tag, message)

    def ack(self, delivery_tag: str) -> None:
        self.channel.worker_pool.ack([delivery_tag])
        super().ack(delivery_tag)

    def reject(self, delivery_tag: str, requeue: bool = False) -> None:
        if requeue:
            self.channel.worker_pool.requeue([delivery_tag])
        else:
            self.channel._dead_letter(delivery_tag, "rejected", "rejected by the consumer")
        super().ack(delivery_tag)

    def restore_unacked(self, client: Any = None) -> list[Any]:
        """The channel closes: return nothing now, and let the pool reconcile before
        its next fetch.

        At this moment Celery still references every job it reserved; only after the
        channel closed does it drop those it will never run (a prefork pool's), while a
        threads pool still runs the ones it queued. The reconcile before the next fetch
        (or the return at shutdown) tells them apart: a job whose message is still
        referenced stays owned and is acked when it ends; the rest go back."""
        self._flush()
        self._delivered.clear()
        pool = self.channel._worker_pool
        if pool is not None:
            pool.needs_reconcile()
        return []

    def restore_visible(self, *args: Any, **kwargs: Any) -> None:
        """No visibility timeout: dead pools' jobs are requeued by the reaper."""

    def forget(self, delivery_tag: str) -> None:
        """Drop a tag from prefetch accounting only (Redis was already updated)."""
        super().ack(delivery_tag)


_QoS = QoS


class MultiChannelPoller(kredis.MultiChannelPoller):
    """Adds the WAKE pub/sub listener and the idle refresh to Kombu's poller."""

    def on_poll_start(self) -> None:
        self._update_brpop_polling()
        for channel in self._channels:
            # Not ``channel.active_queues``: Kombu rebuilds that list on every call, a
            # cost that grows with the number of job queues, on every loop turn.
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
            channel.check_fetch_reply()  # raises: the consumer reconnects
            try:
                channel.maybe_refresh_ready()
            except channel.connection_errors:
                logger.debug("celery_ext: ready refresh failed, will retry", exc_info=True)

    def get(self, callback: Any, timeout: float | None = None) -> Any:
        self.maybe_refresh_ready()
        # Without an event loop (a plain Kombu consumer) no timer wakes a rate-limited
        # queue: wait no longer than until it is due.
        due = [d for d in (c._ready.next_due() for c in self._channels) if d is not None]
        if due:
            wait = max(0.0, min(due) - monotonic())
            timeout = wait if timeout is None else min(timeout, wait)
        return super().get(callback, timeout=timeout)


class Channel(kredis.Channel):
    """Redis channel whose queues are job queues with crash-safe, weighted fetch."""

    QoS = QoS
    qos: _QoS
    from_transport_options = (kredis.Channel.from_transport_options + Settings.option_names()
                              + connections.SENTINEL_OPTIONS)

    _in_wake: Any = False
    keyprefix_fanout: str

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        conn = args[0] if args else kwargs["connection"]
        self.settings = Settings.load(conn.client.transport_options)
        self.keys = Keys.for_settings(self.settings)
        self._ready = ReadyQueues(default_weight=self.settings.default_weight)
        self._no_ack_queues: set[str] = set()
        self._predeclared_sizes: dict[str, int] = {}
        self._prebound: set[tuple[str, str, str, str]] = set()
        self._last_refresh = 0.0
        #: The worker pool of the process, once this channel fetched for tracking.
        self._worker_pool: WorkerPool | None = None
        #: A tracked fetch was sent and its reply not read yet.
        self._fetch_pending = False
        #: The worker's concurrency (set by its consumer step): while the process holds
        #: at least this many jobs, a fetch waits until it can take this many.
        self.fetch_min = 1
        #: The event-loop timer that wakes rate-limited queues, and when it fires.
        self._throttle_timer: Any = None
        self._throttle_timer_at: float | None = None
        #: The Sentinel setup of a ``celery-ext+sentinel://`` URL, else None.
        self.sentinel = connections.sentinel_config(_urls_of(conn.client),
                                                    conn.client.transport_options)
        #: The cluster setup when the broker is a Redis Cluster (setting ``cluster``).
        self.cluster_setup = connections.cluster_config(_seed_urls(conn.client),
                                                  conn.client.transport_options)
        #: On a cluster: the reply of the fetch run synchronously (see ``_brpop_start``).
        self._cluster_reply: Any = None
        if self.cluster_setup is not None:
            home = self.keys.home
            self.keyprefix_queue = home.kombu_binding
            self.keyprefix_binding_permanent = home.kombu_binding_permanent
            self.keyprefix_binding_deadlines = home.kombu_binding_deadlines
        if self.sentinel is not None:
            self.connection_class = connections.sentinel_connection_class()
            self.connection_class_ssl = connections.sentinel_connection_class(tls=True)
        super().__init__(*args, **kwargs)
        self.handlers["WAKE"] = self._wake_read
        self._scripts = _scripts.Scripts(
            self._cluster_client() if self.cluster_setup is not None else self.client)
        # The event loop sends fetch by SHA without redis-py's NOSCRIPT fallback.
        with self.conn_or_acquire() as client:
            self._scripts.load_all(client)
            # Redis time minus local time: jobs are stamped on the one clock.
            self._clock_offset = now_s(client) - time.time()

    # -- connection details ----------------------------------------------------------
    def _connparams(self, asynchronous: bool = False) -> dict[str, Any]:
        conninfo = self.connection.client
        tls = conninfo.transport_cls in (TLS_SCHEME, TLS_SENTINEL_SCHEME) or (
            self.sentinel is not None and self.sentinel.tls)
        if tls and not conninfo.ssl:
            # Secure by default: verify the server certificate unless told otherwise
            # (e.g. ?ssl_cert_reqs=none in the URL, as with rediss://).
            conninfo.ssl = {"ssl_cert_reqs": ssl.CERT_REQUIRED}
        return connections.watch_replies(super()._connparams(asynchronous=asynchronous),
                                         self.settings)

    def _get_pool(self, asynchronous: bool = False) -> Any:
        if self.cluster_setup is not None:
            # The channel's own connections (fetch signal, wake-ups, fanout) go to the
            # master of the namespace's home slot; commands go through the cluster client.
            params = self._connparams(asynchronous=asynchronous)
            node = self._cluster_client().get_node_from_key(self.keys.home.prefix)
            params.update(host=node.host, port=node.port, db=0)
            self.keyprefix_fanout = self.keyprefix_fanout.format(db=0)
            return redis.ConnectionPool(**params)
        if self.sentinel is None:
            return super()._get_pool(asynchronous)
        params = self._connparams(asynchronous=asynchronous)
        self.keyprefix_fanout = self.keyprefix_fanout.format(db=self.sentinel.db)
        pool = connections.connection_pool(params, self.sentinel)
        # Kept so that closing the channel also closes the connections to the sentinels.
        manager = getattr(pool, "sentinel_manager", None)
        if asynchronous:
            self._async_sentinel_manager = manager
        else:
            self._sentinel_manager = manager
        return pool

    def _cluster_client(self) -> Any:
        """This channel's :class:`~redis.cluster.RedisCluster` (cluster only): slot
        routing, MOVED/ASK and a failover's new topology are redis-py's."""
        rc = self.__dict__.get("_rc")
        if rc is None:
            assert self.cluster_setup is not None
            rc = self.__dict__["_rc"] = connections.cluster_client(
                self.cluster_setup, self._cluster_params())
        return rc

    def _cluster_params(self) -> dict[str, Any]:
        """Connection keywords of this channel (timeouts, TLS), for every node."""
        params = self._connparams(asynchronous=False)
        params.pop("retry_on_timeout", None)  # redis-py's cluster retries timeouts itself
        return params

    def _create_client(self, asynchronous: bool = False) -> Any:
        if self.cluster_setup is not None and not asynchronous:
            return self._cluster_client()
        return super()._create_client(asynchronous=asynchronous)

    @contextmanager
    def conn_or_acquire(self, client: Any = None) -> Iterator[Any]:
        """Like Kombu's, but reuse one client per channel and connection pool:
        Kombu builds a fresh ``redis.Redis`` for every publish, a sixth of the cost
        of ``apply_async``. (redis-py clients are thread-safe over their pool.)"""
        if client:
            yield client
            return
        if self.cluster_setup is not None:
            yield self._cluster_client()
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
        if sid is None and self.cluster_setup is not None:
            sid = self.__dict__["_server_id"] = self.cluster_setup.server_id
        elif sid is None and self.sentinel is not None:
            sid = self.__dict__["_server_id"] = self.sentinel.server_id
        elif sid is None:
            c = self.connection.client
            sid = self.__dict__["_server_id"] = f"{c.hostname}:{c.port}/{c.virtual_host}"
        return sid

    @property
    def scripts(self) -> _scripts.Scripts:
        """The plugin's Lua scripts, bound to this channel's client."""
        return self._scripts

    def new_client(self) -> Any:
        """A client on a connection pool of its own, with this channel's connection
        settings (server or sentinels, TLS, password, timeouts): for parts that outlive
        channels. On a cluster, a cluster client of its own."""
        if self.cluster_setup is not None:
            return connections.cluster_client(self.cluster_setup, self._cluster_params())
        params = self._connparams(asynchronous=False)
        return redis.Redis(connection_pool=connections.connection_pool(params, self.sentinel))

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
                clock_offset=getattr(self, "_clock_offset", 0.0),
                pool=None if self.cluster_setup is not None else lambda: self.pool)
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
        batch = (ReplicatedPublishBatch(self, max_size) if self.settings.wait_replicas
                 else super().create_publish_batch(max_size))
        self.enqueuer.load_batch_scripts()
        return batch

    # -- queue management --------------------------------------------------------------
    def _levels(self, queue: str) -> list[str]:
        """The lists of a job queue, one per priority level (see :mod:`.priority`)."""
        return self.keys.of(queue).queue_levels(queue, self.settings.priority_steps)

    def _sub_queues(self, client: Any, queue: str) -> list[str]:
        """The sub-queues of a job queue's fair keys with jobs (:mod:`.fair`)."""
        k = self.keys.of(queue)
        return [k.fair_queue(queue, bytes_to_str(key))
                for key in client.lrange(k.fair_ring(queue), 0, -1)]

    def _size(self, queue: str) -> int:
        size = self._predeclared_sizes.pop(queue, None)
        if size is not None:  # read by predeclared() a moment ago, in the same start-up
            return size
        with self.conn_or_acquire() as client, client.pipeline(transaction=False) as pipe:
            for key in [*self._levels(queue), *self._sub_queues(client, queue)]:
                pipe.llen(key)
            return sum(int(n) for n in pipe.execute())

    def _drop_lists(self, client: Any, queue: str) -> int:
        """Delete every list of a job queue (levels, fair ring and sub-queues) and the
        index entries of the jobs in them, in one script (``purge.lua``). Returns how
        many jobs were removed."""
        k = self.keys.of(queue)
        return int(self.scripts("purge", [k.ready, k.job_index, *self._levels(queue)], [queue],
                                client=client))

    def _purge(self, queue: str) -> int:
        with self.conn_or_acquire() as client:
            return self._drop_lists(client, queue)

    def _has_queue(self, queue: str, **kwargs: Any) -> bool:
        with self.conn_or_acquire() as client:
            return bool(client.exists(*self._levels(queue), self.keys.of(queue).fair_ring(queue)))

    def _delete(self, queue: str, exchange: str, routing_key: str, pattern: str,
                *args: Any, **kwargs: Any) -> None:
        self.auto_delete_queues.discard(queue)
        member = self.sep.join([routing_key or "", pattern or "", queue or ""])
        with self.conn_or_acquire(client=kwargs.get("client")) as client:
            self._drop_lists(client, queue)
            with client.pipeline() as pipe:
                pipe.srem(self.keyprefix_queue % (exchange,), member)
                pipe.srem(self.keyprefix_binding_permanent % (exchange,), member)
                pipe.execute()

    def _maybe_update_queues_expire(self, client: Any, queue: str) -> None:
        if self._expires and queue in self._expires:
            for key in self._levels(queue):
                client.pexpire(key, self._expires[queue])

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
                        for key in self._levels(name):
                            pipe.llen(key)
                    for exchange, members in binds.items():
                        pipe.sadd(self.keyprefix_queue % (exchange,), *members)
                        pipe.sadd(self.keyprefix_binding_permanent % (exchange,), *members)
                    nlev = len(self.settings.priority_steps)
                    lens = pipe.execute()[:len(names) * nlev]
                    sizes = [sum(lens[i:i + nlev]) for i in range(0, len(lens), nlev)]
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
            if self.cluster_setup is not None:
                self._refresh_bindings_one_by_one(queues)
            else:
                super()._refresh_bindings(queues)
        except redis.exceptions.OutOfMemoryError:
            for queue in queues:
                for exchange, routing_key, args in self.state.queue_bindings(queue):
                    _, pattern, _ = self.typeof(exchange).prepare_bind(
                        queue, exchange, routing_key, args)
                    self._bind_at_maxmemory(exchange, routing_key, pattern, queue)

    def _refresh_bindings_one_by_one(self, queues: Any) -> None:
        """Kombu's refresh without its pipeline, which a cluster client refuses for
        scripts (the bindings and their deadlines share the home slot on a cluster)."""
        with self.conn_or_acquire() as client:
            for queue in queues:
                for exchange, routing_key, args in self.state.queue_bindings(queue):
                    _, pattern, _ = self.typeof(exchange).prepare_bind(
                        queue, exchange, routing_key, args)
                    self._refresh_binding(
                        keys=[self.keyprefix_queue % (exchange,), self._script_binding_deadlines],
                        args=[self.sep.join([routing_key or "", pattern or "", queue]),
                              exchange, self._binding_ttl(queue)], client=client)

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
        if LEVEL_SEP in queue:  # its key would be another queue's priority level list
            raise ValueError(f"celery_ext: queue name {queue!r} must not contain {LEVEL_SEP!r}")
        if no_ack:
            self._no_ack_queues.add(queue)
        else:
            self._no_ack_queues.discard(queue)
        ret = super().basic_consume(queue, no_ack, *args, **kwargs)
        if queue not in self.active_fanout_queues:
            self._ready.add(queue, weight_of(queue, self.settings.default_weight))
        return ret

    def _basic_cancel(self, consumer_tag: str) -> Any:
        queue = self._tag_to_queue.get(consumer_tag)
        ret = super()._basic_cancel(consumer_tag)
        if queue is not None and queue not in self._active_queues:  # (may be consumed twice)
            self._ready.remove(queue)
        return ret

    def _update_queue_cycle(self) -> None:
        """Unused: Kombu calls this after every basic_consume and basic_cancel to
        rebuild its cycle from every consumed queue (quadratic in the number of job
        queues at start and stop); those two methods above change the one queue in
        the pool's scheduler instead."""

    def basic_get(self, queue: str, no_ack: bool = False, **kwargs: Any) -> Any:
        jobs = self._fetch_sync([queue], track=not no_ack)
        if not jobs:
            return None
        qname, tag, payload, rec = jobs[0]
        raw = self._decode(qname, tag, payload, rec, tracked=not no_ack)
        if raw is None:
            return None
        message = self.Message(raw, channel=self)
        if not no_ack:
            self.qos.append(message, message.delivery_tag)
        return message

    def _get(self, queue: str, timeout: float | None = None) -> Any:
        jobs = self._fetch_sync([queue], track=False)
        for qname, tag, payload, rec in jobs:
            raw = self._decode(qname, tag, payload, rec, tracked=False)
            if raw is not None:
                return raw
        raise Empty()

    @property
    def worker_pool(self) -> WorkerPool:
        """The worker pool of this process (registered and started before its first
        tracked fetch: heartbeat, reaper, requeuer)."""
        pool = self._worker_pool
        if pool is None:
            pool = self._worker_pool = pool_for(self.new_client, self.settings, self.server_id)
        return pool

    @property
    def pool_id(self) -> str:
        return self.worker_pool.pool_id

    def copy_of(self, tag: str, queue: str | None = None) -> Keys:
        """The copy of the layout whose records hold the tracked job ``tag``: its job
        queue's on a cluster (``queue``'s when the job is no longer in a record), the
        one copy on one node."""
        if self.cluster_setup is None:
            return self.keys
        found = next(iter(self.worker_pool.record.locate([tag])), None)
        if found is not None:
            return found
        return self.keys.of(queue) if queue else self.keys

    def _fetch_sent(self) -> None:
        self._fetch_pending = True
        self.worker_pool.fetch_sent()

    def _fetch_finished(self, lost: bool) -> None:
        """A tracked fetch's reply was read, or the connection it was on failed (the
        script may have run: its jobs are in the record, never delivered)."""
        if self._fetch_pending:
            self._fetch_pending = False
            self.worker_pool.fetch_done(lost=lost)

    def _fetch_keys(self, pool_id: str, queues: list[str]) -> list[str]:
        return self.keys.fetch(pool_id, queues, self.settings.priority_steps)

    def _fetch_copies(self, client: Any, pool_id: str, picks: list[str], flags: str) -> list[Any]:
        """On a cluster: one ``fetch`` call per queue copy of the candidates, in one
        pipeline (one round trip per master visited); their replies merged into one
        as the script gives it on one node. A copy that refuses the pool (the reaper
        recovered its jobs there) makes the status 0; the jobs of the others count."""
        groups = self.keys.groups(picks)
        flag_of = dict(zip(picks, flags, strict=True))
        if pool_id != "-":
            self.worker_pool.join(list(groups))
        steps, max_payload = self.settings.priority_steps, self.settings.max_payload_bytes
        # (A promoted replica's script cache is empty: run_scripts loads and resends.)
        replies = run_scripts(client, self._scripts, [
            ("fetch", k.fetch(pool_id, queues, steps),
             [pool_id, "".join(flag_of[q] for q in queues), *queues, max_payload,
              int(self.settings.job_index)])
            for k, queues in groups.items()])
        status, jobs, empties, blocked, waits = 1, [], [], [], []
        for reply in replies:
            status = min(status, int(reply[0]))
            jobs += reply[1]
            empties += reply[2]
            blocked += reply[3]
            waits += reply[4]
        return [status, jobs, empties, blocked, waits]

    def _fetch_sync(self, queues: list[str], track: bool) -> list[Any]:
        pool_id = self.pool_id if track else "-"
        flags = ("1" if track else "0") * len(queues)
        with self.conn_or_acquire() as client:
            for _ in range(2):
                if track:
                    self.worker_pool.fetch_sent()
                try:
                    if self.cluster_setup is not None:
                        status, jobs, *_ = self._fetch_copies(client, pool_id, queues, flags)
                    else:
                        status, jobs, *_ = self._scripts(
                            "fetch", self._fetch_keys(pool_id, queues),
                            [pool_id, flags, *queues, self.settings.max_payload_bytes,
                             int(self.settings.job_index)], client=client)
                except BaseException:
                    if track:
                        self.worker_pool.fetch_done(lost=True)
                    raise
                if track:
                    self.worker_pool.fetch_done()
                if status:
                    return list(jobs)
                self.worker_pool.revive()
                if jobs:  # on a cluster, other queues' copies gave jobs meanwhile
                    return list(jobs)
        return []

    def _brpop_start(self, timeout: Any = None) -> None:
        """Send one fetch (instead of BRPOP) for up to the free prefetch slots; first
        make the pool's in-flight record match what the process holds, if needed."""
        if self._worker_pool is not None:
            # Acks this turn made are written before the fetch they make room for.
            self._worker_pool.flush_acks()
            try:
                self._worker_pool.maybe_reconcile()
            except CONNECTION_ERRORS as exc:
                # The pool's own connection failed. Fetching goes on (what is not yet
                # reconciled stays owned); the fetch itself says if Redis is gone, and
                # the reconcile is tried again before a later fetch.
                logger.debug("celery_ext: reconcile before fetch failed (%s)", exc)
        ready = self._ready
        if not ready.has_active():
            return  # idle: the WAKE listener and the ready refresh take over
        credit = self.qos.can_consume_max_estimate()
        n = self.settings.fetch_batch if credit is None else min(credit, self.settings.fetch_batch)
        if n <= 0:
            return
        # Held: delivered and not acked (Kombu keeps an acked tag in ``_delivered``, as
        # "dirty", until the next delivery).
        held = len(self.qos._delivered) - len(self.qos._dirty)
        if fetch_waits(n, held, self.fetch_min, self.settings.fetch_batch):
            return
        picks = ready.take(n)
        no_ack = self._no_ack_queues
        flags = "".join("0" if q in no_ack else "1" for q in picks)
        pool_id = self.pool_id if "1" in flags else "-"
        conn = self.client.connection
        self._in_poll = conn
        ready.fetch_sent()
        self._brpop_sent_at = monotonic()
        if pool_id != "-":
            self._fetch_sent()
        if self.cluster_setup is not None:
            # The candidates' copies live on several masters: the fetch runs here, one
            # pipeline (one round trip per master visited), and a PING on the channel's
            # own connection hands its reply to the event loop's reading code.
            try:
                self._cluster_reply = self._fetch_copies(self._cluster_client(), pool_id,
                                                         picks, flags)
            except BaseException:
                self._in_poll = None
                ready.fetch_lost()
                self._fetch_finished(lost=True)
                raise
            conn.send_command("PING")
            return
        keys = self._fetch_keys(pool_id, picks)
        conn.send_command("EVALSHA", _scripts.sha("fetch"), len(keys), *keys,
                          pool_id, flags, *picks, self.settings.max_payload_bytes,
                          int(self.settings.job_index))

    def _brpop_read(self, **options: Any) -> bool:
        conn = self.client.connection
        pending = self._in_poll
        try:
            try:
                if self.cluster_setup is not None:
                    reply, self._cluster_reply = self._cluster_reply, None
                    self.client.parse_response(conn, "PING", **options)
                else:
                    reply = self.client.parse_response(conn, "EVALSHA", **options)
            except self.connection_errors:
                conn.disconnect()
                self._ready.fetch_lost()
                self._fetch_finished(lost=True)
                raise
            except redis.exceptions.NoScriptError:
                # The server restarted and lost its script cache: load and go on.
                self._ready.fetch_replied(())
                self._fetch_finished(lost=False)
                with self.conn_or_acquire() as client:
                    self._scripts.load_all(client)
                raise Empty() from None
            self._fetch_finished(lost=False)
        finally:
            self._in_poll = None
        if not pending:
            self._ready.fetch_replied(())
            raise Empty()
        status, jobs, empties, blocked, waits = reply
        # Empty queues wait for a wake-up; paused ones and those at their
        # max_concurrency too (resume and ack publish one); rate-limited ones for a timer.
        replied = self._ready.fetch_replied([bytes_to_str(n) for n in (*empties, *blocked)])
        if self.cluster_setup is not None and empties:
            self._cluster_emptied([bytes_to_str(n) for n in empties])
        if waits:
            self._throttle([(bytes_to_str(q), int(us) / 1e6) for q, us in waits])
        if replied:
            # Which of these "empty" replies predate the (re)subscription is unknown:
            # the ready set, read now that we are subscribed, says which hold jobs.
            try:
                self._refresh_ready()
            except self.connection_errors:
                # The jobs of this reply are ours already: deliver them; fetch from
                # every queue until the next refresh.
                logger.debug("celery_ext: ready refresh failed, will retry", exc_info=True)
                self._ready.activate_all()
        if not status:
            # A reaper declared this pool dead while it was stopped; register again.
            # (On a cluster the copies that did not refuse it may have given jobs.)
            self.worker_pool.revive()
            if not jobs:
                raise Empty()
        delivered = False
        no_ack = self._no_ack_queues
        for qname, tag, payload, rec in jobs:
            raw = self._decode(qname, tag, payload, rec,
                               tracked=bytes_to_str(qname) not in no_ack)
            if raw is not None:
                try:
                    self.connection._deliver(raw, bytes_to_str(qname))
                except CONNECTION_ERRORS:
                    # The rest of this fetch is in the record, never delivered.
                    self.worker_pool.needs_reconcile()
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

    def _decode(self, qname: Any, tag: Any, payload: Any, rec: Any,
                tracked: bool = True) -> dict[str, Any] | None:
        """Parse a fetched job; an undecodable or oversized one goes to the dead set, not
        the floor. ``payload`` is the job's size (an int) when fetch left it in Redis
        because it is over ``max_payload_bytes``; ``tracked``: fetched into the pool's
        in-flight record (else, a no-ack fetch, the dead record is written from here)."""
        queue, tag = bytes_to_str(qname), bytes_to_str(tag)
        if tracked and self.cluster_setup is not None:
            self.worker_pool.fetched(tag, queue)  # which copy's record holds it
        limit = self.settings.max_payload_bytes
        if isinstance(payload, int) or (limit and len(payload) > limit):
            size = payload if isinstance(payload, int) else len(payload)
            error = f"the message is {size:,} bytes, over max_payload_bytes ({limit:,})"
            logger.error("celery_ext: job %s in job queue %r is too large (%s); moved to the "
                         "dead set", one_line(tag), queue, error)
            self._dead_letter_fetched(tag, queue, payload, tracked, "too_large", error)
            return None
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
                         "moved to the dead set", queue, type(exc).__name__,
                         one_line(str(exc)))
            self._dead_letter_fetched(tag, queue, payload, tracked, "undecodable",
                                      f"{type(exc).__name__}: {exc}")
            return None
        if int(rec) >= 0:
            info["redelivered"] = True
            headers = raw.get("headers")
            if isinstance(headers, dict):
                headers["redelivered"] = True
        return raw

    def _dead_letter_fetched(self, tag: str, queue: str, payload: Any, tracked: bool,
                             reason: str, error: str) -> None:
        """Dead-letter a job ``_decode`` refused: from the in-flight record if fetch put
        it there, else (no-ack) from the payload in hand, so it is not lost either way."""
        if tracked:
            self._dead_letter(tag, reason, error)
        elif not isinstance(payload, int):
            with self.conn_or_acquire() as client:
                dead_letter(client, self.settings, "-", tag, reason=reason, error=error,
                            fallback=queue.encode() + b"\n" + payload,
                            keys=self.keys.of(queue))

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
            self._ready.woken([bytes_to_str(response[2])])
        elif kind == "subscribe":
            self._ready.subscribed()

    def maybe_refresh_ready(self) -> None:
        """Re-read the ready set if some consumed queue is believed empty (1 command);
        let the worker pool look at its acks and in-flight record."""
        if self._worker_pool is not None:
            self._worker_pool.tick()
        self._ready.release_due(monotonic())
        if self._ready.all_active():
            return
        now = monotonic()
        if now - self._last_refresh < self.settings.idle_refresh_interval * 0.9:
            return
        self._last_refresh = now
        self._refresh_ready()

    def check_fetch_reply(self) -> None:
        """Raise a connection error when a fetch's connection has gone silent: its reply
        is overdue while the server answers a fresh connection (``probe.gone_silent``),
        or unanswered for ``reply_timeout``. Such a connection is gone without a reset
        (half-open), and nothing else would notice. The consumer then reconnects (one
        log line) and its pool returns what the lost fetch may have moved."""
        conn = self._in_poll
        if not conn or not gone_silent(conn, self._brpop_sent_at, self.settings.reply_timeout):
            return
        self._in_poll = None
        with suppress(Exception):
            conn.disconnect()  # (so closing the channel does not wait for the reply)
        self._ready.fetch_lost()
        self._fetch_finished(lost=True)
        raise redis.exceptions.ConnectionError(
            f"celery_ext: no reply to a fetch in {monotonic() - self._brpop_sent_at:.0f}s: "
            "its connection is silent")

    def _refresh_ready(self) -> None:
        """Mark every consumed queue in the ``ready`` set active (1 command). On a
        cluster it is the home copy's hint; the queues' own lists are re-checked at
        start and every ``CLUSTER_RECHECK_INTERVAL`` (a writer may have died between
        its script and its hint)."""
        if self.cluster_setup is not None and monotonic() >= self._cluster_recheck_at:
            self._cluster_recheck_at = monotonic() + CLUSTER_RECHECK_INTERVAL
            self._cluster_recheck([q for q in self._active_queues
                                   if q not in self.active_fanout_queues])
        with self.conn_or_acquire() as client:
            ready = client.smembers(self.keys.ready)
        self._ready.woken([bytes_to_str(name) for name in ready], refresh=True)

    _cluster_recheck_at = 0.0

    def _cluster_emptied(self, queues: list[str]) -> None:
        """A fetch found these queues empty (cluster): take them out of the home
        hint, then look at their lists and put back those that hold jobs again. A
        push after the fetch was onto an empty list, and its producer adds the
        queue to the hint after our removal; an earlier one is seen here."""
        client = self._cluster_client()
        client.srem(self.keys.home.ready, *queues)
        self._cluster_recheck(queues)

    def _cluster_recheck(self, queues: list[str]) -> None:
        """Add to the home hint (and wake) those of ``queues`` whose lists hold jobs:
        one pipeline, one round trip per master."""
        if not queues:
            return
        client = self._cluster_client()
        with client.pipeline(transaction=False) as pipe:
            for q in queues:
                pipe.exists(*self._levels(q), self.keys.of(q).fair_ring(q))
            found = [q for q, n in zip(queues, pipe.execute(), strict=True) if int(n)]
        if found:
            client.sadd(self.keys.home.ready, *found)
            self._ready.woken(found)

    # -- rate limits -----------------------------------------------------------------------
    def _throttle(self, waits: list[tuple[str, float]]) -> None:
        """Rate-limited queues whose next job is due in so many seconds: keep them
        inactive until then, with one event-loop timer for the earliest."""
        self._ready.throttle(waits, monotonic())
        self._arm_throttle_timer()

    def _arm_throttle_timer(self) -> None:
        due = self._ready.next_due()
        loop = getattr(self.connection, "event_loop", None)
        if due is None or loop is None:
            return  # no loop: MultiChannelPoller.get waits no longer than ``due``
        if self._throttle_timer_at is not None and self._throttle_timer_at <= due:
            return  # the timer already set fires first
        if self._throttle_timer is not None:
            self._throttle_timer.cancel()
        self._throttle_timer_at = due
        self._throttle_timer = loop.call_later(max(0.0, due - monotonic()), self._throttle_due)

    def _throttle_due(self) -> None:
        self._throttle_timer = self._throttle_timer_at = None
        self._ready.release_due(monotonic())
        self._arm_throttle_timer()

    # -- dead set, lost workers ----------------------------------------------------------
    def _dead_letter(self, tag: str, reason: str, error: str, queue: str | None = None,
                     **meta: Any) -> bool:
        """Move one in-flight job of this pool to the dead set (see ``dead.dead_letter``)."""
        pool = self.worker_pool
        # Acked at start (acks_late off), the job is out of the record: its queue is the
        # fallback's. (Looked up before the release, while the record knows its queue.)
        fallback = meta.get("fallback")
        queue = fallback.partition("\n")[0] if isinstance(fallback, str) and "\n" in fallback \
            else None
        copy = self.copy_of(tag, queue)
        pool.holdings.released([tag])
        try:
            return dead_letter(pool.client, self.settings, pool.pool_id, tag,
                               reason=reason, error=error, keys=copy, **meta)
        except CONNECTION_ERRORS:
            pool.needs_reconcile()  # not held anymore: returned to its queue instead
            raise

    def recover_lost(self, tag: str) -> str:
        """The job's prefork child died: requeue it now, counting a recovery, or
        dead-letter it past max_recoveries. Returns "requeued", "dead" or "gone"."""
        outcome = self.worker_pool.recover_lost(tag)
        self.qos.forget(tag)
        return outcome

    def _poll_error(self, type: str, **options: Any) -> Any:
        if type == "BRPOP":  # the fetch's socket failed: read its reply, or note it lost
            with suppress(Empty):
                self._brpop_read(**options)
            return None
        return super()._poll_error(type, **options)

    def close(self) -> None:
        if self._throttle_timer is not None:
            self._throttle_timer.cancel()
            self._throttle_timer = self._throttle_timer_at = None
        wake = self.__dict__.get("_wakeclient")
        if wake is not None:
            with suppress(Exception):
                conn, wake.connection = wake.connection, None
                if conn is not None:
                    conn.disconnect()
        try:
            super().close()  # reads a fetch still on the wire, then restore_unacked
        finally:
            self._fetch_finished(lost=True)


def _urls_of(conninfo: Any) -> list[str]:
    """Every URL of a Kombu connection. Kombu splits ``celery-ext+sentinel://h1`` into
    transport ``celery-ext`` and host ``sentinel://h1``; the full list is in ``alt``."""
    if conninfo.alt:
        return [u for u in conninfo.alt if isinstance(u, str)]
    prefix = getattr(conninfo, "uri_prefix", None)
    host = conninfo.hostname or ""
    return [f"{prefix}+{host}" if prefix else host]


def _seed_urls(conninfo: Any) -> list[str]:
    """The URLs of a Kombu connection as a cluster's seeds: every ``;``-separated one,
    or the one URL rebuilt with its credentials (``as_uri`` would build a transport)."""
    if conninfo.alt:
        return [u for u in conninfo.alt if isinstance(u, str)]
    scheme = "rediss" if conninfo.transport_cls == TLS_SCHEME else "redis"
    auth = ""
    if conninfo.password:
        auth = f"{quote(conninfo.userid or '', safe='')}:{quote(conninfo.password, safe='')}@"
    db = (conninfo.virtual_host or "").strip("/")
    return [f"{scheme}://{auth}{conninfo.hostname}:{conninfo.port or 6379}/{db}"]


class Transport(kredis.Transport):
    """Kombu transport registered as ``celery-ext://`` (and ``celery-exts://`` for TLS)."""

    Channel = Channel
    driver_type = "redis"
    driver_name = "redis"
    #: Kombu's, and a cluster's failover answers: the consumer reconnects on them.
    connection_errors = (*kredis.Transport.connection_errors, *CLUSTER_ERRORS)
    channel_errors = tuple(e for e in kredis.Transport.channel_errors
                           if e not in CLUSTER_ERRORS)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.cycle = MultiChannelPoller()
        self.settings = Settings.load(self.client.transport_options)
        c = self.client
        if connections.cluster_config(_seed_urls(c), c.transport_options) \
                and self.settings.wait_replicas:
            raise ConfigError(connections.CLUSTER_NO_WAIT)
        # Fix the pool id now, before a prefork pool forks: children then know which
        # pool owns the jobs they run (their busy records and checkins name it).
        current_pool_id()

    #: The event loop (Celery's hub) the channels' timers run on, once registered.
    event_loop: Any = None

    def register_with_event_loop(self, connection: Any, loop: Any) -> None:
        super().register_with_event_loop(connection, loop)
        self.event_loop = loop
        # Acks made in the loop's thread are written once per turn (WorkerPool.ack).
        loop.on_tick.add(on_loop_tick)
        loop.on_close.add(on_loop_close)
        cycle = self.cycle
        old = getattr(cycle, "_ready_refresh_tref", None)
        if old is not None:
            old.cancel()
        cycle._ready_refresh_tref = loop.call_repeatedly(
            self.settings.idle_refresh_interval, cycle.maybe_refresh_ready)
