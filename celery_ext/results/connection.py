"""Result backend URL -> a redis-py client, through the plugin's connection layer.

The backend takes the broker's URL forms (``store/connections.py``): ``celery-ext://`` and
``celery-exts://`` (TLS) to one node or, with the ``cluster`` option of
``result_backend_transport_options``, to a cluster's seed node; ``celery-ext+sentinel://``
(``;``-separated sentinels, ``master_name`` in the options). Errors are one line with the
password masked (``ConfigError``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import redis
from redis.connection import parse_url

from celery_ext.config import DEFAULT_CONNECT_TIMEOUT, ConfigError, Settings, mask_url, redis_url
from celery_ext.store.connections import (
    cluster_client,
    cluster_config,
    connections_for,
    green_connections,
    keepalive_options,
    sentinel_config,
)


def socket_params(settings: Settings) -> dict[str, Any]:
    """Timeouts and keep-alive for every connection of the backend: a silent server or
    a vanished peer (a failed-over master) is noticed instead of waited on forever. Under
    gevent, room for every greenlet at once (the backend is shared by them)."""
    return green_connections({
        "socket_timeout": settings.reply_timeout,
        "socket_connect_timeout": min(DEFAULT_CONNECT_TIMEOUT, settings.reply_timeout),
        "socket_keepalive": True, "socket_keepalive_options": keepalive_options()})


def results_client(url: str, options: Mapping[str, Any], settings: Settings) -> Any:
    """A synchronous client for the result backend's ``url``: a ``RedisCluster`` with the
    ``cluster`` option, a client of the master the sentinels name for a sentinel URL, a
    plain ``redis.Redis`` otherwise."""
    params = socket_params(settings)
    try:
        cluster = cluster_config([url], options)
        sentinel = None if cluster is not None else sentinel_config([url], options)
    except ConfigError as exc:  # the broker's checks, said of the result backend
        raise ConfigError(str(exc).replace("broker URL", "result backend URL").replace(
            "broker_transport_options", "result_backend_transport_options")) from None
    if cluster is not None:
        return cluster_client(cluster, params)
    if sentinel is not None:
        return redis.Redis(connection_pool=connections_for(params, sentinel))
    try:
        kwargs = parse_url(redis_url(url))
    except ValueError:
        raise ConfigError(f"celery_ext: result backend URL {mask_url(url)}: cannot read "
                          "host:port/db (the port and db must be whole numbers; "
                          "percent-encode / @ : in a password)") from None
    kwargs.update(params)
    return redis.Redis(connection_pool=redis.ConnectionPool(**kwargs))
