"""A job queue as Kombu manages it: its lists, size, purge, delete, declaration and
bindings.

A job queue is more than Kombu's one list: a list per priority level (``options/
priority.py``), and for fair keys a ring of active keys and a sub-queue per key
(``options/fair.py``). Kombu's ``queue_declare``/``_size``/``_purge``/``_delete``/
``_has_queue`` see all of them. Declaring many queues at a worker's start takes one
round trip (:meth:`JobQueues.predeclared`: one script call on one node), and a binding
is written even when Redis is at maxmemory, so a pool starts and drains a full Redis.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import redis
from kombu.utils.encoding import bytes_to_str

if TYPE_CHECKING:
    from celery_ext.transport.channel import Channel

logger = logging.getLogger("celery_ext.transport.queues")


class JobQueues:
    """The job queues of one channel, in Redis."""

    def __init__(self, channel: Channel) -> None:
        self.channel = channel
        #: Sizes and bindings :meth:`predeclared` wrote, for Kombu's calls inside it (a
        #: queue's size is read only when it has an ``on_declared`` callback; the others
        #: report 0, see :meth:`predeclared`).
        self._predeclared_sizes: dict[str, int] = {}
        self._prebound: set[tuple[str, str, str, str]] = set()

    def levels(self, queue: str) -> list[str]:
        """The lists of a job queue, one per priority level (see :mod:`.priority`)."""
        channel = self.channel
        return channel.keys.of(queue).queue_levels(queue, channel.settings.priority_steps)

    def _sub_queues(self, client: Any, queue: str) -> list[str]:
        """The sub-queues of a job queue's fair keys with jobs (:mod:`.fair`)."""
        k = self.channel.keys.of(queue)
        return [k.fair_queue(queue, bytes_to_str(key))
                for key in client.lrange(k.fair_ring(queue), 0, -1)]

    def size(self, queue: str) -> int:
        size = self._predeclared_sizes.pop(queue, None)
        if size is not None:  # read by predeclared() a moment ago, in the same start-up
            return size
        with self.channel.conn_or_acquire() as client, \
                client.pipeline(transaction=False) as pipe:
            for key in [*self.levels(queue), *self._sub_queues(client, queue)]:
                pipe.llen(key)
            return sum(int(n) for n in pipe.execute())

    def _drop_lists(self, client: Any, queue: str) -> int:
        """Delete every list of a job queue (levels, fair ring and sub-queues) and the
        index entries and recovery counts of the jobs in them, in one script
        (``purge.lua``). Returns how many jobs were removed."""
        k = self.channel.keys.of(queue)
        return int(self.channel.scripts(
            "purge", [k.ready, k.job_index, k.redelivery, *self.levels(queue)], [queue],
            client=client))

    def purge(self, queue: str) -> int:
        with self.channel.conn_or_acquire() as client:
            return self._drop_lists(client, queue)

    def exists(self, queue: str) -> bool:
        with self.channel.conn_or_acquire() as client:
            return bool(client.exists(*self.levels(queue),
                                      self.channel.keys.of(queue).fair_ring(queue)))

    def delete(self, queue: str, exchange: str, routing_key: str, pattern: str,
               client: Any = None) -> None:
        channel = self.channel
        channel.auto_delete_queues.discard(queue)
        member = channel.sep.join([routing_key or "", pattern or "", queue or ""])
        with channel.conn_or_acquire(client=client) as client:
            self._drop_lists(client, queue)
            with client.pipeline() as pipe:
                pipe.srem(channel.keyprefix_queue % (exchange,), member)
                pipe.srem(channel.keyprefix_binding_permanent % (exchange,), member)
                pipe.execute()

    def update_expiry(self, client: Any, queue: str) -> None:
        expires = self.channel._expires
        if expires and queue in expires:
            for key in self.levels(queue):
                client.pexpire(key, expires[queue])

    @contextmanager
    def predeclared(self, queues: Iterable[Any]) -> Iterator[None]:
        """Declare many queues in one round trip (``Topology.declare``: one script call on
        one node): a worker consuming 1,000 job queues otherwise spends two round trips
        per queue at start (Kombu's ``queue_declare`` reads the size, ``queue_bind`` adds
        the binding). Inside the block, the
        per-queue ``_size`` and ``_queue_bind`` of these queues use what this call
        did; only plain queues on a direct exchange (no expiry or extra bindings)
        are handled here, the others go the usual way.

        Only a queue with an ``on_declared`` callback (Kombu hands it the message count)
        has its size read: for the others the count ``queue_declare`` returns inside the
        block is 0, and nothing reads it (Kombu's ``Consumer.declare`` drops it). A size
        is an ``LLEN`` per priority level and a key per level in the call: 40,000 keys of
        the call's 60,000 at 10,000 job names, for counts nobody read (issue 36)."""
        channel = self.channel
        binds: dict[str, list[str]] = {}
        prebound: set[tuple[str, str, str, str]] = set()
        names: list[str] = []
        sized: list[str] = []
        for q in queues:
            ex = q.exchange
            if (q.no_declare or q.bindings or q.expires is not None or q.queue_arguments
                    or not q.name or (ex is not None and ex.name and ex.type != "direct")):
                continue
            if ex is not None and ex.name:  # Kombu binds only queues with a named exchange
                rkey, pattern, _ = channel.exchange_types["direct"].prepare_bind(
                    q.name, ex.name, q.routing_key, q.binding_arguments)
                binds.setdefault(ex.name, []).append(
                    channel.sep.join([rkey or "", pattern or "", q.name]))
                prebound.add((ex.name, rkey, pattern, q.name))
            names.append(q.name)
            if q.on_declared is not None:
                sized.append(q.name)
        if len(names) > 1:
            try:
                with channel.conn_or_acquire() as client:
                    sizes = channel.topology.declare(
                        client, [self.levels(name) for name in sized],
                        [(channel.keyprefix_queue % (exchange,),
                          channel.keyprefix_binding_permanent % (exchange,), members)
                         for exchange, members in binds.items()])
            except redis.exceptions.ResponseError:
                # e.g. out of memory on a cluster (its pipeline's SADD; the script of one
                # node writes at maxmemory): the per-queue path reports it on its queue.
                logger.debug("celery_ext: batched queue declaration failed", exc_info=True)
            else:
                self._predeclared_sizes = dict.fromkeys(names, 0)
                self._predeclared_sizes.update(zip(sized, map(int, sizes), strict=True))
                self._prebound = prebound
        try:
            yield
        finally:
            self._predeclared_sizes = {}
            self._prebound = set()

    # -- bindings ------------------------------------------------------------------------
    def bind(self, exchange: str, routing_key: str, pattern: str, queue: str,
             kombu: Callable[[str, str, str, str], None]) -> None:
        """Kombu's ``_queue_bind`` (``kombu``), unless :meth:`predeclared` wrote the
        binding already; at maxmemory, through bind.lua."""
        key = (exchange, routing_key, pattern, queue)
        if key in self._prebound:
            self._prebound.discard(key)  # written by predeclared()
            return
        try:
            kombu(exchange, routing_key, pattern, queue)
        except redis.exceptions.OutOfMemoryError:
            # Redis is full: write the binding anyway, so a worker starts and drains it;
            # an enqueue is still refused, at publish.
            self._bind_at_maxmemory(exchange, routing_key, pattern, queue)

    def refresh_bindings(self, queues: Any, kombu: Callable[[Any], None]) -> None:
        """Kombu's periodic refresh of expiring bindings (the remote-control queue; the
        topology's way), also at maxmemory: otherwise Kombu logs a traceback each time
        and, after the binding TTL, ``celery inspect`` stops reaching a pool that is
        draining a full Redis."""
        channel = self.channel
        try:
            channel.topology.refresh_bindings(queues, kombu)
        except redis.exceptions.OutOfMemoryError:
            for queue in queues:
                for exchange, routing_key, args in channel.state.queue_bindings(queue):
                    _, pattern, _ = channel.typeof(exchange).prepare_bind(
                        queue, exchange, routing_key, args)
                    self._bind_at_maxmemory(exchange, routing_key, pattern, queue)

    def _bind_at_maxmemory(self, exchange: str, routing_key: str, pattern: str,
                           queue: str) -> None:
        """Kombu's binding writes through bind.lua, which may run at maxmemory."""
        channel = self.channel
        ttl = int(channel._binding_ttl(queue)) if queue in channel._expires else 0
        keys = [channel.keyprefix_queue % (exchange,),
                channel._script_binding_deadlines if ttl
                else channel.keyprefix_binding_permanent % (exchange,)]
        member = channel.sep.join([routing_key or "", pattern or "", queue or ""])
        with channel.conn_or_acquire() as client:
            channel.scripts("bind", keys, [member, exchange, ttl], client=client)
