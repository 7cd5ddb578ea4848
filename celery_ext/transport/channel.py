"""The celery_ext Kombu transport: Kombu's Redis transport with job-system semantics.

What changes against ``redis://`` (everything else, fanout/events/remote control
over PUB/SUB included, is inherited unchanged, and ``driver_type`` stays ``redis``):

* Job queues are lists under ``{ns}:queue:<name>``; producers push with the
  ``enqueue`` script, which also keeps the ``ready`` set and wakes idle pools, and
  writes a publish retried by Kombu only once (``producer/publish.py``).
* Consuming: instead of ``BRPOP`` the channel sends one ``fetch`` script per round
  trip (``fetch.py``), over the queues its weighted round-robin believes non-empty.
* Idle: when every consumed queue is empty, nothing is polled; a wake-up, the ready
  set's refresh or a rate limit's timer makes it fetch again (``wakeup.py``).
* Ack removes the job from the in-flight hash (O(1)); reject-with-requeue and the
  return at shutdown put jobs back at the *front* of their queue (``qos.py``). There is
  no visibility timeout: a job leaves the in-flight record only when its pool acks it,
  returns it, or is declared dead by the reaper.
* The worker pool of the process (``worker.worker_pool.WorkerPool``: heartbeat,
  reaper, requeuer, what the process holds) is made by the first tracked fetch, so any
  worker that consumes through this transport runs it, with or without
  ``install(app)``. A channel that closes (lost connection) returns nothing itself:
  the pool reconciles its in-flight record with what the process still holds before
  the next fetch.
* One node, Sentinel or a cluster: chosen once per channel (``topology/``).
* Kombu's ``global_keyprefix`` is a setting of ours (``store/keys.py``): every key and
  channel name, the plugin's and Kombu's, is built whole with it, and Kombu's prefixing
  client, which prefixes only some commands' keys, is never used.

:class:`Channel` holds Kombu's overrides and what the worker side asks of a channel;
each hands its work to one unit: ``topology``, ``fetcher``, ``wakeups``, ``job_queues``
or the ``qos``.
"""

from __future__ import annotations

import ssl
import time
from collections.abc import Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager, suppress
from queue import Empty
from typing import Any

import redis
from kombu.transport import redis as kredis
from kombu.utils.encoding import bytes_to_str

from celery_ext.config import TLS_SCHEME, TLS_SENTINEL_SCHEME, Settings
from celery_ext.errors import CLUSTER_ERRORS, BrokerOutOfMemory, job_name
from celery_ext.options.fair import connect as connect_fair_keys
from celery_ext.options.weights import weight_of
from celery_ext.producer.bulk import Bulk
from celery_ext.producer.control import MAILBOX_SUFFIX, record_control
from celery_ext.producer.publish import Enqueuer
from celery_ext.store import connections
from celery_ext.store import scripts as _scripts
from celery_ext.store.clock import now_s
from celery_ext.store.keys import LEVEL_SEP, Keys
from celery_ext.transport import qos as _qos
from celery_ext.transport.fetch import Fetcher
from celery_ext.transport.queues import JobQueues
from celery_ext.transport.readiness import ReadyQueues
from celery_ext.transport.topology import refuse_unsupported, topology_for
from celery_ext.transport.wakeup import MultiChannelPoller, Wakeups
from celery_ext.worker import periodic_leader
from celery_ext.worker.control import mark_revoked
from celery_ext.worker.heartbeater import current_pool_id
from celery_ext.worker.worker_pool import WorkerPool, pool_for, use_event_loop


class Channel(kredis.Channel):
    """Redis channel whose queues are job queues with crash-safe, weighted fetch."""

    QoS = _qos.QoS
    qos: _qos.QoS
    #: Without ``global_keyprefix``: Kombu would then make its prefixing client, which
    #: prefixes some commands' keys and not others (an EVALSHA's first key alone). The
    #: prefix is our setting instead, in every name ``Keys`` builds.
    from_transport_options = tuple(
        name for name in (kredis.Channel.from_transport_options + Settings.option_names()
                          + connections.SENTINEL_OPTIONS)
        if name != "global_keyprefix")
    global_keyprefix = ""

    keyprefix_fanout: str

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        conn = args[0] if args else kwargs["connection"]
        self.settings = Settings.load(conn.client.transport_options)
        self.keys = Keys.for_settings(self.settings)
        # Kombu's binding tables, under the prefix (and the home tag, on a cluster).
        self.keyprefix_queue = self.keys.kombu_binding
        self.keyprefix_binding_permanent = self.keys.kombu_binding_permanent
        self.keyprefix_binding_deadlines = self.keys.kombu_binding_deadlines
        #: Which consumed queues are worth fetching from, and the round-robin over them.
        self._ready = ReadyQueues(default_weight=self.settings.default_weight)
        self._no_ack_queues: set[str] = set()
        #: The worker pool of the process, once this channel fetched for tracking.
        self._worker_pool: WorkerPool | None = None
        #: The worker's concurrency (set by its consumer step): while the process holds
        #: at least this many jobs, a fetch waits until it can take this many.
        self.fetch_min = 1
        #: One node, Sentinel or cluster (Kombu's init already connects through it).
        self.topology = topology_for(self, conn.client)
        self.topology.prepare()
        self.fetcher = Fetcher(self)
        self.wakeups = Wakeups(self)
        self.job_queues = JobQueues(self)
        super().__init__(*args, **kwargs)
        self.handlers["WAKE"] = self.wakeups.read
        self._scripts = _scripts.Scripts(self.topology.scripts_client())
        # The event loop sends fetch by SHA without redis-py's NOSCRIPT fallback.
        with self.conn_or_acquire() as client:
            self._scripts.load_all(client)
            # Redis time minus local time: jobs are stamped on the one clock.
            self._clock_offset = now_s(client) - time.time()

    # -- connections -------------------------------------------------------------------
    def _connparams(self, asynchronous: bool = False) -> dict[str, Any]:
        conninfo = self.connection.client
        tls = conninfo.transport_cls in (TLS_SCHEME, TLS_SENTINEL_SCHEME) or self.topology.tls
        if tls and not conninfo.ssl:
            # Secure by default: verify the server certificate unless told otherwise
            # (e.g. ?ssl_cert_reqs=none in the URL, as with rediss://).
            conninfo.ssl = {"ssl_cert_reqs": ssl.CERT_REQUIRED}
        params = super()._connparams(asynchronous=asynchronous)
        return connections.green_connections(connections.watch_replies(params, self.settings))

    def _get_pool(self, asynchronous: bool = False) -> Any:
        return self.topology.connections(asynchronous, super()._get_pool)

    def _create_client(self, asynchronous: bool = False) -> Any:
        return self.topology.create_client(asynchronous, super()._create_client)

    @contextmanager
    def conn_or_acquire(self, client: Any = None) -> Iterator[Any]:
        """Like Kombu's, but with one shared client per channel (``Topology.client``)."""
        yield client if client else self.topology.client()

    @property
    def server_id(self) -> str:
        """Which server this channel talks to; kept after close, when Kombu has
        dropped ``self.connection`` but acks of jobs still running must go on."""
        return self.topology.server_id

    @property
    def scripts(self) -> _scripts.Scripts:
        """The plugin's Lua scripts, bound to this channel's client."""
        return self._scripts

    def new_client(self) -> Any:
        """A client on a connection pool of its own, with this channel's connection
        settings (server or sentinels, TLS, password, timeouts): for parts that outlive
        channels. On a cluster, a cluster client of its own."""
        return self.topology.new_client()

    # -- producing ---------------------------------------------------------------------
    @property
    def enqueuer(self) -> Enqueuer:
        """Writes this channel's published jobs (the producer path, :mod:`.publish`)."""
        enqueuer = self.__dict__.get("_enqueuer")
        if enqueuer is None:
            enqueuer = self.__dict__["_enqueuer"] = Enqueuer(
                self.settings, self.keys, self._scripts, self.conn_or_acquire, self._expires,
                clock_offset=getattr(self, "_clock_offset", 0.0),
                connections=self.topology.publish_connections())
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
        """Kombu's ``Producer.batch()``: a bulk (``producer/bulk.py``) of this channel."""
        return Bulk(max_size, channel=self)

    # -- fanout (events, remote control): Kombu's channels, under the prefix ---------------
    def _get_publish_topic(self, exchange: str, routing_key: str) -> str:
        return self.keys.kombu_channel(super()._get_publish_topic(exchange, routing_key))

    def _put_fanout(self, exchange: str, message: Any, routing_key: str, **kwargs: Any) -> None:
        # A revoke is recorded in Redis before its broadcast goes out (producer/control.py),
        # so it holds for the workers that are not up to hear it. (Events: nothing more.)
        if exchange.endswith(MAILBOX_SUFFIX):
            with self.conn_or_acquire() as client:
                outcome = record_control(exchange, message, self.decode_body, client,
                                         self._scripts, self.settings)
            # The jobs the revoke moved to the dead set reach no worker to mark their
            # results: this process does, in its app's backend (the connections of an
            # installed app's producer pool know it; a drop-in app's do not).
            app = getattr(self.connection.client, "celery_app", None)
            if outcome and outcome["removed"] and app is not None:
                mark_revoked(sorted(outcome["removed"]), app.backend)
        super()._put_fanout(exchange, message, routing_key, **kwargs)

    def _handle_message(self, client: Any, r: Any) -> dict[str, Any]:
        payload: dict[str, Any] = super()._handle_message(client, r)
        if self.keys.keyprefix and payload["channel"] is not None:
            # Kombu reads the exchange from the channel's name: without the prefix.
            payload["channel"] = self.keys.kombu_topic(bytes_to_str(payload["channel"]))
        return payload

    # -- queue management --------------------------------------------------------------
    def _size(self, queue: str) -> int:
        return self.job_queues.size(queue)

    def _purge(self, queue: str) -> int:
        return self.job_queues.purge(queue)

    def _has_queue(self, queue: str, **kwargs: Any) -> bool:
        return self.job_queues.exists(queue)

    def _delete(self, queue: str, exchange: str, routing_key: str, pattern: str,
                *args: Any, **kwargs: Any) -> None:
        self.job_queues.delete(queue, exchange, routing_key, pattern, kwargs.get("client"))

    def _maybe_update_queues_expire(self, client: Any, queue: str) -> None:
        self.job_queues.update_expiry(client, queue)

    def predeclared(self, queues: Iterable[Any]) -> AbstractContextManager[None]:
        """Declare many queues in one round trip (``JobQueues.predeclared``): a context
        manager, used by ``install``'s consumer."""
        return self.job_queues.predeclared(queues)

    def _queue_bind(self, exchange: str, routing_key: str, pattern: str, queue: str) -> None:
        self.job_queues.bind(exchange, routing_key, pattern, queue, super()._queue_bind)

    def _refresh_bindings(self, queues: Any) -> None:
        self.job_queues.refresh_bindings(queues, super()._refresh_bindings)

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
        self._consumers_changed()
        return ret

    def _basic_cancel(self, consumer_tag: str) -> Any:
        queue = self._tag_to_queue.get(consumer_tag)
        ret = super()._basic_cancel(consumer_tag)
        if queue is not None and queue not in self._active_queues:  # (may be consumed twice)
            self._ready.remove(queue)
        self._consumers_changed()
        return ret

    def consumed_job_queues(self) -> frozenset[str]:
        """The job queues this channel fetches for its pool (not fanout, not no-ack)."""
        return frozenset(q for q in self._active_queues
                         if q not in self.active_fanout_queues and q not in self._no_ack_queues)

    def _consumers_changed(self) -> None:
        """Tell the pool (the next fetch writes it to its registration: readers mark a
        job queue no live pool consumes); nothing is computed per consumer here."""
        if self._worker_pool is not None:
            self._worker_pool.consumes(self)

    def _update_queue_cycle(self) -> None:
        """Unused: Kombu calls this after every basic_consume and basic_cancel to
        rebuild its cycle from every consumed queue (quadratic in the number of job
        queues at start and stop); those two methods above change the one queue in
        the pool's scheduler instead."""

    def basic_get(self, queue: str, no_ack: bool = False, **kwargs: Any) -> Any:
        return self.fetcher.get(queue, no_ack)

    def _get(self, queue: str, timeout: float | None = None) -> Any:
        return self.fetcher.get_raw(queue)

    def _brpop_start(self, timeout: Any = None) -> None:
        self.fetcher.start()

    def _brpop_read(self, **options: Any) -> bool:
        return self.fetcher.read(**options)

    def _poll_error(self, type: str, **options: Any) -> Any:
        if type == "BRPOP":  # the fetch's socket failed: read its reply, or note it lost
            with suppress(Empty):
                self._brpop_read(**options)
            return None
        return super()._poll_error(type, **options)

    # -- the worker pool: what the worker side asks of a channel ------------------------
    @property
    def worker_pool(self) -> WorkerPool:
        """The worker pool of this process (registered and started before its first
        tracked fetch: heartbeat, reaper, requeuer)."""
        pool = self._worker_pool
        if pool is None:
            pool = self._worker_pool = pool_for(self.new_client, self.settings, self.server_id)
            pool.consumes(self)
            pool.describe_consumed()
        return pool

    @property
    def pool_id(self) -> str:
        return self.worker_pool.pool_id

    def copy_of(self, tag: str, queue: str | None = None) -> Keys:
        """The copy of the layout whose records hold the tracked job ``tag``: its job
        queue's on a cluster (``queue``'s when the job is no longer in a record), the
        one copy on one node."""
        return self.topology.copy_of(tag, queue)

    def _dead_letter(self, tag: str, reason: str, error: str, **meta: Any) -> bool:
        """Move one in-flight job of this pool to the dead set (``Fetcher.dead_letter``)."""
        return self.fetcher.dead_letter(tag, reason, error, **meta)

    def throttle_job(self, tag: str, seconds: float, job: bytes = b"") -> str | None:
        """The job raised ``Throttled(seconds)``: back to the front of its queue, its fair
        key or queue held that long in all pools (``WorkerPool.throttle``). Returns
        "key" or "queue" (what is held), or None (the job was no longer there)."""
        held = self.worker_pool.throttle(tag, max(1, round(seconds * 1_000_000)), job)
        self.qos.forget(tag)
        return held

    def recover_lost(self, tag: str) -> str:
        """The job's prefork child died: requeue it now, counting a recovery, or
        dead-letter it past max_recoveries. Returns "requeued", "dead" or "gone"."""
        outcome = self.worker_pool.recover_lost(tag)
        self.qos.forget(tag)
        return outcome

    def close(self) -> None:
        self.wakeups.close()
        try:
            super().close()  # reads a fetch still on the wire, then restore_unacked
        finally:
            self.fetcher.finished(lost=True)
            self.fetcher.drop_kept()


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
        refuse_unsupported(self.client, self.settings)
        # Fix the pool id now, before a prefork pool forks: children then know which
        # pool owns the jobs they run (their busy records and checkins name it).
        current_pool_id()
        # A process that publishes through this transport computes the fair keys of its
        # jobs (options/fair.py), in drop-in mode too: Celery makes the transport of its
        # producer's connection before it sends ``before_task_publish``. (Idempotent.)
        connect_fair_keys()
        periodic_leader.connect_signals()  # (celery beat: before its beat_init)

    #: The event loop (Celery's hub) the channels' timers run on, once registered.
    event_loop: Any = None

    def register_with_event_loop(self, connection: Any, loop: Any) -> None:
        super().register_with_event_loop(connection, loop)
        self.cycle.take_turns(loop, self.on_readable)  # (no reader re-added each turn)
        self.event_loop = loop
        # Acks made in the loop's thread are written by its turns (ack_batcher.py).
        use_event_loop(loop)
        cycle = self.cycle
        old = getattr(cycle, "_ready_refresh_tref", None)
        if old is not None:
            old.cancel()
        cycle._ready_refresh_tref = loop.call_repeatedly(
            self.settings.idle_refresh_interval, cycle.maybe_refresh_ready)
