"""The master a set of Redis Sentinels names: one node whose address comes from the
sentinels at connect time."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import redis

from celery_ext.store.connections import (
    SentinelConfig,
    connections_for,
    sentinel_connection_class,
)
from celery_ext.transport.topology.node import OneNode

if TYPE_CHECKING:
    from celery_ext.transport.channel import Channel


class Sentinel(OneNode):
    """The master a set of sentinels names: one node whose address the sentinels give
    at connect time (redis-py's ``SentinelManagedConnection``)."""

    def __init__(self, channel: Channel, conninfo: Any, config: SentinelConfig) -> None:
        super().__init__(channel, conninfo)
        self.config = config
        self.tls = config.tls

    def prepare(self) -> None:
        channel = self.channel
        channel.connection_class = sentinel_connection_class()
        channel.connection_class_ssl = sentinel_connection_class(tls=True)

    @property
    def server_id(self) -> str:
        return self.config.server_id

    def _own_connections(self, params: dict[str, Any]) -> redis.ConnectionPool:
        return connections_for(params, self.config)

    def connections(self, asynchronous: bool, kombu: Callable[[bool], Any]) -> Any:
        channel = self.channel
        params = channel._connparams(asynchronous=asynchronous)
        channel.keyprefix_fanout = channel.keyprefix_fanout.format(db=self.config.db)
        pool = connections_for(params, self.config)
        # Kept so that closing the channel also closes the connections to the sentinels.
        manager = getattr(pool, "sentinel_manager", None)
        if asynchronous:
            channel._async_sentinel_manager = manager
        else:
            channel._sentinel_manager = manager
        return pool

