"""One worker pool's life in one process: the object that starts, holds and stops it.

A worker pool is one consuming process (a ``celery worker`` main process). Its
:class:`WorkerPool` is made by the transport the first time a channel of the
process fetches for tracking, so every worker consuming through our scheme has one,
with or without ``install(app)`` (drop-in mode). It owns, in start order:

1. the heartbeater: registration, then a heartbeat thread;
2. the reaper: dead pools' jobs back to their queues;
3. the requeuer: due scheduled and retry jobs to their queues;
4. once the consumer runs, the periodic leader (``run_periodic``): the app's
   ``beat_schedule`` and the runtime entries while this pool holds their lease;

and, for the life of the process, what the process holds of the pool's in-flight
record (``holdings.Holdings``), the acks made and not yet written
(``ack_batcher.AckBatcher``) and the connection they travel on (``acks.AckSender``).
``stop()`` runs
in the reverse order: the periodic leader and the requeuer hand over their leases,
the reaper stops, the busy records and counters of this process are flushed, acks
still unconfirmed are applied, every job still in the record goes back to the front
of its queue, and the heartbeater deregisters the pool last (gocraft/work's
``WorkerPool.Stop``).

*Reconciling.* The in-flight record must say what the pool really holds. A fetch
whose reply was lost moved jobs into the record that the process never received;
Celery drops the jobs it had reserved when its connection is lost (prefork), while
a threads pool still runs the ones it queued; an ack may fail with Redis out of
reach. So after every reconnect, lost reply or failed move, ``reconcile()`` runs in
the consumer's own thread before its next fetch, until it succeeds: it applies the
acks not confirmed by Redis first, then returns to the front of their queues the
jobs of the record this process no longer holds. A job is held while the process
can still ack it: its message is still referenced by something that will finish
it, or its ack is under way.
"""

from __future__ import annotations

import atexit
import gc
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any, Protocol

import redis
from celery.signals import task_prerun

from celery_ext.config import Settings
from celery_ext.errors import CONNECTION_ERRORS
from celery_ext.options.unique import finished_lock
from celery_ext.store.connections import green_sockets
from celery_ext.store.job_index import index_ttl_ms
from celery_ext.store.keys import Keys
from celery_ext.store.liveness import QUEUES_FIELD, queues_field
from celery_ext.store.memory import eviction_warning
from celery_ext.text import one_line
from celery_ext.worker.ack_batcher import AckBatcher
from celery_ext.worker.acks import AckSender, SyncAcks
from celery_ext.worker.heartbeater import Heartbeater, current_pool_id
from celery_ext.worker.holdings import Holdings
from celery_ext.worker.inflight import InflightRecord, recover_tags
from celery_ext.worker.observer import stop_observers
from celery_ext.worker.periodic_leader import Periodic, PeriodicLeader
from celery_ext.worker.reaper import Reaper
from celery_ext.worker.requeuer import Requeuer

logger = logging.getLogger("celery_ext.worker.worker_pool")

#: Shortest gap between two reconcile attempts after one failed (seconds).
RECONCILE_RETRY_INTERVAL = 0.5
#: On a cluster, seconds between two reconciles when nothing asked for one.
CLUSTER_RECONCILE_INTERVAL = 30.0


class WorkerPool:
    """The worker pool of this process for one server and namespace."""

    def __init__(self, client_factory: Callable[[], redis.Redis], settings: Settings,
                 server_id: str) -> None:
        self.settings = settings
        self.keys = Keys.for_settings(settings)
        self.server_id = server_id
        self.pool_id = current_pool_id()
        #: The pool's own connection pool: it outlives every channel (acks of jobs
        #: still running when a channel closed on a lost connection go through it).
        self.client = client_factory()
        self.record = InflightRecord(self.client, self.keys, self.pool_id,
                                     settings.priority_steps, index_ttl_ms(settings))
        self.heartbeater = Heartbeater(self.client, settings, self.pool_id)
        self.reaper = Reaper(client_factory(), settings, own_pool_id=self.pool_id)
        self.requeuer = Requeuer(client_factory(), settings)
        self.holdings = Holdings()
        #: The periodic jobs' leader (``run_periodic``); None: not started, or off.
        self.periodic: PeriodicLeader | None = None
        # On a cluster a pool's acks go to the masters of their queues' copies: they
        # are applied synchronously there (one script per copy), not pipelined on one
        # connection.
        self.acks: AckSender | SyncAcks = (
            SyncAcks(self._ack_now) if self.keys.cluster else
            AckSender(self.client.connection_pool, self._ack_now,
                      on_confirmed=self._confirmed))
        self._next_cluster_reconcile = 0.0
        self._needs_reconcile = False
        self._reconcile_failed_at = 0.0
        self._last_tick = 0.0
        self._fetches_on_wire = 0
        self._wire_lock = threading.Lock()
        #: Acks made and not yet written: one ``ack`` call per batch (``ack_batcher``).
        self.batcher = AckBatcher(self._write_ack_batch, green=green_sockets())
        #: The channels whose consumers changed (``consumes``) and the job queues of
        #: the last registration write (None: not yet, or it failed).
        self._consumers: weakref.WeakSet[Any] = weakref.WeakSet()
        self._consumers_changed = False
        self._consumed_lock = threading.Lock()
        self._consumed_written: str | None = None
        self.state = "new"

    # -- lifecycle -----------------------------------------------------------------------
    def start(self) -> None:
        """Register and start the background parts (idempotent)."""
        if self.state != "new":
            return
        self.heartbeater.start()
        self.reaper.start()
        self.requeuer.start()
        self.acks.connect()  # before the first ack waits on it
        self.state = "running"
        self._warn_on_eviction()

    def mark_stopping(self) -> None:
        """The worker is shutting down: checkins now answer "stop"."""
        if self.state != "running":
            return
        try:
            self.client.hset(self.keys.pool(self.pool_id), "state", "stopping")
        except redis.RedisError as exc:
            logger.warning("celery_ext: could not mark pool stopping: %s", exc)

    def stop(self) -> None:
        """Stop everything in reverse start order; return the jobs left in flight.

        Each step runs whatever the one before it raised (logged): a pool that stopped
        half way would stay registered, its record full, its jobs waiting for another
        pool's reaper, each counted as a recovery."""
        if self.state != "running":
            return
        self.state = "stopped"
        periodic = self.periodic
        steps: list[tuple[str, Callable[[], object]]] = [
            ("stop the periodic leader", periodic.stop if periodic else lambda: None),
            ("stop the requeuer", self.requeuer.stop),
            ("stop the reaper", self.reaper.stop),
            ("flush the busy records", stop_observers),
            ("apply the acks", self._settle_acks),
            ("return the jobs left in flight", self._return_everything),
            ("close the ack connection", self.acks.close),
            ("leave the queues' copies", self.record.leave),
            ("deregister", lambda: self.heartbeater.stop(deregister=True)),
        ]
        for what, step in steps:
            try:
                step()
            except redis.RedisError as exc:
                logger.error("celery_ext: pool %s could not %s at shutdown (%s)%s",
                             self.pool_id, what, one_line(str(exc)),
                             "; the reaper will requeue its jobs" if what.startswith(
                                 "return") else "")
            except Exception:
                logger.exception("celery_ext: pool %s could not %s at shutdown; "
                                 "stopping goes on", self.pool_id, what)

    def _settle_acks(self) -> None:
        """Shutdown: every ack made is applied before anything is returned. An ack
        whose reply could not be read is applied again here (acks are idempotent), so
        a finished job is never returned to run twice."""
        try:
            self.event_loop_gone()
            self.acks.flush()
        except Exception:
            self.holdings.unconfirmed(self.holdings.acking_tags())
            raise
        finally:
            self._replay_acks()

    def _return_everything(self) -> None:
        """Shutdown: nothing of this process runs anymore; return what is left."""
        left = set(self.record.tags())
        if not left:
            return
        ordered = [t for t in self.holdings.delivery_order() if t in left]
        ordered += sorted(left.difference(ordered))
        done = self.record.requeue(ordered)
        self.holdings.released(done)

    def describe(self, **info: Any) -> None:
        """Add registration details (node name, concurrency, ...): shown by the
        dashboard and ``celery ext status``."""
        self.heartbeater.update_info(**info)

    def consumes(self, channel: Any) -> None:
        """``channel``'s consumers changed: :meth:`describe_consumed` writes them."""
        with self._consumed_lock:
            self._consumers.add(channel)
            self._consumers_changed = True

    def describe_consumed(self) -> None:
        """Write the job queues the process consumes to the registration when they changed
        (readers mark a queue no live pool consumes). Before each fetch: one write for
        all the consumers a worker starts; a failed one is tried again at the next."""
        if not self._consumers_changed:
            return
        with self._consumed_lock:
            self._consumers_changed = False
            value = queues_field(q for channel in list(self._consumers)
                                 for q in channel.consumed_job_queues())
            if value == self._consumed_written:
                return
            self._consumed_written = value
        try:
            self.heartbeater.set_info(**{QUEUES_FIELD: value})
        except redis.RedisError as exc:
            with self._consumed_lock:
                self._consumed_written, self._consumers_changed = None, True
            logger.debug("celery_ext: could not record the queues pool %s consumes: %s",
                         self.pool_id, exc)

    def _warn_on_eviction(self) -> None:
        try:
            warning = eviction_warning(self.client)
        except Exception as exc:  # INFO refused (ACL): not worth stopping for
            logger.debug("celery_ext: could not read the broker's memory policy: %s", exc)
        else:
            if warning:
                logger.warning(warning)

    # -- what the process holds ------------------------------------------------------------
    def delivered(self, tag: str, message: Any) -> None:
        self.holdings.delivered(tag, message)
        digest = finished_lock(getattr(message, "headers", None))
        if digest is not None:
            self.record.locked(tag, digest)

    def fetched(self, tag: str, queue: str) -> None:
        """A tracked job of ``queue`` came in a fetch reply (its record's copy)."""
        self.record.fetched(tag, queue)

    def join(self, copies: list[Keys]) -> None:
        """Before fetching from these queues' copies (cluster; see InflightRecord.join)."""
        self.record.join(copies)

    def fetch_sent(self) -> None:
        with self._wire_lock:
            self._fetches_on_wire += 1

    def fetch_done(self, lost: bool = False) -> None:
        """A fetch's reply was read (or its connection failed: ``lost``)."""
        with self._wire_lock:
            self._fetches_on_wire -= 1
        if lost:
            self.needs_reconcile()

    def needs_reconcile(self) -> None:
        self._needs_reconcile = True

    def tick(self) -> None:
        """Once per ``idle_refresh_interval``, from the consumer's event loop: read the
        ack replies that are there (an ack connection that broke is noticed here, not
        at the next ack) and reconcile if needed. Connection errors are left to the
        next fetch."""
        now = time.monotonic()
        if now - self._last_tick < self.settings.idle_refresh_interval * 0.9:
            return
        self._last_tick = now
        self.flush_acks()
        self.acks.poll()
        if self.keys.cluster and now >= self._next_cluster_reconcile:
            # A fetch that redis-py's cluster client retried after a lost reply (MOVED,
            # a failover) leaves jobs in a record with nobody told: look now and then.
            self._next_cluster_reconcile = now + CLUSTER_RECONCILE_INTERVAL
            self.needs_reconcile()
        try:
            self.maybe_reconcile()
        except CONNECTION_ERRORS as exc:
            logger.debug("celery_ext: reconcile failed (%s); retried", exc)

    def maybe_reconcile(self) -> None:
        """Reconcile if something happened that may have left the record wrong, no
        fetch is on the wire, and the last failed attempt is not too recent. Runs in
        the consumer's thread; connection errors propagate to the caller."""
        if not self._needs_reconcile or self._fetches_on_wire:
            return
        if time.monotonic() - self._reconcile_failed_at < RECONCILE_RETRY_INTERVAL:
            return
        try:
            self.reconcile()
        except Exception:
            self._reconcile_failed_at = time.monotonic()
            raise

    def reconcile(self) -> list[str]:
        """Apply unconfirmed acks, then return the jobs of the record this process no
        longer holds to the front of their queues. Returns the tags returned."""
        self._needs_reconcile = False
        try:
            self.flush_acks()
            self.acks.flush()
            self._replay_acks()
            gc.collect()  # requests Celery dropped may sit in reference cycles
            held = self.holdings.held()
            stray = [t for t in self.record.tags() if t not in held]
            done = self.record.requeue(stray)
        except BaseException:
            self._needs_reconcile = True
            raise
        if done:
            logger.warning("celery_ext: returned %d job(s) of pool %s to the front of their "
                           "queues (fetched or reserved, then lost with a connection)",
                           len(done), self.pool_id)
        return done

    # -- moves out of the record -----------------------------------------------------------
    def ack(self, tags: list[str]) -> None:
        """Ack without waiting for the reply (``acks.AckSender``), in a batch with the
        acks made close to it (``ack_batcher.AckBatcher``: called from the thread that
        acks the job); never raises: an ack that cannot be sent now is applied by the
        next reconcile. The tags are "acking" from here on, so a reconcile never
        returns them."""
        self.holdings.acking(tags)
        self.batcher.add(tags)

    def flush_acks(self, wait: bool = False) -> None:
        """Write the acks made and not yet written (``AckBatcher.flush``)."""
        self.batcher.flush(wait)

    def on_loop_tick(self, loop: Any) -> None:
        """Each turn of the event loop ``loop``, in its thread
        (``AckBatcher.on_loop_tick``)."""
        self.batcher.on_loop_tick(loop)

    def before_job(self) -> None:
        """A job of this process starts (``AckBatcher.before_loop_job``)."""
        self.batcher.before_loop_job()

    def event_loop_gone(self) -> None:
        """The event loop closed or the pool stops (``AckBatcher.event_loop_gone``)."""
        self.batcher.event_loop_gone()

    def _write_ack_batch(self, tags: list[str]) -> None:
        """One ``ack`` call for ``tags``, sent without waiting for its reply."""
        keys, args = self.record.ack_call(tags)
        self.acks.ack(keys, args, tags)

    def _confirmed(self, tags: list[str]) -> None:
        """Redis applied these acks (the AckSender read their reply)."""
        self.holdings.confirmed(tags)
        self.record.finished(tags)

    def _ack_now(self, tags: list[str]) -> None:
        """The AckSender's fallback: apply acks synchronously, or keep them for replay."""
        try:
            self.record.ack(tags)
        except CONNECTION_ERRORS as exc:
            self.holdings.unconfirmed(tags)
            self.needs_reconcile()
            logger.warning("celery_ext: %d ack(s) could not reach Redis (%s); applied at "
                           "reconnect", len(tags), one_line(str(exc)))
        else:
            self.holdings.confirmed(tags)

    def _replay_acks(self) -> None:
        tags = self.holdings.to_replay()
        if tags:
            self.record.ack(tags)
            self.holdings.confirmed(tags)

    def requeue(self, tags: list[str]) -> list[str]:
        """Put jobs back at the front of their queues (reject with requeue). If Redis
        cannot be reached the process no longer holds them: the next reconcile returns
        them."""
        self.holdings.released(tags)
        try:
            return self.record.requeue(tags)
        except CONNECTION_ERRORS:
            self.needs_reconcile()
            raise

    def throttle(self, tag: str, hold_us: int, job: bytes = b"") -> str | None:
        """A job raised ``Throttled``: back to the front of its queue, its fair key or
        queue held (:meth:`InflightRecord.throttle`). If Redis cannot be reached the
        process no longer holds it: the next reconcile returns it (without the hold)."""
        self.holdings.released([tag])
        try:
            return self.record.throttle(tag, hold_us, job)
        except CONNECTION_ERRORS:
            self.needs_reconcile()
            raise

    def recover_lost(self, tag: str) -> str:
        """The job's prefork child died: requeue it now, counting a recovery, or
        dead-letter it past max_recoveries. Returns "requeued", "dead" or "gone"."""
        self.holdings.released([tag])
        try:
            copy = next(iter(self.record.locate([tag])), self.keys)
            _, requeued, dead = recover_tags(self.client, self.settings, self.pool_id, [tag],
                                             mode="job", reason="worker lost", keys=copy)
            self.record.finished([tag])
            if requeued and copy.copy_queue is not None:  # cluster: the home ready hint
                self.client.sadd(self.keys.ready, copy.copy_queue)
        except CONNECTION_ERRORS:
            self.needs_reconcile()
            raise
        if dead:
            logger.error("celery_ext: job %s killed its worker more than %d times; "
                         "moved to the dead set", one_line(tag), self.settings.max_recoveries)
            return "dead"
        return "requeued" if requeued else "gone"

    def run_periodic(self, app: Any) -> None:
        """Start the periodic leader of ``app``'s ``beat_schedule`` and the runtime entries
        (unless the setting ``periodic`` is off): while this pool holds the periodic lease,
        it enqueues each due run. Idempotent."""
        if self.periodic is not None or self.state != "running":
            return
        periodic = Periodic.for_app(app, self.requeuer.client, self.settings)
        if periodic is not None:
            self.periodic = PeriodicLeader(periodic, self.pool_id)
            self.periodic.start()

    def revive(self) -> None:
        """A fetch found the pool declared dead (its jobs were requeued): register again
        (and, on a cluster, join the queues' copies again before fetching)."""
        self.heartbeater.revive()
        self.record.forget_joins()


# -- the pools of this process -----------------------------------------------------------
_pools: dict[tuple[str, str], WorkerPool] = {}
_pools_lock = threading.Lock()


def pool_for(client_factory: Callable[[], redis.Redis], settings: Settings,
             server_id: str) -> WorkerPool:
    """This process's worker pool for one server and namespace (with its key prefix),
    started on first use."""
    key = (server_id, settings.global_keyprefix + settings.namespace)
    with _pools_lock:
        pool = _pools.get(key)
        if pool is None:
            pool = _pools[key] = WorkerPool(client_factory, settings, server_id)
    pool.start()
    return pool


#: The worker's event loop (Kombu's hub) the pools' acks wait for, once registered.
_event_loop: Any = None


def use_event_loop(loop: Any) -> None:
    """The worker's event loop runs: acks made in its thread are written by its turns
    and timers (``AckBatcher``) from its next turn on."""
    global _event_loop
    _event_loop = loop
    loop.on_tick.add(on_loop_tick)
    loop.on_close.add(on_loop_close)


def on_loop_tick() -> None:
    """Each turn of the worker's event loop: the pools write the acks it made when due."""
    for pool in list(_pools.values()):
        pool.on_loop_tick(_event_loop)


def on_loop_close(*_: Any) -> None:
    """The event loop closed: the pools write acks at once again."""
    for pool in list(_pools.values()):
        pool.event_loop_gone()


@task_prerun.connect(weak=False)
def _before_job(**_: Any) -> None:
    """A job starts in this process: one that runs in the event loop's thread (a solo
    pool) first writes the acks the loop made (``AckBatcher.before_loop_job``)."""
    for pool in list(_pools.values()):
        pool.before_job()


def live_pools() -> list[WorkerPool]:
    with _pools_lock:
        return list(_pools.values())


def stop_all() -> None:
    """Stop every pool of this process and forget it (worker shutdown, interpreter
    exit); a channel that fetches again afterwards starts a new one."""
    with _pools_lock:
        pools = list(_pools.values())
        _pools.clear()
    for pool in pools:
        try:
            pool.stop()
        except Exception:
            logger.exception("celery_ext: stopping worker pool %s failed", pool.pool_id)


def mark_all_stopping() -> None:
    for pool in live_pools():
        pool.mark_stopping()


class PollWaiting(Protocol):
    """A consumer's poll that waits without an event loop (``transport.wakeup``'s
    poller): a stopping worker ends it, so Celery's loop reads its shutdown flag at once."""

    def stop_soon(self) -> None: ...


#: The polls of this process that may wait without an event loop (weakly held).
_polls: weakref.WeakSet[Any] = weakref.WeakSet()


def register_poll(poll: PollWaiting) -> None:
    _polls.add(poll)


def stop_polls() -> None:
    """End every registered poll's wait, and make its next ones return at once: the
    worker is stopping (``bootsteps.begin_stopping``)."""
    for poll in list(_polls):
        poll.stop_soon()


def _forget_after_fork() -> None:
    """A forked child (a prefork pool process) owns none of its parent's pools: their
    threads and connections are the parent's."""
    global _pools, _pools_lock
    _pools = {}
    _pools_lock = threading.Lock()


os.register_at_fork(after_in_child=_forget_after_fork)
atexit.register(stop_all)
