"""How a client waits for results: one subscription, not one per result.

Celery's Redis backend subscribes to one channel per pending result (the leaks of
celery/celery#3808 and #6963; a group of 500 holds 501 channels). Here a client thread
listens on one channel of its own, named by the ``reply_to`` Celery stamps on every task
message it sends (``app.thread_oid``), and the worker that stores a result publishes its
meta there (``ResultBackend.store_result``). However many results the thread waits for,
it holds one subscription.

A thread subscribes when it first waits (``on_wait_for_pending``) and reads the results
it waits for once after that, so a result stored before is read and one stored after
wakes it; a process that sends tasks and never waits holds no subscription. Pub/sub is
at-most-once, and a result waited on by a client that did not send its task
(``AsyncResult(id).get()`` elsewhere, ``GroupResult.restore``) publishes nowhere this
client listens; so every ``RESULT_POLL_INTERVAL`` without a wake-up the waiting thread
re-reads all its pending results in one MGET. The wake-up is the fast path, the read the
truth.

On a cluster a classic PUBLISH is copied to every node over the cluster bus; the channel
carries a hash tag of its own and the worker sends it with SPUBLISH, which stays on the
shard that owns that tag, where the client subscribed with SSUBSCRIBE.

Celery keeps one backend per thread (``app.backend`` is thread-local), so a consumer is
used by its thread, and by the garbage collector's ``cancel_for`` (``AsyncResult.__del__``),
which only edits a set and never blocks. A backend shared by threads
(``result_backend_thread_safe``) subscribes every waiting thread's channel: on one node on
its one connection; on a cluster on one connection per shard those channels live on
(SSUBSCRIBE takes channels of one shard), read in turn.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from celery import states
from celery.backends.asynchronous import BaseResultConsumer
from redis.cluster import RedisCluster
from redis.exceptions import RedisClusterException

from celery_ext.config import (
    RESULT_POLL_INTERVAL,
    RESULT_RESUBSCRIBE_AFTER,
    RESULT_SHARD_READ_SLICE,
)


class WakeupConsumer(BaseResultConsumer):
    """Waits for the results of one client thread on its one wake-up channel."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._pending: set[str] = set()
        self._channels: set[str] = set()
        #: The subscriptions: one node's under "", a cluster's one per shard (node name).
        self._pubsubs: dict[str, Any] = {}
        self._lock = threading.Lock()
        self._last_poll = 0.0
        #: After a broken subscription: no new one before this (monotonic) time.
        self._subscribe_after = 0.0

    # -- what Celery calls ------------------------------------------------------------

    def start(self, initial_task_id: str, **kwargs: Any) -> None:
        self.consume_from(initial_task_id)

    def consume_from(self, task_id: str) -> None:
        self._pending.add(task_id)

    def cancel_for(self, task_id: str) -> None:
        self._pending.discard(task_id)

    def listen(self, oid: str) -> None:
        """Subscribe to the wake-up channel of ``oid`` (the ``reply_to`` of the tasks this
        thread sends), before reading the results it waits for, so none falls between.
        A backend shared by threads (``result_backend_thread_safe``) adds each thread's
        channel: to its one connection, on a cluster to the connection of the channel's
        shard."""
        channel = self.backend.keys.wake_channel(oid)
        if channel in self._channels:
            return
        with self._lock:
            self._channels.add(channel)
            if not self._pubsubs:
                self._subscribe()
                return
            try:
                self._add(channel)
            except (RedisClusterException, *self.backend.connection_errors):
                self._broken()  # polling carries on; a later drain subscribes again

    def stop(self) -> None:
        with self._lock:
            self._close()

    def on_after_fork(self) -> None:
        self._lock = threading.Lock()
        self._pubsubs = {}  # the parent's sockets: left to the parent
        self._pending.clear()

    def on_wait_for_pending(self, result: Any, timeout: float | None = None,
                            **kwargs: Any) -> None:
        # Subscribed when a thread first waits, not when it sends (a process that only
        # sends holds nothing); then a result stored before, which published to nobody,
        # is read once: stored after the subscription, its wake-up arrives.
        self.listen(self.app.thread_oid)
        for meta in result._iter_meta(**kwargs):
            if meta is not None:
                self.on_state_change(meta, None)

    def on_state_change(self, meta: dict[str, Any], message: Any) -> None:
        super().on_state_change(meta, message)
        if meta["status"] in states.READY_STATES:
            self._pending.discard(meta["task_id"])

    def drain_events(self, timeout: float | None = None) -> None:
        """Wait up to ``timeout`` for a wake-up and hand what arrives to Celery; re-read
        the pending results when ``RESULT_POLL_INTERVAL`` passed without one."""
        wait = RESULT_POLL_INTERVAL if timeout is None else min(timeout, RESULT_POLL_INTERVAL)
        if not self._lock.acquire(timeout=wait):
            return  # another caller of this thread's backend is reading
        try:
            got = self._read(wait)
            now = time.monotonic()
            if not got and now - self._last_poll >= RESULT_POLL_INTERVAL:
                self._last_poll = now
                self._poll()
        finally:
            self._lock.release()

    # -- the subscription -------------------------------------------------------------

    def _subscribe(self) -> None:
        client = self.backend.client
        if not self._channels or time.monotonic() < self._subscribe_after:
            return
        try:
            if isinstance(client, RedisCluster) and self._subscribe_after:
                # It broke before: the shards may have moved (the slot map, read again).
                client.nodes_manager.initialize()
            for channel in self._channels:
                self._add(channel)
        except (RedisClusterException, *self.backend.connection_errors):
            self._broken()  # polling carries on; a later drain subscribes again

    def _add(self, channel: str) -> None:
        """Subscribe ``channel`` on the connection of its node (made on first use)."""
        client = self.backend.client
        if not isinstance(client, RedisCluster):
            pubsub = self._pubsubs.get("")
            if pubsub is None:
                pubsub = self._pubsubs[""] = client.pubsub(ignore_subscribe_messages=True)
            pubsub.subscribe(channel)
            return
        node = client.get_node_from_key(channel)
        pubsub = self._pubsubs.get(node.name)
        if pubsub is None:
            pubsub = client.get_redis_connection(node).pubsub(ignore_subscribe_messages=True)
            self._pubsubs[node.name] = pubsub
        pubsub.ssubscribe(channel)

    def _broken(self) -> None:
        self._close()
        self._subscribe_after = time.monotonic() + RESULT_RESUBSCRIBE_AFTER

    def _close(self) -> None:
        for pubsub in self._pubsubs.values():
            try:
                pubsub.close()
            except Exception:  # a broken socket is closed all the same
                pass
        self._pubsubs = {}

    def _read(self, wait: float) -> bool:
        """Read wake-ups for up to ``wait`` seconds; True when one arrived."""
        if not self._pubsubs:
            self._subscribe()
            if not self._pubsubs:
                time.sleep(wait)
            return False
        pubsubs = list(self._pubsubs.values())
        # One subscription: wait on it. Several (a shared backend's threads on several
        # shards): wait on each in turn a slice at a time.
        step = wait if len(pubsubs) == 1 else RESULT_SHARD_READ_SLICE
        got = False
        deadline = time.monotonic() + wait
        try:
            while True:
                for pubsub in pubsubs:
                    left = deadline - time.monotonic()
                    while True:
                        timeout = min(max(left, 0), step) if not got else 0
                        message = pubsub.get_message(timeout=timeout)
                        if message is None:
                            break
                        if message.get("type") in ("message", "smessage"):
                            got = True
                            self.on_state_change(
                                self.backend.decode_result(message["data"]), message)
                if got or time.monotonic() >= deadline:
                    return got
        except self.backend.connection_errors:
            # A cut or a failover: read what the cut may have hidden, and subscribe again
            # (maybe on another node) once the dust settled.
            self._broken()
            self._poll()
            self._last_poll = time.monotonic()
            return True

    def _poll(self) -> None:
        """Re-read every pending result (one MGET; per slot on a cluster)."""
        pending = list(self._pending)
        if not pending:
            return
        try:
            values = self.backend.mget([self.backend.get_key_for_task(t) for t in pending])
        except self.backend.connection_errors:
            return
        for value in values:
            if value:
                meta = self.backend.decode_result(value)
                if meta["status"] in states.READY_STATES:
                    self.on_state_change(meta, None)
