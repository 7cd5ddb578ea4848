"""A Redis Cluster: commands through redis-py's ``RedisCluster``, the key layout copied
per job queue (``store/keys.py``), a fetch that runs one script per copy of its
candidates, and the home ``ready`` hint kept true (docs/cluster.md)."""

from __future__ import annotations

from collections.abc import Callable
from time import monotonic
from typing import TYPE_CHECKING, Any

import redis

from celery_ext.store.connections import ClusterConfig, cluster_client
from celery_ext.store.copies import run_scripts
from celery_ext.store.keys import Keys
from celery_ext.transport.fetch import fetch_call
from celery_ext.transport.topology.base import Topology

if TYPE_CHECKING:
    from celery_ext.transport.channel import Channel

#: On a cluster, seconds between two checks of a pool's queues' own lists (one
#: pipeline), beside the check of every new channel (a start, a reconnect): the ready
#: hint's safety net for a writer that died between its push, whose wake-up reached
#: the pools subscribed then, and its hint.
CLUSTER_RECHECK_INTERVAL = 300.0


class Cluster(Topology):
    """A Redis Cluster: commands go through redis-py's ``RedisCluster`` (slot routing,
    MOVED/ASK, a failover's new topology); the channel's own connections go to the
    master of the namespace's home slot; each job queue's records live in its copy."""

    def __init__(self, channel: Channel, config: ClusterConfig) -> None:
        super().__init__(channel)
        self.config = config
        self._client: Any = None
        #: The reply of the fetch run synchronously by :meth:`send_fetch`.
        self._reply: list[Any] | None = None
        self._recheck_at = 0.0

    def prepare(self) -> None:
        """Nothing: Kombu's bindings live in the home copy (its scripts touch one slot),
        which the channel's ``Keys`` name (``Channel.__init__``)."""

    @property
    def server_id(self) -> str:
        return self.config.server_id

    def client(self) -> Any:
        """This channel's :class:`~redis.cluster.RedisCluster`."""
        if self._client is None:
            self._client = cluster_client(self.config, self._params())
        return self._client

    def _params(self) -> dict[str, Any]:
        """Connection keywords of this channel (timeouts, TLS), for every node."""
        params = self.channel._connparams(asynchronous=False)
        params.pop("retry_on_timeout", None)  # redis-py's cluster retries timeouts itself
        return params

    def connections(self, asynchronous: bool, kombu: Callable[[bool], Any]) -> Any:
        channel = self.channel
        params = channel._connparams(asynchronous=asynchronous)
        node = self.client().get_node_from_key(channel.keys.home.prefix)
        params.update(host=node.host, port=node.port, db=0)
        channel.keyprefix_fanout = channel.keyprefix_fanout.format(db=0)
        return redis.ConnectionPool(**params)

    def create_client(self, asynchronous: bool, kombu: Callable[[bool], Any]) -> Any:
        if not asynchronous:
            return self.client()
        return kombu(asynchronous)

    def scripts_client(self) -> Any:
        return self.client()

    def new_client(self) -> Any:
        return cluster_client(self.config, self._params())

    def publish_connections(self) -> Callable[[], Any] | None:
        return None

    def refresh_bindings(self, queues: Any, kombu: Callable[[Any], None]) -> None:
        """Kombu's refresh without its pipeline, which a cluster client refuses for
        scripts (the bindings and their deadlines share the home slot)."""
        channel = self.channel
        with channel.conn_or_acquire() as client:
            for queue in queues:
                for exchange, routing_key, args in channel.state.queue_bindings(queue):
                    _, pattern, _ = channel.typeof(exchange).prepare_bind(
                        queue, exchange, routing_key, args)
                    channel._refresh_binding(
                        keys=[channel.keyprefix_queue % (exchange,),
                              channel._script_binding_deadlines],
                        args=[channel.sep.join([routing_key or "", pattern or "", queue]),
                              exchange, channel._binding_ttl(queue)], client=client)

    def copy_of(self, tag: str, queue: str | None = None) -> Keys:
        keys = self.channel.keys
        found = next(iter(self.channel.worker_pool.record.locate([tag])), None)
        if found is not None:
            return found
        return keys.of(queue) if queue else keys

    def fetched(self, tag: str, queue: str) -> None:
        """Note which copy's record holds it."""
        self.channel.worker_pool.fetched(tag, queue)

    def fetch(self, client: Any, pool_id: str, queues: list[str], flags: str) -> Any:
        """One ``fetch`` call per queue copy of the candidates, in one pipeline (one
        round trip per master visited); their replies merged into one as the script
        gives it on one node. A copy that refuses the pool (the reaper recovered its
        jobs there) makes the status 0; the jobs of the others count."""
        channel = self.channel
        groups = channel.keys.groups(queues)
        flag_of = dict(zip(queues, flags, strict=True))
        if pool_id != "-":
            channel.worker_pool.join(list(groups))
        settings = channel.settings
        # (A promoted replica's script cache is empty: run_scripts loads and resends.)
        replies = run_scripts(client, channel.scripts, [
            ("fetch", *fetch_call(k, settings, pool_id, qs, "".join(flag_of[q] for q in qs)))
            for k, qs in groups.items()])
        status, jobs, empties, blocked, waits = 1, [], [], [], []
        dropped: list[Any] = []
        for reply in replies:
            status = min(status, int(reply[0]))
            jobs += reply[1]
            empties += reply[2]
            blocked += reply[3]
            waits += reply[4]
            dropped += reply[5] if len(reply) > 5 else []
        return [status, jobs, empties, blocked, waits, *([dropped] if dropped else [])]

    def send_fetch(self, conn: Any, pool_id: str, queues: list[str], flags: str,
                   lost: Callable[[], None]) -> None:
        """The candidates' copies live on several masters: the fetch runs here, one
        pipeline (one round trip per master visited), and a PING on the channel's own
        connection hands its reply to the event loop's reading code."""
        try:
            self._reply = self.fetch(self.client(), pool_id, queues, flags)
        except BaseException:
            lost()
            raise
        conn.send_command("PING")

    def read_fetch(self, conn: Any, **options: Any) -> Any:
        reply, self._reply = self._reply, None
        self.channel.client.parse_response(conn, "PING", **options)
        assert reply is not None
        return reply

    def emptied(self, queues: list[str]) -> list[str]:
        """Take them out of the home hint, then look at their lists and put back those
        that hold jobs again. A push after the fetch was onto an empty list, and its
        producer adds the queue to the hint after our removal; an earlier one is seen
        here."""
        self.client().srem(self.channel.keys.home.ready, *queues)
        return self._holding_jobs(queues)

    def recheck(self, queues: Callable[[], list[str]]) -> list[str]:
        """The ready set read next is the home copy's hint: the queues' own lists are
        looked at when the channel starts and every ``CLUSTER_RECHECK_INTERVAL`` (a
        writer may have died between its script and its hint)."""
        if monotonic() < self._recheck_at:
            return []
        self._recheck_at = monotonic() + CLUSTER_RECHECK_INTERVAL
        return self._holding_jobs(queues())

    def _holding_jobs(self, queues: list[str]) -> list[str]:
        """Those of ``queues`` whose lists hold jobs, added to the home hint: one
        pipeline, one round trip per master."""
        if not queues:
            return []
        channel = self.channel
        client = self.client()
        with client.pipeline(transaction=False) as pipe:
            for q in queues:
                pipe.exists(*channel.job_queues.levels(q), channel.keys.of(q).fair_ring(q))
            found = [q for q, n in zip(queues, pipe.execute(), strict=True) if int(n)]
        if found:
            client.sadd(channel.keys.home.ready, *found)
        return found

