"""The producer path: how one published job gets into Redis, in one straight line.

Kombu's ``Channel._put`` ("deliver this message to this job queue") is a thin call
to :meth:`Enqueuer.put`, which does, in this order:

1. stamps ``enqueued_at`` on the Redis clock (the due time for a job with a future
   ``eta``): queue latency is read from it;
2. takes the message's publish id (below) and encodes the payload without it,
   refusing it with ``PayloadTooLarge`` over ``max_payload_bytes`` before anything
   is written;
3. builds the one script call that writes it (:class:`~celery_ext.producer.bulk.Write`):
   a job due later (countdown, eta, retry backoff) goes to the scheduled or retry set
   (``schedule``), a unique job is pushed only if no identical job is pending
   (``enqueue_unique``, or ``schedule`` with its lock), any other job is pushed to its
   job queue (``enqueue``);
4. writes it with :meth:`Enqueuer.write`, the one way jobs are written, or adds it to
   the bulk under way (``producer/bulk.py``: ``celery_ext.bulk``, ``apply_many``, a
   group under ``install(app)``, Kombu's ``Producer.batch()``), which writes its jobs
   with the same method, ``BULK_PIPELINE_SIZE`` per round trip. A single publish is a
   bulk of one.

``BrokerOutOfMemory`` (Redis at ``maxmemory``) is raised by ``Channel.basic_publish``
around all of it, so Kombu's publish retry does not loop on a full Redis.

Exactly once across an outage
-----------------------------
Celery publishes with a retry policy: when the connection breaks during a publish,
``kombu.Connection.ensure`` reconnects and calls ``Producer._publish`` again. If
the first write reached Redis and only its reply was lost, a plain push would store
the job twice. Kombu builds the message dict afresh for every attempt (with a new
``delivery_tag``) but hands every attempt of one ``Producer.publish`` call the same
``properties`` dict. The first attempt stores a random publish id there
(:data:`PUBLISH_ID`); every attempt sends the marker key derived from it and the job
queue (``{ns}:published:<marker>``), and the script writes the job only if that key
is absent, setting it for ``publish_idempotency_ttl``. A publish that succeeded drops
its id (:meth:`Enqueuer.published`): only a failed one is retried. A retry within that time
writes nothing; a retry after it (or with the setting 0) writes the job again.
Every job of a bulk carries its marker too: a bulk's round trip that failed is sent
again under its retry policy, and the jobs the first attempt wrote are no-ops.

Surviving a failover
--------------------
Redis replicates asynchronously: a job written to the primary and lost with it
before a replica had it is gone. With ``wait_replicas`` = N (transport option), each
enqueue is followed by ``WAIT N wait_timeout_ms`` on the same connection, in the same
round trip; the publish returns only once N replicas have the job, and raises
``NotReplicated`` otherwise (the job is on the primary: see its docstring). Only the
enqueue waits: it is the one write that creates a job. Every later move (fetch, ack,
requeue, promote, dead-letter) takes a job from one record to another in one script;
a failover that loses such a move leaves the job in the record it came from, from
where the pool's reconcile or the reaper runs it again. Waiting there would cost a
round trip on the hot path to turn a possible duplicate into none, which is not the
promise (delivery is at-least-once). A bulk's round trip ends with one ``WAIT`` for all
its jobs.

A retried publish (above) may find its marker: the first attempt's script ran and the
connection broke before ``WAIT`` answered. ``WAIT`` counts the replicas that have this
connection's last write, and a connection that wrote nothing has nothing to wait
for: it would return at once with every replica counted, though none may have the
job. So a script that finds the marker renews the marker's TTL (``PEXPIRE``, a write
that also goes through when Redis is full): the replication stream is one ordered
log, so a replica that has this write has the first attempt's too, and the ``WAIT``
after it covers the job the retry found, or raises ``NotReplicated``.

One connection per channel
--------------------------
A publish is one script call, and most of its client-side cost was redis-py's client
layer (pool checkout and release, command lookup, retry wrapper), not the script: the
Enqueuer keeps one connection of the channel's pool for its script calls
(:class:`PublishConnection`) and writes on it directly. Only one thread uses it at a
time; one that finds it busy, and any call that fails on it (connection lost, script
cache flushed), goes through the channel's client as before, with redis-py's own
retries and NOSCRIPT handling, and the publish marker makes that second write a no-op
if the first one landed.

The publish id is never part of the stored payload: a consumer that republishes a
job (``celery migrate``) copies its properties, and its copy must not be mistaken
for a retry. The marker of one publish is per job queue because one publish to an
exchange may deliver to several queues.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import secrets
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any, cast

import redis
from kombu import messaging, pools
from kombu.resource import Resource
from kombu.utils.functional import ChannelPromise
from redis.exceptions import NoScriptError

from celery_ext.config import Settings
from celery_ext.errors import NotReplicated, check_payload_size, job_name
from celery_ext.options.fair import message_fair_key, place_last
from celery_ext.options.priority import level as priority_level
from celery_ext.options.priority import message_priority
from celery_ext.options.unique import UNTIL_FINISHED, UniqueRequest, lock_value, take_pending
from celery_ext.producer.bulk import Bulk, Write, current_bulk
from celery_ext.producer.periodic_run import PeriodicRun, current_run, run_marker, write_run_apart
from celery_ext.producer.publish_line import NOT_SENT, PublishConnection, pack_command
from celery_ext.producer.scheduled import eta_delay_ms, retries_of, schedule_args
from celery_ext.store import scripts as _scripts
from celery_ext.store.compact import pack
from celery_ext.store.job_index import index_keys, index_ttl_ms
from celery_ext.store.keys import STAT_UNIQUE_HITS, Keys

#: Cluster: seconds between two additions of one job queue to the home registry by
#: one producer process (the registry is a hint; readers never forget a cluster's).
REGISTRY_REFRESH = 60.0
#: Message property holding the publish id while Kombu may retry the publish; removed
#: from the payload before it is written.
PUBLISH_ID = "celery_ext_publish_id"
#: Message property naming a publish that must happen once however often it is repeated
#: (a chord's body, published again when the header job that published it runs again):
#: the publish id is derived from it and the job's task id, and its marker lives
#: :data:`PUBLISH_ONCE_TTL` seconds. Removed from the payload before it is written.
PUBLISH_ONCE = "celery_ext_publish_once"
#: Message property: seconds the marker of a :data:`PUBLISH_ONCE` publish lives.
PUBLISH_ONCE_TTL = "celery_ext_publish_once_ttl"


def publish_marker(publish_id: str, queue: str) -> str:
    """The marker of one publish to one job queue: 16 characters (96 bits)."""
    digest = hashlib.blake2b(queue.encode("utf-8"), key=publish_id.encode("utf-8")[:64],
                             digest_size=12).digest()
    return base64.urlsafe_b64encode(digest).decode("ascii")


class Enqueuer:
    """Writes published jobs to Redis for one channel (see the module docstring).

    ``acquire`` is the channel's ``conn_or_acquire``: one client per channel, reused
    by every publish. ``connections`` returns the channel's redis-py connections, of which
    one is kept for the script calls (:class:`PublishConnection`; None: every
    call goes through the client). ``expires`` is the channel's queue-expiry dict
    (``x-expires``), read at each publish.
    """

    def __init__(self, settings: Settings, keys: Keys, scripts: _scripts.Scripts,
                 acquire: Callable[[], AbstractContextManager[Any]],
                 expires: Mapping[str, int], clock_offset: float,
                 connections: Callable[[], Any] | None = None) -> None:
        self.settings = settings
        self.keys = keys
        self._scripts = scripts
        self._acquire = acquire
        self._expires = expires
        self._clock_offset = clock_offset
        self._marker_ttl_ms = int(settings.publish_idempotency_ttl * 1000)
        self._line = PublishConnection(connections) if connections is not None else None
        self._index_keys = index_keys(keys)  # the job index (job_index.py)
        self._index_ttl = index_ttl_ms(settings)
        #: Cluster: when each job queue was last added to the home registry.
        self._registered: dict[str, float] = {}

    def put(self, queue: str, message: dict[str, Any], batch: Bulk | None = None) -> None:
        """Write one job to ``queue``, or add its write to ``batch`` (Kombu's publish
        batch) or to the bulk this thread publishes into (:mod:`.bulk`)."""
        delay = eta_delay_ms(message)
        uniq = take_pending(message)
        run = current_run()
        props = message.get("properties")
        if not isinstance(props, dict):  # not a Kombu message: written as it is
            self._send(self._command(queue, message, delay, uniq, None), batch)
            return
        # Enqueued when due: queue latency counts from then.
        enqueued_at = time.time() + self._clock_offset + (delay or 0) / 1000
        props.setdefault("enqueued_at", round(enqueued_at, 3))
        place_last(props)  # after enqueued_at: the scripts look for it at the end
        once, once_ttl = props.pop(PUBLISH_ONCE, None), props.pop(PUBLISH_ONCE_TTL, None)
        publish_id = str(props.pop(PUBLISH_ID, None) or secrets.token_hex(16))
        marker_ttl_ms = self._marker_ttl_ms
        if once:  # the same publish from any process, any time within once_ttl: one job
            headers = message.get("headers")
            task_id = headers.get("id") if isinstance(headers, dict) else None
            publish_id = f"{once}:{task_id or ''}"
            marker_ttl_ms = max(marker_ttl_ms, int(float(once_ttl or 0) * 1000))
        try:
            if run is not None:  # a periodic job's run: exactly once per due time
                self._write_run(queue, message, run, uniq, delay)
                return
            marker = None
            if marker_ttl_ms:
                marker = (self.keys.of(queue).published(publish_marker(publish_id, queue)),
                          marker_ttl_ms)
            self._send(self._command(queue, message, delay, uniq, marker), batch)
        except NotReplicated as exc:
            raise NotReplicated(f"job {job_name(message, queue)} was enqueued", exc.wanted,
                                exc.acked, self.settings.wait_timeout_ms) from None
        finally:
            props[PUBLISH_ID] = publish_id  # for Kombu's next attempt of this publish
            if once:
                props[PUBLISH_ONCE], props[PUBLISH_ONCE_TTL] = once, once_ttl

    @staticmethod
    def published(message: Any) -> None:
        """The publish of ``message`` succeeded: forget its publish id, so that the same
        dict published again (only a retry reuses it on purpose) is a new publish."""
        props = message.get("properties") if isinstance(message, dict) else None
        if isinstance(props, dict):
            props.pop(PUBLISH_ID, None)
            props.pop(PUBLISH_ONCE, None)
            props.pop(PUBLISH_ONCE_TTL, None)

    def _send(self, write: Write, batch: Bulk | None) -> None:
        """Write now (a single publish: a bulk of one) or add to the bulk under way. On a
        cluster every job is written at once (a pipeline there is split per slot)."""
        bulk = batch if batch is not None else current_bulk()
        if bulk is not None and not self.keys.cluster:
            bulk.add(self, write)
        else:
            self.write([write])

    def _command(self, queue: str, message: dict[str, Any], delay: int | None,
                 uniq: UniqueRequest | None, marker: tuple[str, int] | None) -> Write:
        """The one script call that writes this job: ``schedule`` for a job due later
        (a unique one with its lock), ``enqueue_unique`` for a unique job, else
        ``enqueue``; a payload over ``max_payload_bytes`` raises before anything is sent."""
        marker_keys, marker_args = ([marker[0]], [marker[1]]) if marker else ([], [])
        copy = self.keys.of(queue)
        index = self._index_keys if copy is self.keys else index_keys(copy)
        if self.keys.cluster:
            self._register(queue)
        if uniq is not None and uniq.debounce is not None and retries_of(message) == 0:
            # Debounced: it waits its debounce time (or its countdown, if longer).
            delay = max(delay or 0, int(uniq.debounce * 1000))
        if delay is not None:
            keys, args = schedule_args(
                copy, queue, message, delay,
                lock=self._lock(uniq, message, copy) if uniq is not None else None,
                max_payload=self.settings.max_payload_bytes, marker=marker,
                index_ttl_ms=self._index_ttl)
            return Write("schedule", keys, args,
                         functools.partial(self._stored, queue, message, uniq, copy, 2))
        if uniq is not None:
            lock_key, value, ttl_ms, force = self._lock(uniq, message, copy)
            return Write(
                "enqueue_unique",
                [lock_key, *self._queue_keys(queue, message), *index, *marker_keys],
                [*self._queue_args(queue, message), self._index_ttl, value, ttl_ms, force,
                 *marker_args],
                functools.partial(self._stored, queue, message, uniq, copy, 1))
        return Write("enqueue", [*self._queue_keys(queue, message), *index, *marker_keys],
                     [*self._queue_args(queue, message), self._index_ttl, *marker_args],
                     functools.partial(self._pushed, queue) if self.keys.cluster else None)

    def _stored(self, queue: str, message: dict[str, Any], uniq: UniqueRequest | None,
                copy: Keys, holder_at: int, reply: Any) -> None:
        """After a ``schedule`` (holder at 2) or ``enqueue_unique`` (at 1) reply: the
        cluster's hints, and a unique job's holder (the pending job's task id)."""
        if holder_at == 2:
            self._scheduled(queue)
        else:
            self._pushed(queue, 1)
        if uniq is not None:
            holder = reply[holder_at]
            uniq.settle(holder.decode() if isinstance(holder, bytes) else str(holder))
            self._count_unique_hit(uniq, message, copy)

    def _register(self, queue: str) -> None:
        """Cluster: add ``queue`` to the home registry of job queues before its first
        job (index first, data after), and again every ``REGISTRY_REFRESH`` seconds."""
        now = time.monotonic()
        if now - self._registered.get(queue, -REGISTRY_REFRESH) < REGISTRY_REFRESH \
                or queue.endswith(".pidbox"):
            return
        with self._acquire() as client:
            client.sadd(self.keys.queues, queue)
        self._registered[queue] = now

    def _scheduled(self, queue: str) -> None:
        """Cluster: a job was written to the scheduled or retry set of its queue's copy;
        add the queue to the home registry after it, whatever the cache says: a reader
        may have forgotten the queue since (``store/copies.forget_queues``), and the
        requeuer finds due jobs only in the copies of known queues."""
        if not self.keys.cluster:
            return
        with self._acquire() as client:
            client.sadd(self.keys.queues, queue)

    def _pushed(self, queue: str, n: Any) -> None:
        """Cluster: a push that found its list empty (``n`` == 1) adds the queue to the
        home hint of ready queues, after the push (see docs/cluster.md)."""
        if not self.keys.cluster or n != 1:
            return
        with self._acquire() as client:
            client.sadd(self.keys.ready, queue)

    def _count_unique_hit(self, uniq: UniqueRequest, message: dict[str, Any],
                          copy: Keys) -> None:
        """Count an enqueue dropped because an identical job is pending (another job
        holds the lock; a retried publish of this same job is no hit)."""
        if uniq.holder != str(message["headers"].get("id")):
            with self._acquire() as client:
                client.hincrby(copy.stats, STAT_UNIQUE_HITS, 1)

    def _write_run(self, queue: str, message: dict[str, Any], run: PeriodicRun,
                   uniq: UniqueRequest | None, delay: int | None) -> None:
        """Push a periodic job's run with ``periodic_run``, which checks and moves its
        entry's next due time in the same call (see ``periodic_run.py``); on a cluster,
        and for a run with a countdown or eta (``delay`` ms: it waits in the scheduled
        set, as any job due later), in two steps made exactly once by a run record
        (``periodic_run.write_run_apart``). Each write goes through :meth:`write`."""
        if self.keys.cluster or delay is not None:
            copy = self.keys.of(queue)
            marker = (copy.published(run_marker(run)), max(1, self._marker_ttl_ms))
            push: tuple[str, list[str], list[Any]]
            if delay is None:
                push = ("enqueue", [*self._queue_keys(queue, message), *index_keys(copy),
                                    marker[0]],
                        [*self._queue_args(queue, message), self._index_ttl, marker[1]])
            else:
                if self.keys.cluster:
                    self._register(queue)
                push = ("schedule", *schedule_args(
                    copy, queue, message, delay, max_payload=self.settings.max_payload_bytes,
                    marker=marker, index_ttl_ms=self._index_ttl))
            with self._acquire() as client:
                run.outcome = write_run_apart(
                    lambda script, keys, args: self.write([Write(script, keys, args)])[0],
                    client, self.keys, queue, push, run)
        else:
            def ran(reply: Any) -> None:
                run.outcome = int(reply)

            self.write([Write(
                "periodic_run",
                [self.keys.periodic_entry(run.entry), *self._queue_keys(queue, message),
                 *self._index_keys],
                [*run.script_args(), *self._queue_args(queue, message), "", self._index_ttl],
                ran)])
        if uniq is not None:
            uniq.holder = run.job_id  # the entry, not the unique lock, keeps it single

    def _queue_keys(self, queue: str, message: dict[str, Any]) -> list[str]:
        """KEYS the ``enqueue`` and ``enqueue_unique`` scripts share: first the list of
        the job's priority level in its queue (:mod:`.priority`), or for a job with a
        fair key the queue key, whose key's sub-queue the script derives (:mod:`.fair`)."""
        k = self.keys.of(queue)
        if message_fair_key(message) is not None:
            return [k.queue(queue), k.ready, k.queues]
        level = priority_level(message_priority(message), self.settings.priority_steps)
        return [k.queue_level(queue, level), k.ready, k.queues]

    def _queue_args(self, queue: str, message: dict[str, Any]) -> list[Any]:
        """ARGV the ``enqueue`` and ``enqueue_unique`` scripts share, payload first."""
        payload = pack(message, queue)  # the compact form (store/compact.py)
        check_payload_size(payload, message, queue, self.settings.max_payload_bytes)
        return [payload, queue, self.keys.wake_channel, self._expires.get(queue, 0)]

    def _lock(self, uniq: UniqueRequest, message: dict[str, Any],
              copy: Keys) -> tuple[str, str, int, str]:
        """(lock key, lock value, TTL ms, force) of a unique job (see ``schedule.lua``): a
        retry is always written ("1"), a debounced job replaces a holder still waiting
        ("d"). The value carries the delivery tag where a script needs it: a job locked
        until finished (its final move releases the lock) or debounced (the holder's
        record is found by its tag)."""
        ttl_ms = int((uniq.ttl or self.settings.unique_ttl) * 1000)
        retry = retries_of(message) > 0
        mode = UNTIL_FINISHED if uniq.debounce is not None else uniq.mode
        value = lock_value(mode, str(message["headers"].get("id")),
                           str(message["properties"].get("delivery_tag")))
        return (copy.unique(uniq.digest), value, ttl_ms,
                "1" if retry else "d" if uniq.debounce is not None else "0")

    def start(self, writes: Sequence[Write]) -> bool:
        """Send the round trip of ``writes`` on the kept connection, its replies left for
        :meth:`finish`; False when not sent (the caller writes them instead)."""
        if self._line is None or self.keys.cluster:
            return False
        return self._line.start(self._commands(writes))

    def finish(self, writes: Sequence[Write]) -> list[Any]:
        """:meth:`write` for the ``writes`` :meth:`start` sent, from their replies."""
        assert self._line is not None
        return self.write(writes, sent=self._line.finish())

    def write(self, writes: Sequence[Write], sent: Any = None) -> list[Any]:
        """The one way jobs are written: one round trip for ``writes`` (a single publish
        is a list of one), then each write's ``done`` with its script's reply.

        The round trip is the writes' EVALSHAs, followed by ``WAIT`` when
        ``wait_replicas`` is set (the producer's only ``WAIT``: see "Surviving a
        failover"), sent in one buffer on the kept connection (:class:`PublishConnection`),
        or as a pipeline of the channel's client when that one is busy or failed (or
        ``sent``: the replies of the round trip :meth:`start` sent). Writes
        whose script the server did not know (it restarted) are sent again once it is
        loaded. A connection error is raised to the caller (Kombu's publish retry for a
        single publish, the bulk's retry policy for a bulk), which sends the same writes
        again: each job's publish marker makes what landed a no-op."""
        wanted = self.settings.wait_replicas
        replies: list[Any] = [None] * len(writes)
        todo = list(range(len(writes)))
        for attempt in (1, 2):
            out = self._round_trip([writes[i] for i in todo], sent)
            sent = None
            acked: Any = out.pop() if wanted else 0
            unknown: list[int] = []
            for i, reply in zip(todo, out, strict=True):
                if isinstance(reply, NoScriptError) and attempt == 1:
                    unknown.append(i)
                elif isinstance(reply, Exception):
                    raise reply
                else:
                    replies[i] = reply
            if isinstance(acked, Exception):
                raise acked
            if wanted and int(acked) < wanted:
                raise NotReplicated("the job was enqueued" if len(writes) == 1
                                    else f"{len(writes)} jobs were enqueued",
                                    wanted, int(acked), self.settings.wait_timeout_ms)
            if not unknown:
                break
            with self._acquire() as client:
                for name in {writes[i].script for i in unknown}:
                    client.script_load(_scripts.source(name))  # the server restarted
            todo = unknown
        for w, reply in zip(writes, replies, strict=True):
            if w.done is not None:
                w.done(reply)
        return replies

    def _commands(self, writes: Sequence[Write]) -> list[bytes]:
        """The round trip of ``writes`` in the Redis protocol: their EVALSHAs, and ``WAIT``
        when ``wait_replicas`` is set."""
        commands = [_scripts.pack_evalsha(_scripts.sha(w.script), w.keys, w.args) for w in writes]
        if self.settings.wait_replicas:
            commands.append(pack_command("WAIT", self.settings.wait_replicas,
                                         self.settings.wait_timeout_ms))
        return commands

    def _round_trip(self, writes: Sequence[Write], sent: Any = None) -> list[Any]:
        """The replies of the writes' scripts (and of ``WAIT``), errors in place; ``sent``:
        the replies of the round trip :meth:`start` sent (:data:`NOT_SENT`: none came)."""
        if sent is None and self._line is not None:
            sent = self._line.send(self._commands(writes))
        if sent is not None and sent is not NOT_SENT:
            return cast("list[Any]", sent)
        wanted, timeout_ms = self.settings.wait_replicas, self.settings.wait_timeout_ms
        if self.keys.cluster:  # no EVALSHA in a cluster pipeline (and no bulk, no WAIT)
            with self._acquire() as client:
                return [self._one(client, w) for w in writes]
        with self._acquire() as client, client.pipeline(transaction=False) as pipe:
            for w in writes:
                pipe.evalsha(_scripts.sha(w.script), len(w.keys), *w.keys, *w.args)
            if wanted:
                pipe.wait(wanted, timeout_ms)
            return cast("list[Any]", pipe.execute(raise_on_error=False))

    def _one(self, client: Any, w: Write) -> Any:
        """One script call through the client (redis-py's NOSCRIPT handling), its error
        reply in place."""
        try:
            return self._scripts(w.script, w.keys, w.args, client=client)
        except redis.exceptions.ResponseError as exc:
            return exc


class Producer(messaging.Producer):
    """Kombu's producer, without the per-publish declaration round of binding copies.

    Before every publish Kombu "maybe declares" the target queue: it binds a copy of
    the queue entity to the channel (three copies per publish) only to find its hash in
    the connection's set of declared entities. This producer looks the entity up in
    that set first and leaves to Kombu (declaration, retries, caching) only what is not
    there: what is written and when is unchanged. ``install(app)`` makes it the class of
    the app's producer pool (``install.AMQP.producer_pool``).
    """

    def _publish(self, body: Any, priority: Any, content_type: Any, content_encoding: Any,
                 headers: Any, properties: Any, routing_key: Any, mandatory: Any,
                 immediate: Any, exchange: Any, declare: Any, *args: Any, **kwargs: Any) -> Any:
        if declare:
            connection = self.channel.connection
            declared = connection.client.declared_entities if connection is not None else None
            if declared is not None:
                declare = [e for e in declare
                           if not e.can_cache_declaration or hash(e) not in declared]
        return super()._publish(body, priority, content_type, content_encoding, headers,
                                properties, routing_key, mandatory, immediate, exchange,
                                declare, *args, **kwargs)


class Producers(pools.ProducerPool):
    """Kombu's producer pool, whose producers keep their connection between uses.

    Kombu's pool hands a producer's connection back to the connection pool at every
    release and, at the next acquire, takes one again and rebinds the producer (a new
    channel promise, a copy of its exchange): about 25 µs of CPU per ``apply_async``.
    Here a producer keeps the connection it was made with for as long as the pool
    keeps it; the connection pool must be the producer pool's own, with the same limit
    (``install.AMQP.producer_pool``): kept connections of a pool other apps share would
    starve them. Without a limit a producer is not kept, so its connection is released
    as Kombu does. A producer whose channel closed while it was in the pool (its
    connection failed or was closed) gets a connection and a channel again, the way
    Kombu's pool gives them at every acquire.
    """

    #: The Celery app whose pool this is (``install.AMQP.producer_pool``), set on every
    #: connection the pool takes (``celery_app``): the pool and its connection pool are
    #: the app's own, so the channel of a revoke it publishes finds the app whose result
    #: backend to mark (``Channel._put_fanout``).
    celery_app: Any = None

    def _acquire_connection(self) -> Any:
        conn = super()._acquire_connection()
        if self.celery_app is not None:
            conn.celery_app = self.celery_app
        return conn

    def prepare(self, p: Any) -> Any:
        channel = getattr(p, "_channel", None)
        if channel is not None and not isinstance(channel, ChannelPromise) and (
                getattr(channel, "closed", False) or channel.connection is None):
            if p.__connection__:
                p.__connection__.release()
            p.channel = None
        return super().prepare(p)

    def release(self, resource: Any) -> None:
        if not self.limit:
            super().release(resource)
            return
        Resource.release(self, resource)
