"""One Redis server: Kombu's own connections and clients, one copy of the key layout."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import redis

from celery_ext.store import scripts as _scripts
from celery_ext.store.connections import connections_for
from celery_ext.store.keys import Keys
from celery_ext.transport.fetch import fetch_call
from celery_ext.transport.topology.base import Topology

if TYPE_CHECKING:
    from celery_ext.transport.channel import Channel


#: Packed fetch commands a channel keeps, by pool id, flags and candidates (an idle pool
#: sends the same fetch after every wake-up, a busy one a few kinds): building a fetch's
#: keys and encoding its arguments one by one cost about as much as its round trip.
PACKED_FETCHES_KEPT = 64


class OneNode(Topology):
    """One Redis server: Kombu's own connections, one copy of the layout."""

    def __init__(self, channel: Channel, conninfo: Any) -> None:
        super().__init__(channel)
        self._conninfo = conninfo
        self._server_id: str | None = None
        self._shared: Any = None
        self._packed_fetches: dict[tuple[str, ...], Any] = {}

    def prepare(self) -> None:
        """Kombu's connection classes and binding keys, as they are."""

    @property
    def server_id(self) -> str:
        if self._server_id is None:
            c = self._conninfo
            self._server_id = f"{c.hostname}:{c.port}/{c.virtual_host}"
        return self._server_id

    def connections(self, asynchronous: bool, kombu: Callable[[bool], Any]) -> Any:
        return kombu(asynchronous)

    def create_client(self, asynchronous: bool, kombu: Callable[[bool], Any]) -> Any:
        return kombu(asynchronous)

    def client(self) -> Any:
        """One client per channel and connection pool: Kombu builds a fresh
        ``redis.Redis`` for every publish, a sixth of the cost of ``apply_async``.
        (redis-py clients are thread-safe over their pool.)"""
        pool = self.channel.pool
        shared = self._shared
        if shared is None or shared.connection_pool is not pool:
            shared = self._shared = self.channel._create_client()
        return shared

    def scripts_client(self) -> Any:
        return self.channel.client

    def new_client(self) -> Any:
        params = self.channel._connparams(asynchronous=False)
        return redis.Redis(connection_pool=self._own_connections(params))

    def _own_connections(self, params: dict[str, Any]) -> redis.ConnectionPool:
        return connections_for(params)

    def publish_connections(self) -> Callable[[], Any] | None:
        channel = self.channel
        return lambda: channel.pool

    def refresh_bindings(self, queues: Any, kombu: Callable[[Any], None]) -> None:
        kombu(queues)

    def copy_of(self, tag: str, queue: str | None = None) -> Keys:
        return self.channel.keys

    def fetched(self, tag: str, queue: str) -> None:
        """One copy: the pool's record needs no note of it."""

    def fetch(self, client: Any, pool_id: str, queues: list[str], flags: str) -> Any:
        channel = self.channel
        keys, args = fetch_call(channel.keys, channel.settings, pool_id, queues, flags)
        return channel.scripts("fetch", keys, args, client=client)

    def send_fetch(self, conn: Any, pool_id: str, queues: list[str], flags: str,
                   lost: Callable[[], None]) -> None:
        """Send the script itself (by SHA: the event loop has no NOSCRIPT fallback; a
        failed send is read, and counted lost, as its reply), packed once per kind of
        fetch (``PACKED_FETCHES_KEPT``), by hiredis, as a publish is: redis-py's packer
        costs several times that."""
        kind = (pool_id, flags, *queues)
        packed = self._packed_fetches.get(kind)
        if packed is None:
            channel = self.channel
            keys, args = fetch_call(channel.keys, channel.settings, pool_id, queues, flags)
            packed = _scripts.pack_evalsha(_scripts.sha("fetch"), keys, args)
            if len(self._packed_fetches) >= PACKED_FETCHES_KEPT:
                self._packed_fetches.clear()
            self._packed_fetches[kind] = packed
        conn.send_packed_command([packed])

    def read_fetch(self, conn: Any, **options: Any) -> Any:
        return self.channel.client.parse_response(conn, "EVALSHA", **options)

    def emptied(self, queues: list[str]) -> list[str]:
        """The script itself took them out of the ready set."""
        return []

    def recheck(self, queues: Callable[[], list[str]]) -> list[str]:
        """The ready set is written by the same scripts as the lists: nothing to check."""
        return []

    def declare(self, client: Any, lists: list[list[str]],
                bindings: list[tuple[str, str, list[str]]]) -> list[int]:
        """One ``declare.lua`` call: one reply instead of a pipeline's one per command
        (60,000 of them for 10,000 job names of four priority levels)."""
        keys = [key for levels in lists for key in levels]
        args: list[Any] = [len(lists[0]) if lists else 1, len(lists)]
        for table, permanent, members in bindings:
            keys += [table, permanent]
            args += [len(members), *members]
        return [int(n) for n in self.channel.scripts("declare", keys, args, client=client)]
